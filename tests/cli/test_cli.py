"""The ``gradcoll`` command explains itself: help for every command and flag, bad values refused before anything starts.

Every bad value runs the real ``python -m gradcoll`` in a subprocess and must
end as an argparse error: exit status 2, the command's usage line, a message
naming what is wrong (and the valid choices or forms), no traceback, nothing
on stdout (the bench prints its header before it starts ranks) and no rank
started.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gradcoll.algorithms import ALLREDUCE
from gradcoll.cli import build_parser
from gradcoll.cli._args import HelpFormatter

pytestmark = pytest.mark.timeout(60)

SUMMARIES = {
    "launch": "start N local ranks of a Python script",
    "bench": "time allreduce over local ranks and print an nccl-tests-style table",
    "demo": "train a small model data-parallel over local ranks",
    "stragglers": "name the ranks whose late arrival made the others wait",
}


def gradcoll(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradcoll", *args], capture_output=True, text=True, timeout=timeout)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_help_lists_every_command_with_its_summary() -> None:
    r = gradcoll("--help")
    assert r.returncode == 0, r.stderr
    for name, summary in SUMMARIES.items():
        assert name in r.stdout
        assert summary in flat(r.stdout), f"{name}: {summary!r} missing from\n{r.stdout}"
    _, parsers = build_parser()
    assert set(parsers) == set(SUMMARIES)


@pytest.mark.parametrize("command", sorted(SUMMARIES))
def test_every_option_has_help_with_its_default(command: str) -> None:
    _, parsers = build_parser()
    p = parsers[command]
    assert p.description and len(p.description) > 40
    fmt = HelpFormatter(p.prog)
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command}: {action.option_strings or action.dest} has no help"
        shown = fmt._get_help_string(action) or ""
        if action.option_strings and action.nargs != 0 and not action.required:
            # a default argparse fills in is shown, or the help says what leaving the option out does
            assert "(default" in shown or "default:" in shown, f"{command} {action.option_strings}: {shown!r}"
            if action.default not in (None, argparse.SUPPRESS) and "%(default)" in shown:
                assert (shown % {"default": action.default}).endswith(f"(default: {action.default})")
    r = gradcoll(command, "--help")
    assert r.returncode == 0 and f"usage: gradcoll {command}" in r.stdout


def test_bench_help_documents_sizes_and_json_fields() -> None:
    from gradcoll.cli.bench import FIELDS

    r = gradcoll("bench", "--help")
    text = flat(r.stdout)
    assert "4K, 1M, 1G" in text
    assert "pip install 'gradcoll[plot]'" in text
    for field, _ in FIELDS:
        assert f" {field} " in text


def test_bench_module_doc_documents_every_field() -> None:
    import gradcoll.cli.bench as bench

    doc = bench.__doc__ or ""
    for field, _ in bench.FIELDS:
        assert f"`{field}`" in doc, field


def _refused(r: subprocess.CompletedProcess[str], command: str, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""  # nothing ran: the bench's header, a rank's output would be here
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"usage: gradcoll {command}"), r.stderr
    for needle in needles:
        assert needle in flat(r.stderr), f"{needle!r} not in\n{r.stderr}"


@pytest.fixture
def marker_script(tmp_path):
    """A script that leaves a file behind when a rank runs it."""
    mark = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(mark)!r}, 'a').write('x')\n")
    return script, mark


@pytest.mark.parametrize("args, needle", [
    (["-n", "0"], "argument -n/--nprocs: must be a positive integer, got '0'"),
    (["-n", "-2"], "must be a positive integer, got '-2'"),
    (["-n", "two"], "must be a positive integer, got 'two'"),
    (["-n", "2", "--master-port", "70000"], "argument --master-port: must be a port number from 1 to 65535"),
    (["-n", "2", "--timeout", "0"], "argument --timeout: must be a positive number"),
    (["-n", "2", "--backend", "carrier-pigeon"], "invalid choice: 'carrier-pigeon' (choose from 'tcp', 'shm', 'inproc', 'mpi')"),
])
def test_launch_refuses_bad_values_before_starting_ranks(marker_script, args, needle) -> None:
    script, mark = marker_script
    _refused(gradcoll("launch", *args, str(script)), "launch", needle)
    assert not mark.exists()


def test_launch_refuses_a_missing_script(tmp_path) -> None:
    missing = tmp_path / "nope.py"
    _refused(gradcoll("launch", "-n", "2", str(missing)), "launch", f"argument script: no such file: '{missing}'")


def test_launch_still_runs_a_script(marker_script) -> None:
    script, mark = marker_script
    r = gradcoll("launch", "-n", "2", str(script))
    assert r.returncode == 0, r.stderr
    assert mark.read_text() == "xx"


@pytest.mark.parametrize("args, needle", [
    (["--algorithm", "bogus"], "argument --algorithm: 'bogus': give one or more of "
                               + ", ".join(["auto", *ALLREDUCE]) + ", comma-separated, each once"),
    (["--algorithm", "ring,ring"], "argument --algorithm: 'ring,ring': give one or more of"),
    (["--algorithm", "ring,bogus"], "argument --algorithm: 'ring,bogus': give one or more of"),
    (["-n", "0"], "argument -n/--nprocs: must be a positive integer, got '0'"),
    (["--min-size", "4X"], "argument --min-size: invalid size '4X': give bytes as 4096, 4K, 1M or 1G"),
    (["--max-size", "lots"], "argument --max-size: invalid size 'lots': give bytes as 4096, 4K, 1M or 1G"),
    (["--min-size", "0"], "invalid size '0': the buffer is float32, so give a positive multiple of 4 bytes"),
    (["--min-size", "6"], "invalid size '6'"),
    (["--min-size", "1M", "--max-size", "4K"], "--min-size (1048576 B) is larger than --max-size (4096 B)"),
    (["--iters", "0"], "argument --iters: must be a positive integer, got '0'"),
    (["--warmup", "-1"], "argument --warmup: must be a non-negative integer, got '-1'"),
    (["--deterministic", "--wire-dtype", "bf16"], "argument --wire-dtype: not allowed with argument --deterministic"),
    (["--wire-dtype", "fp8"], "invalid choice: 'fp8' (choose from 'bf16', 'fp16')"),
    (["--backend", "mpi"], "invalid choice: 'mpi' (choose from 'tcp', 'shm')"),
    (["--json", "/nonexistent-dir/rows.json"], "argument --json: directory '/nonexistent-dir' does not exist"),
])
def test_bench_refuses_bad_values_before_starting_ranks(args, needle) -> None:
    _refused(gradcoll("bench", *args), "bench", needle)


def test_bench_plot_without_matplotlib_is_refused_before_starting(tmp_path) -> None:
    png = tmp_path / "busbw.png"
    hide = ("import sys; sys.modules['matplotlib'] = None; from gradcoll.cli import main; "
            f"sys.exit(main(['bench', '--min-size', '4K', '--max-size', '4K', '--plot', {str(png)!r}]))")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=50)
    _refused(r, "bench", "--plot needs matplotlib", "pip install 'gradcoll[plot]'")
    assert not png.exists()


@pytest.mark.parametrize("args, needle", [
    (["-n", "0"], "must be a positive integer, got '0'"),
    (["-n", "3"], "-n/--nprocs 3 must divide the global batch of 512"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
])
def test_demo_refuses_bad_values_before_starting_ranks(args, needle) -> None:
    _refused(gradcoll("demo", *args), "demo", needle)


def test_stragglers_refuses_missing_traces_and_bad_top(tmp_path) -> None:
    missing = tmp_path / "trace.json"
    _refused(gradcoll("stragglers", str(missing)), "stragglers", f"no such file: '{missing}'")
    missing.write_text('{"traceEvents": []}')
    _refused(gradcoll("stragglers", "--top", "-1", str(missing)), "stragglers", "must be a non-negative integer")


def test_no_command_is_a_usage_error() -> None:
    r = gradcoll()
    assert r.returncode == 2 and r.stderr.startswith("usage: gradcoll") and "Traceback" not in r.stderr

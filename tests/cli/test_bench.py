"""``gradcoll bench``: a real sweep over 2 tcp ranks, its table, its JSON rows, its plot, and how sizes parse."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE, select_allreduce
from gradcoll.cli.bench import FIELDS, HEADER, _ran, load_rows, parse_size, sizes_between
from gradcoll.group.process_group import ProcessGroup
from gradcoll.transport.inproc import create_world

SIZES = [4096, 8192]

pytestmark = pytest.mark.timeout(120)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, Any]:
    """One real sweep: ``-n 2 --backend tcp`` 4K-8K, 2 iterations after 1 warm-up, with --json (and --plot)."""
    d = tmp_path_factory.mktemp("bench")
    js, png = d / "out.json", d / "out.png"
    cmd = [sys.executable, "-m", "gradcoll", "bench", "-n", "2", "--backend", "tcp", "--min-size", "4K",
           "--max-size", "8K", "--iters", "2", "--warmup", "1", "--json", str(js)]
    if _have_matplotlib():
        cmd += ["--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    return {"run": r, "json": js, "png": png}


def test_sweep_exits_0_with_every_result_right(sweep) -> None:
    r = sweep["run"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert all(row["wrong"] == 0 for row in json.loads(sweep["json"].read_text()))


def test_table_has_units_and_names_the_algorithm_auto_ran(sweep) -> None:
    lines = sweep["run"].stdout.splitlines()
    assert HEADER in lines
    for unit in ("size (B)", "time avg (us)", "time min (us)", "time max (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"):
        assert unit in HEADER
    body = [ln.split() for ln in lines[lines.index(HEADER) + 1:]]
    assert [int(c[0]) for c in body] == SIZES
    for cells in body:
        size, count, dtype, algo, transport, *_, wrong = cells
        assert (int(count), dtype, transport, wrong) == (int(size) // 4, "float32", "tcp", "0")
        assert algo in ALLREDUCE and algo != "auto"
        assert algo == select_allreduce(int(size), 2, "tcp")  # what auto picks for this size


def test_json_fields_say_what_they_measure(sweep) -> None:
    rows = json.loads(sweep["json"].read_text())
    assert [r["size"] for r in rows] == SIZES
    for r in rows:
        assert list(r) == [k for k, _ in FIELDS]
        assert not any(k.startswith("time_") for k in r)  # the old, misreadable names
        assert r["algorithm"] == select_allreduce(r["size"], 2, "tcp") and r["algorithm_requested"] == "auto"
        assert (r["mode"], r["transport"], r["ranks"], r["iters"], r["wrong"]) == ("plain", "tcp", 2, 2, 0)
        lo, avg, hi = r["iter_mean_us_min_over_ranks"], r["iter_mean_us_avg_over_ranks"], r["iter_mean_us_max_over_ranks"]
        assert 0 < lo <= avg <= hi
        assert r["iter_median_us_avg_over_ranks"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size"] / (hi * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 at 2 ranks


def test_plot_is_a_png(sweep) -> None:
    if not _have_matplotlib():
        pytest.skip("matplotlib is not installed: pip install 'gradcoll[plot]' (the test extra has it)")
    import matplotlib.image

    data = sweep["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(sweep["png"])
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.ptp(img[..., :3])) > 0  # something was drawn


@pytest.mark.parametrize("kw, expect", [
    ({"algorithm": "auto"}, None),
    ({"algorithm": "star"}, "star"),
    ({"algorithm": "ring", "deterministic": True}, "ring"),
    ({"algorithm": "recursive_doubling", "wire_dtype": "bf16"}, "recursive_doubling"),
])
@pytest.mark.timeout(60)
def test_the_algorithm_column_is_what_the_group_ran(kw: dict[str, Any], expect: str | None) -> None:
    n, nbytes = 2, 1 << 16
    ts = create_world(n, timeout=30.0)
    got: list[str] = [""] * n
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with ProcessGroup(ts[r]) as g:
                g.allreduce(np.ones(nbytes // 4, np.float32), **kw)
                got[r] = _ran(g)
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not errors, errors
    assert got == [expect or select_allreduce(nbytes, n, ts[0].name, ts[0].shared_memory)] * n


def test_parse_size_forms() -> None:
    assert [parse_size(s) for s in ("4096", "4K", "4k", "4KB", "4KiB", "1M", "64M", "1G", "1.5K", " 8K ")] == [
        4096, 4096, 4096, 4096, 4096, 1 << 20, 64 << 20, 1 << 30, 1536, 8192]
    for bad in ("", "K", "4X", "-4K", "four", "4 K B x", "0.3"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)
    assert sizes_between(4096, 16384) == [4096, 8192, 16384]
    with pytest.raises(ValueError):
        sizes_between(0, 16)


def test_load_rows_reads_files_written_under_the_old_names(tmp_path) -> None:
    # rows as gradcoll bench wrote them before the names changed (the requested algorithm under "algorithm")
    old = [{"size": 4096 << i, "count": 1024 << i, "dtype": "float32", "algorithm": "ring", "transport": "shm",
            "ranks": 2, "iters": 30, "time_avg_us": 30.5 + i, "time_min_us": 29.0 + i, "time_max_us": 31.0 + i,
            "time_med_us": 30.0 + i, "runs_time_med_us": [30.0 + i, 30.25 + i, 29.75 + i]} for i in range(3)]
    stored = tmp_path / "old.json"
    stored.write_text(json.dumps(old))
    new = load_rows(str(stored))
    for o, n in zip(old, new, strict=True):
        assert n["iter_mean_us_avg_over_ranks"] == o["time_avg_us"]
        assert n["iter_mean_us_min_over_ranks"] == o["time_min_us"]
        assert n["iter_mean_us_max_over_ranks"] == o["time_max_us"]
        assert n["iter_median_us_avg_over_ranks"] == o["time_med_us"]
        assert n["runs_iter_median_us_avg_over_ranks"] == o["runs_time_med_us"]
        assert n["algorithm_requested"] == o["algorithm"] == "ring"
        assert not any(k.startswith(("time_", "runs_time_")) for k in n)
    current = [{"size": 4, "iter_median_us_avg_over_ranks": 1.0, "algorithm": "ring", "algorithm_requested": "auto"}]
    (tmp_path / "new.json").write_text(json.dumps(current))
    assert load_rows(str(tmp_path / "new.json")) == current


def test_several_algorithms_take_turns_in_one_launch(tmp_path) -> None:
    js = tmp_path / "turns.json"
    r = subprocess.run([sys.executable, "-m", "gradcoll", "bench", "-n", "2", "--backend", "tcp", "--algorithm",
                        "ring,recursive_doubling", "--min-size", "4K", "--max-size", "8K", "--iters", "7",
                        "--warmup", "1", "--json", str(js)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "algorithm ring,recursive_doubling" in r.stdout
    rows = json.loads(js.read_text())
    # a row per size and algorithm, in the order given; each ran what it asked for, right, all its iterations
    assert [(x["size"], x["algorithm_requested"]) for x in rows] == [
        (s, a) for s in SIZES for a in ("ring", "recursive_doubling")]
    assert all(x["algorithm"] == x["algorithm_requested"] and x["wrong"] == 0 and x["iters"] == 7 for x in rows)

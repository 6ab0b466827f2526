"""The launcher: env variables, rank prefixes, failure propagation."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

from gradcoll.cli.launch import launch

pytestmark = pytest.mark.timeout(60)


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "s.py"
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_env_and_prefix(tmp_path):
    s = _script(
        tmp_path,
        """
        import os
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
              os.environ["MASTER_ADDR"], os.environ["GRADCOLL_BACKEND"])
        """,
    )
    out = io.StringIO()
    res = launch([sys.executable, s], 3, backend="shm", out=out, timeout=30)
    assert res.ok and res.returncodes == (0, 0, 0)
    lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[{r}] {r} 3 {r} 127.0.0.1 shm" for r in range(3)]


def test_one_failure_stops_the_others(tmp_path):
    s = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(60)  # the launcher must stop us long before this
        """,
    )
    out = io.StringIO()
    res = launch([sys.executable, s], 3, out=out, timeout=30, grace=2.0)
    assert res.failed_rank == 1
    assert res.returncodes[1] == 7
    assert all(rc is not None and rc != 0 for r, rc in enumerate(res.returncodes) if r != 1)


def test_cli_names_failing_rank(tmp_path):
    s = _script(tmp_path, "import os, sys; sys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    r = subprocess.run(
        [sys.executable, "-m", "gradcoll", "launch", "-n", "2", s], capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 1
    assert "rank 0 failed with exit code 3" in r.stderr


def test_children_exiting_between_polls():
    # Ranks that finish almost at once must not trip the wait loop (a race seen in CI:
    # every child exited between the poll and the pick of a child to wait on).
    for _ in range(20):
        res = launch([sys.executable, "-c", "pass"], 4, out=io.StringIO(), timeout=30)
        assert res.ok, res


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    import socket

    from gradcoll.cli.launch import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        if lo > 10000:
            assert not lo <= port <= hi  # never one that an outgoing connection or port-0 bind could take
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

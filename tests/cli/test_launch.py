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


def test_one_launcher_per_host_with_nnodes_and_node_rank(tmp_path):
    """Two launchers, each its own "host" (GRADCOLL_HOST), make one world of 2 x 2 ranks that knows its layout."""
    import threading

    from gradcoll.cli.launch import free_port

    s = _script(
        tmp_path,
        """
        import os
        import numpy as np
        import gradcoll
        g = gradcoll.init_process_group("tcp", timeout=30)
        x = np.full(8, float(g.rank), np.float32)
        g.allreduce(x, op="sum")
        print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"], os.environ["WORLD_SIZE"],
              ",".join(g.hosts), x[0])
        g.close()
        """,
    )
    port, outs, results = free_port(), [io.StringIO(), io.StringIO()], [None, None]

    def node(k: int) -> None:
        results[k] = launch([sys.executable, s], 2, nnodes=2, node_rank=k, master_port=port,
                            env={"GRADCOLL_HOST": f"host{k}"}, out=outs[k], timeout=50)

    threads = [threading.Thread(target=node, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(55)
    assert all(r is not None and r.ok for r in results), outs[0].getvalue() + outs[1].getvalue()
    lines = sorted(outs[0].getvalue().splitlines() + outs[1].getvalue().splitlines())
    assert lines == [f"[{r}] {r} {r % 2} {r // 2} 4 host0,host0,host1,host1 6.0" for r in range(4)]


def test_several_nodes_need_a_port_and_a_node_rank_in_range(tmp_path):
    with pytest.raises(ValueError, match="master_port"):
        launch([sys.executable, "-c", "pass"], 1, nnodes=2, out=io.StringIO())
    with pytest.raises(ValueError, match="node_rank must be in 0..1"):
        launch([sys.executable, "-c", "pass"], 1, nnodes=2, node_rank=2, master_port=1234, out=io.StringIO())
    s = _script(tmp_path, "pass\n")
    r = subprocess.run([sys.executable, "-m", "gradcoll", "launch", "-n", "1", "--nnodes", "2", s],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "--master-port" in r.stderr

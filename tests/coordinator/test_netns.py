"""The coordinator and its workers on three "hosts" (network namespaces), and a worker's cable pulled mid-step.

The coordinator listens on its namespace's address, the workers dial it from
theirs (``tests.helpers.Netns``; skipped where ``ip netns`` is not allowed).
Pulling a worker's cable out of the switch (no FIN, no RST) must make the
coordinator raise, within ``heartbeat_timeout_ms`` plus the interval, an
error naming that worker, and the other worker an abort naming it; with the
cable back a new cluster trains an exact step.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from gradcoll.cli.launch import free_port
from tests.helpers import Lines, Netns, netns_skip_reason

pytestmark = pytest.mark.timeout(300)

NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_netns_node.py")
HEARTBEAT_TIMEOUT, INTERVAL, SLACK = 3.0, 0.5, 4.0


def test_a_pulled_worker_cable_is_named_and_a_new_cluster_works() -> None:
    why = netns_skip_reason()
    if why:
        pytest.skip(why)
    with Netns(3) as net:
        port = free_port()
        procs = {}
        for i, role in enumerate(["coordinator", "worker", "worker"]):
            env = {"NETNS_ROLE": role, "NETNS_ADDR": net.addr(i), "NETNS_PORT": str(port), "NETNS_WORKERS": "2",
                   "NETNS_COORDINATOR": net.addr(0), "PYTHONUNBUFFERED": "1"}
            procs[i] = net.popen(i, [sys.executable, NODE], env)
        lines = Lines(procs)

        def events(name: str, count: int, timeout: float) -> dict[int, dict]:
            got = lines.take(lambda _, ln: ln.startswith("@@ ") and json.loads(ln[3:])["event"] == name, count,
                             timeout)
            return {k: json.loads(ln[3:]) for k, ln in got}

        def tell(command: str) -> None:
            for p in procs.values():
                p.stdin.write(command + "\n")
                p.stdin.flush()

        events("ready", 3, 120)
        tell("go")
        steps = lines.take(lambda _, ln: '"step"' in ln, 9, 120)  # three steps seen by all three nodes
        assert all(json.loads(ln[3:])["ok"] for _, ln in steps)
        t_pull = time.monotonic()
        net.pull(2)
        failed = events("failed", 3, HEARTBEAT_TIMEOUT + INTERVAL + SLACK + 60)
        for i, e in sorted(failed.items()):
            print(f"node {i} ({e['role']}): {e['t'] - t_pull:.2f}s after the pull: {e['type']}: {e['message']}")
        assert not [ln for _, ln in lines.log if '"ok": false' in ln], "a result was wrong"
        # worker ids follow the join order: find the cut worker's id in the coordinator's words
        text = failed[0]["message"]
        assert failed[0]["t"] - t_pull <= HEARTBEAT_TIMEOUT + INTERVAL + SLACK, failed[0]
        assert "no heartbeat" in text or "failed" in text, text
        cut = int(text.split("worker ", 1)[1].split(" ", 1)[0])
        assert f"worker {cut}" in failed[1]["message"], failed[1]  # the other worker is told who
        assert failed[1]["t"] - t_pull <= HEARTBEAT_TIMEOUT + INTERVAL + SLACK, failed[1]
        net.plug(2)
        tell("regroup")
        events("regrouped", 3, 120)
        ok = [json.loads(ln[3:]) for _, ln in lines.log if '"step"' in ln][-3:]
        assert all(e["ok"] and e["step"] == 0 for e in ok), ok
        for p in procs.values():
            assert p.wait(30) == 0

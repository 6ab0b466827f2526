"""Ranks on "hosts" that are network namespaces of this machine, and a cable pulled out of the switch.

Each host is a namespace with its own address on a veth cable to one bridge
(``tests.helpers.Netns``); ranks bind that address (the tcp ``host=``
option) and rendezvous at host 0's. The tests build the namespaces and
remove them, also after a failure; they skip where ``ip netns`` is not
allowed (not root, no iproute2, not Linux).

The failure is ``ip link set DEV down`` on the switch's end of one host's
cable, in the middle of the collectives: that host's packets are lost
without a FIN or an RST. Every rank must raise, within the link timeout
plus the heartbeat interval (and the error path's grace), an error naming
a rank it cannot reach; none may hang or return a wrong result. With the
cable back, the ranks shrink (or regroup) and the next allreduce is exact.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

from gradcoll.cli.launch import free_port
from tests.helpers import Lines, Netns, netns_skip_reason

pytestmark = pytest.mark.timeout(300)

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_netns_rank.py")
LINK_TIMEOUT, HEARTBEAT = 3.0, 1.0
#: The error path's grace (at most 5 s: records from the ranks still reachable) and scheduling on a loaded machine.
SLACK = 6.0


@pytest.fixture(scope="module")
def netns_ok() -> None:
    why = netns_skip_reason()
    if why:
        pytest.skip(why)


def start(net: Netns, per_host: int, timeout: float = 30.0, algorithm: str = "auto") -> tuple[dict[int, Any], Lines]:
    size = net.hosts * per_host
    port = free_port()
    procs = {}
    for r in range(size):
        h = r // per_host
        env = {"RANK": str(r), "WORLD_SIZE": str(size), "MASTER_ADDR": net.addr(0), "MASTER_PORT": str(port),
               "GRADCOLL_HOST": net.ns(h), "NETNS_ADDR": net.addr(h), "NETNS_TIMEOUT": str(timeout),
               "NETNS_LINK_TIMEOUT": str(LINK_TIMEOUT), "NETNS_HEARTBEAT": str(HEARTBEAT), "PYTHONUNBUFFERED": "1",
               "NETNS_ALGORITHM": algorithm}
        procs[r] = net.popen(h, [sys.executable, RANK], env)
    return procs, Lines(procs)


def events(lines: Lines, name: str, count: int, timeout: float) -> dict[int, dict[str, Any]]:
    got = lines.take(lambda _, line: line.startswith("@@ ") and json.loads(line[3:])["event"] == name, count, timeout)
    return {k: json.loads(line[3:]) for k, line in got}


def tell(procs: dict[int, Any], command: str) -> None:
    for p in procs.values():
        p.stdin.write(command + "\n")
        p.stdin.flush()


@pytest.mark.usefixtures("netns_ok")
@pytest.mark.parametrize("algorithm", ["auto", "two_level"])  # two_level: each namespace's ranks share a window
def test_allreduce_across_namespaces_is_exact(algorithm: str) -> None:
    with Netns(2) as net:
        procs, lines = start(net, 2, algorithm=algorithm)
        ready = events(lines, "ready", 4, 120)
        assert all(e["hosts"] == [net.ns(0)] * 2 + [net.ns(1)] * 2 for e in ready.values())
        assert all(e["ok"] for e in events(lines, "exact", 4, 60).values())
        tell(procs, "quit")
        for p in procs.values():
            assert p.wait(30) == 0


@pytest.mark.usefixtures("netns_ok")
@pytest.mark.parametrize(("recover", "algorithm"), [("shrink", "auto"), ("regroup", "auto"), ("shrink", "two_level")])
def test_a_pulled_cable_is_found_on_every_rank_then_the_ranks_regroup(recover: str, algorithm: str) -> None:
    with Netns(3) as net:
        procs, lines = start(net, 2, algorithm=algorithm)
        events(lines, "exact", 6, 120)
        tell(procs, "go")
        events(lines, "looping", 6, 60)
        t_pull = time.monotonic()
        net.pull(2)  # ranks 4 and 5 lose the others
        failed = events(lines, "failed", 6, LINK_TIMEOUT + HEARTBEAT + SLACK + 30)
        assert not [line for _, line in lines.log if '"wrong"' in line], "a result was wrong"
        cut = {4, 5}
        for r, e in sorted(failed.items()):
            took = e["t"] - t_pull
            print(f"rank {r}: {took:.2f}s after the pull: {e['type']}: {e['message']}")
            assert took <= LINK_TIMEOUT + HEARTBEAT + SLACK, f"rank {r} took {took:.1f}s: {e}"
            unreachable = cut if r not in cut else set(range(6)) - cut
            assert set(e["named"]) & unreachable and not set(e["named"]) - unreachable - {r}, (r, e)
        net.plug(2)
        tell(procs, recover)
        shrunk = events(lines, "shrunk", 6, 120)
        assert all(e["size"] == 6 and e["ok"] for e in shrunk.values()), shrunk
        for p in procs.values():
            assert p.wait(30) == 0

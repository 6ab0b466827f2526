"""One rank of the network-namespace tests (test_netns.py); it runs inside its host's namespace.

Rendezvous through ``env://`` (``MASTER_ADDR`` is host 0's address), the tcp
transport bound to this namespace's address (``NETNS_ADDR``). It reports on
stdout, one ``@@ {json}`` line per event, and takes commands on stdin:

1. ``ready`` once the group is built, then ``exact`` after one allreduce
   checked against the exact sum;
2. on ``go``: allreduces in a loop, each checked (``wrong`` if a result is
   ever wrong), ``looping`` after the first, ``failed`` with the error,
   the ranks it names and ``time.monotonic()`` when one raises;
3. on ``shrink``: ``shrunk`` with the new group's size after one exact
   allreduce on it; on ``regroup``: the same through a fresh
   ``init_process_group`` (``MASTER_PORT`` + 1).

Every allreduce runs ``NETNS_ALGORITHM`` (default ``auto``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gradcoll  # noqa: E402
from gradcoll.errors import GradcollError  # noqa: E402


def report(event: str, **fields: object) -> None:
    print("@@ " + json.dumps({"event": event, "rank": int(os.environ["RANK"]), **fields}), flush=True)


def contribution(rank: int, i: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float64) % 1000 * (rank + 1) + i  # small integers: exact in any order


def check(g: gradcoll.ProcessGroup, n: int, i: int, ranks: list[int]) -> bool:
    x = contribution(ranks[g.rank], i, n)
    g.allreduce(x, op="sum", algorithm=os.environ.get("NETNS_ALGORITHM", "auto"))
    want = np.arange(n, dtype=np.float64) % 1000 * sum(r + 1 for r in ranks) + i * len(ranks)
    return bool(np.array_equal(x, want))


def named(exc: BaseException) -> list[int]:
    """The ranks an error names: its peer, its missing ranks, and every ``peer N``/``rank(s) N`` in its words."""
    out = set(getattr(exc, "missing", None) or [])
    if isinstance(getattr(exc, "peer", None), int):
        out.add(exc.peer)  # type: ignore[attr-defined]
    out.update(int(m) for m in re.findall(r"peer (\d+)", str(exc)))
    return sorted(out)


def main() -> None:
    n = int(os.environ.get("NETNS_COUNT", "200000"))
    opts = {"host": os.environ["NETNS_ADDR"], "link_timeout": float(os.environ["NETNS_LINK_TIMEOUT"]),
            "heartbeat_s": float(os.environ["NETNS_HEARTBEAT"])}
    timeout = float(os.environ["NETNS_TIMEOUT"])
    g = gradcoll.init_process_group("tcp", "env://", timeout=timeout, stall_warning_s=None, **opts)
    world = list(range(g.size))
    report("ready", hosts=list(g.hosts or ()))
    report("exact", ok=check(g, n, 0, world))
    for command in sys.stdin:
        command = command.strip()
        if command == "go":
            i = 1
            while True:
                try:
                    if not check(g, n, i, world):
                        report("wrong", i=i)
                except GradcollError as exc:
                    report("failed", t=time.monotonic(), type=type(exc).__name__, message=str(exc), named=named(exc))
                    break
                if i == 1:
                    report("looping")
                i += 1
        elif command in ("shrink", "regroup"):
            if command == "shrink":
                new = g.shrink(timeout=30)
            else:
                g.close()
                os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
                new = gradcoll.init_process_group("tcp", "env://", timeout=timeout, stall_warning_s=None, **opts)
            report("shrunk", size=new.size, ok=check(new, n, 7, list(range(new.size))))
            new.close()
            return
        elif command == "quit":
            break
    g.close()


if __name__ == "__main__":
    main()

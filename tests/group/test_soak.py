"""Soak: thousands of checked allreduces at 4 ranks, with flat memory (private RSS) and file descriptors.

Each rank runs one warm-up pass over every size x algorithm (workspaces and
caches reach their steady size), then measures RSS and its open file
descriptors, runs ``GRADCOLL_SOAK_ITERS`` allreduces (500 in ``make test``,
10,000 in ``make faults``) of mixed sizes, mostly small, every result checked
exactly, and measures again. Real processes on 127.0.0.1.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import tempfile
import time

import pytest

from tests.faults._harness import context, log_fault
from tests.faults._ranks import SOAK_SIZES, soak_main

ITERS = int(os.environ.get("GRADCOLL_SOAK_ITERS", "500"))
RSS_SLACK = 4 << 20  # allocator noise; a leak of even 1 KiB per call shows at 10,000 calls
TRANSPORTS = ("tcp", "shm")

pytestmark = pytest.mark.timeout(max(120, ITERS // 10))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_soak_memory_and_fds_stay_flat(transport):
    ctx, size = context(), 4
    with tempfile.TemporaryDirectory(prefix="gradcoll-soak-") as tmp:
        cfg = {"transport": transport, "size": size, "iters": ITERS, "warm": 4 * len(SOAK_SIZES),
               "store": os.path.join(tmp, "store")}
        pipes = [ctx.Pipe() for _ in range(size)]
        procs = [ctx.Process(target=soak_main, args=(cfg, r, pipes[r][1]), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        reports, deadline = [], time.monotonic() + max(110, ITERS // 10 - 10)
        conns = [a for a, _ in pipes]
        while len(reports) < size and conns and time.monotonic() < deadline:
            for c in multiprocessing.connection.wait(conns, deadline - time.monotonic()):
                try:
                    reports.append(c.recv())  # type: ignore[union-attr]
                except EOFError:
                    pass
                conns.remove(c)  # type: ignore[arg-type]
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert len(reports) == size, f"only {len(reports)} of {size} ranks reported"
    growth = max(r["rss1"] - r["rss0"] for r in reports)
    log_fault(area="soak", transport=transport, fault=f"{ITERS} allreduces", timeout=None, detection=[],
              errors=[], verified=sum(r["calls"] - r["wrong"] for r in reports), wrong=sum(r["wrong"] for r in reports),
              hung=[], leaked_segments=[], problems=[], rss_growth=growth,
              fd_growth=max(r["fds1"] - r["fds0"] for r in reports),
              seconds=max(r["seconds"] for r in reports), wall=max(r["seconds"] for r in reports))
    for r in reports:
        assert r["wrong"] == 0, r
        assert r["fds1"] == r["fds0"], f"rank {r['rank']}: fds {r['fds0']} -> {r['fds1']}"
        assert r["rss1"] - r["rss0"] <= RSS_SLACK, f"rank {r['rank']}: RSS grew by {(r['rss1'] - r['rss0']) >> 10} KiB"

"""Cost of the deterministic and low-precision-wire allreduces against the plain one.

Runs ``n`` ranks as threads over the inproc transport (no process start-up
in the figures) and prints, per size, the median time of the plain float32
allreduce, ``deterministic=True`` and ``wire_dtype="bf16"``, and their ratios.
Usage: ``python benches/bench_precision.py [--ranks 4] [--algorithm ring]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

from gradcoll.group import ProcessGroup
from gradcoll.transport.inproc import create_world


def timed(n: int, count: int, algorithm: str, iters: int, **kw: Any) -> float:
    """Median seconds of one allreduce of ``count`` float32 over ``n`` inproc ranks."""
    ts = create_world(n, timeout=120.0)
    times: list[list[float]] = [[] for _ in range(n)]
    barrier = threading.Barrier(n)

    def rank(r: int) -> None:
        g = ProcessGroup(ts[r])
        buf = np.random.default_rng(r).standard_normal(count).astype(np.float32)
        g.allreduce(buf, algorithm=algorithm, **kw)
        for _ in range(iters):
            barrier.wait()
            t0 = time.perf_counter()
            g.allreduce(buf, algorithm=algorithm, **kw)
            times[r].append(time.perf_counter() - t0)
        g.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(max(ts_) for ts_ in zip(*times, strict=True))


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--iters", type=int, default=7)
    a = ap.parse_args()
    print(f"# {a.ranks} inproc ranks, {a.algorithm}; median of {a.iters}")
    print(f"{'size':>8} {'plain ms':>9} {'determ ms':>10} {'ratio':>6} {'bf16 ms':>8} {'ratio':>6}")
    for mib in (1, 4, 16, 64):
        count = (mib << 20) // 4
        plain = timed(a.ranks, count, a.algorithm, a.iters)
        det = timed(a.ranks, count, a.algorithm, a.iters, deterministic=True)
        wire = timed(a.ranks, count, a.algorithm, a.iters, wire_dtype="bf16")
        print(f"{mib:>6}Mi {plain * 1e3:>9.2f} {det * 1e3:>10.2f} {det / plain:>6.2f} {wire * 1e3:>8.2f} "
              f"{wire / plain:>6.2f}", flush=True)


if __name__ == "__main__":
    main()

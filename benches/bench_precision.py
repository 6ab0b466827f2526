"""Cost of the deterministic and low-precision-wire allreduces against the plain one.

Prints, per size, the median time of the plain float32 allreduce,
``deterministic=True`` and ``wire_dtype="bf16"``, and their ratios, all
measured in the same run. ``--backend inproc`` (the default) runs ``n`` ranks
as threads of this process; ``--backend tcp`` or ``shm`` runs real processes
through ``gradcoll bench`` (median of the per-iteration times).
Usage: ``python benches/bench_precision.py [--ranks 4] [--algorithm ring] [--backend shm]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from gradcoll.cli.bench import load_rows
from gradcoll.group.process_group import ProcessGroup
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


def timed_procs(n: int, backend: str, algorithm: str, iters: int, mode: list[str]) -> dict[int, float]:
    """Median seconds per size from one ``gradcoll bench`` sweep over 1-64 MiB on real processes."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        subprocess.run([sys.executable, "-m", "gradcoll", "bench", "-n", str(n), "--backend", backend, "--algorithm",
                        algorithm, "--min-size", "1M", "--max-size", "64M", "--iters", str(iters), "--json", path, *mode],
                       check=True, stdout=subprocess.DEVNULL)
        rows = load_rows(path)
    return {r["size"] >> 20: r["iter_median_us_avg_over_ranks"] * 1e-6 for r in rows if r["wrong"] == 0}


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--backend", default="inproc", choices=["inproc", "tcp", "shm"])
    a = ap.parse_args()
    print(f"# {a.ranks} {a.backend} ranks, {a.algorithm}; median of {a.iters}")
    print(f"{'size':>8} {'plain ms':>9} {'determ ms':>10} {'ratio':>6} {'bf16 ms':>8} {'ratio':>6}")
    if a.backend != "inproc":
        runs = [timed_procs(a.ranks, a.backend, a.algorithm, a.iters, m) for m in ([], ["--deterministic"],
                                                                                    ["--wire-dtype", "bf16"])]
        for mib in (1, 4, 16, 64):
            plain, det, wire = (r[mib] for r in runs)
            print(f"{mib:>6}Mi {plain * 1e3:>9.2f} {det * 1e3:>10.2f} {det / plain:>6.2f} {wire * 1e3:>8.2f} "
                  f"{wire / plain:>6.2f}", flush=True)
        return
    for mib in (1, 4, 16, 64):
        count = (mib << 20) // 4
        plain = timed(a.ranks, count, a.algorithm, a.iters)
        det = timed(a.ranks, count, a.algorithm, a.iters, deterministic=True)
        wire = timed(a.ranks, count, a.algorithm, a.iters, wire_dtype="bf16")
        print(f"{mib:>6}Mi {plain * 1e3:>9.2f} {det * 1e3:>10.2f} {det / plain:>6.2f} {wire * 1e3:>8.2f} "
              f"{wire / plain:>6.2f}", flush=True)


if __name__ == "__main__":
    main()

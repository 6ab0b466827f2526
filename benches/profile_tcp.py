"""Where an allreduce over the tcp transport spends its time: cProfile of rank 0, and the syscalls of each rank.

Runs ``-n`` local ranks (``gradcoll launch``); each times ``--iters`` allreduces of ``--size`` bytes
(float32, mean) and rank 0 prints its mean time per call, then (``--profile``) the top functions of a
cProfile run of the same loop, by own time. ``--strace`` prints the system calls rank 0 made per
allreduce (``strace -c -f``, Linux; needs strace). Used to decide what to compile in the tcp data path
(docs/performance.md, "Where the tcp time goes").

    python benches/profile_tcp.py -n 2 --size 4K --iters 5000 --profile
    python benches/profile_tcp.py -n 2 --size 4M --iters 200 --profile --algorithm ring
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)


def worker(size: int, iters: int, algorithm: str, profile: bool, top: int) -> None:
    import gradcoll

    g = gradcoll.init_process_group("tcp", "env://", timeout=120)
    buf = np.ones(size // 4, np.float32)
    for _ in range(max(10, iters // 10)):
        g.allreduce(buf, algorithm=algorithm)
    g.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.allreduce(buf, algorithm=algorithm)
    dt = (time.perf_counter() - t0) / iters
    g.barrier()
    if g.rank == 0:
        print(f"@@ {g.size} ranks {size} B {algorithm}: {dt * 1e6:.1f} us per allreduce "
              f"({g.stats().ops['allreduce'].avg_wait_s * 1e6:.1f} us of it blocked in the transport)", flush=True)
    if profile:
        prof = cProfile.Profile()
        g.barrier()
        prof.enable()
        for _ in range(iters):
            g.allreduce(buf, algorithm=algorithm)
        prof.disable()
        g.barrier()
        if g.rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            print("@@ " + "\n@@ ".join(out.getvalue().splitlines()), flush=True)
    g.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--size", default="4K", help="bytes per rank, e.g. 4K, 4M (default 4K)")
    ap.add_argument("--iters", type=int, default=2000, help="allreduces timed (default 2000)")
    ap.add_argument("--algorithm", default="auto", help="allreduce algorithm (default auto)")
    ap.add_argument("--profile", action="store_true", help="print rank 0's cProfile top functions")
    ap.add_argument("--top", type=int, default=25, help="functions listed by --profile (default 25)")
    ap.add_argument("--strace", action="store_true", help="count rank 0's system calls (strace -c)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size

    size = parse_size(a.size)
    if a.worker:
        worker(size, a.iters, a.algorithm, a.profile, a.top)
        return 0
    from gradcoll.cli.launch import launch

    cmd = [sys.executable, HERE, "--worker", "--size", str(size), "--iters", str(a.iters), "--algorithm", a.algorithm,
           "--top", str(a.top)] + (["--profile"] if a.profile else [])
    if a.strace:
        cmd = ["strace", "-c", "-f", "-o", f"/tmp/profile_tcp.strace.{os.getpid()}"] + cmd

    class Sink(io.StringIO):
        pass

    sink = Sink()
    res = launch(cmd, a.nprocs, backend="tcp", prefix=False, out=sink, timeout=1800)
    for line in sink.getvalue().splitlines():
        if line.startswith("@@"):
            print(line[3:])
    if not res.ok:
        print(sink.getvalue()[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where an allreduce over the tcp transport spends its time: cProfile of rank 0, and the syscalls of each rank.

Runs ``-n`` local ranks (``gradcoll launch``); each times ``--iters`` allreduces of ``--size`` bytes
(float32, mean) and rank 0 prints its mean time per call, then (``--profile``) the top functions of a
cProfile run of the same loop, by own time. ``--strace`` prints the system calls rank 0 made per
allreduce (``strace -c -f``, Linux; needs strace). ``--layers`` times, in the same run, the group's allreduce,
the recursive-doubling function called directly and a bare ``transport.sendrecv`` of the same bytes (best
of 3 loops of ``--iters`` calls). Used to decide what to compile in the tcp data path (docs/performance.md,
"Where the time goes" of the tcp section).

    python benches/profile_tcp.py -n 2 --size 4K --iters 3000 --layers

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
from typing import Any

import numpy as np

HERE = os.path.abspath(__file__)


def layers(g: Any, buf: np.ndarray, iters: int) -> dict[str, float]:
    """Best of 3 loops, us per call: the group's allreduce, recursive doubling alone, one sendrecv of ``buf``."""
    from gradcoll.algorithms import ALLREDUCE

    t, rd, out, peer = g.transport, ALLREDUCE["recursive_doubling"], np.empty_like(buf), g.rank ^ 1
    res: dict[str, list[float]] = {}
    for _ in range(3):
        for name, call in (("group allreduce", lambda i: g.allreduce(buf)),
                           ("group allreduce, recursive_doubling",
                            lambda i: g.allreduce(buf, algorithm="recursive_doubling")),
                           ("recursive doubling alone", lambda i: rd(t, buf, op="mean", seq=(1 << 40) + i, timeout=30.0)),
                           ("transport.sendrecv", lambda i: t.sendrecv(peer, buf, peer, out, timeout=30.0))):
            g.barrier()
            t0 = time.perf_counter()
            for i in range(iters):
                call(i)
            res.setdefault(name, []).append((time.perf_counter() - t0) / iters * 1e6)
    g.barrier()
    return {k: min(v) for k, v in res.items()}


def worker(size: int, iters: int, algorithm: str, profile: bool, top: int, by_layer: bool = False) -> None:
    import gradcoll

    g = gradcoll.init_process_group("tcp", "env://", timeout=120)
    buf = np.ones(size // 4, np.float32)
    if by_layer:
        got = layers(g, buf, iters)
        if g.rank == 0:
            for k, v in got.items():
                print(f"@@ {g.size} ranks {size} B, {k}: {v:.1f} us", flush=True)
        g.close()
        return
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
    ap.add_argument("--layers", action="store_true", help="time each layer of a small allreduce (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size

    size = parse_size(a.size)
    if a.worker:
        worker(size, a.iters, a.algorithm, a.profile, a.top, a.layers)
        return 0
    from gradcoll.cli.launch import launch

    cmd = [sys.executable, HERE, "--worker", "--size", str(size), "--iters", str(a.iters), "--algorithm", a.algorithm,
           "--top", str(a.top)] + (["--profile"] if a.profile else []) + (["--layers"] if a.layers else [])
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

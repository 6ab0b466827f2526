"""Benchmark of the coordinator: collect_and_reduce + broadcast_averaged against a bare star allreduce.

Run ``python benches/bench_coordinator.py`` (2 and 4 workers; 1 MB, 22 MB,
a LoRA-sized gradient, and 100 MB) or e.g. ``--workers 2 --mb 22`` for a quick
look. Every worker is its own process (spawn), started and joined before the
clock starts, and loops ``send_gradients`` / ``receive_averaged``; the time
is the coordinator's, from the start of ``collect_and_reduce`` to the end of
``broadcast_averaged``, median over the timed steps.

The baseline, measured in the same run, is gradcoll's
:func:`~gradcoll.algorithms.star_allreduce` over the TCP transport on
``workers + 1`` ranks: rank 0 (this process) plays the coordinator, so the
same bytes cross the same number of sockets (n gradients in, n results out),
and its time is rank 0's time per call. The star also reduces rank 0's own
row (n + 1 rows instead of n). ``overhead`` is coordinator / star - 1; the
target is under 10% at 22 MB.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from gradcoll import kernels
from gradcoll.algorithms import star_allreduce
from gradcoll.coordinator import DistributedConfig, GradientServer, WorkerClient
from gradcoll.store import FileStore
from gradcoll.transport import tcp

__all__ = ["bench_coordinator", "bench_star", "main"]

TIMEOUT_S = 300.0
WARMUP = 1


def _elements(mb: float) -> int:
    return int(mb * 1e6) // 4


def _gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _coordinator_worker(addr: tuple[str, int], n: int, steps: int, max_frame: int) -> None:
    cfg = DistributedConfig.worker(addr, timeout_s=TIMEOUT_S, max_frame_bytes=max_frame)
    with WorkerClient.connect(cfg, 1, "cpu") as c:
        g = _gradient(n, c.worker_id())
        for step in range(steps):
            c.send_gradients(step, g, 1.0, 0, 1)
            c.receive_averaged()
        c.receive_shard()  # Shutdown


def bench_coordinator(workers: int, n: int, steps: int) -> list[float]:
    """Seconds per collect_and_reduce + broadcast_averaged of ``n`` float32 on ``workers`` worker processes."""
    max_frame = max(4 * n + 4096, 100_000_000)  # 100 MB of gradients do not fit entrenar's default cap
    cfg = DistributedConfig.coordinator("127.0.0.1:0", workers, timeout_s=TIMEOUT_S, max_frame_bytes=max_frame)
    ctx = multiprocessing.get_context("spawn")
    times = []
    with GradientServer.bind(cfg) as srv:
        procs = [ctx.Process(target=_coordinator_worker, args=(srv.local_addr(), n, steps, max_frame), daemon=True)
                 for _ in range(workers)]
        for p in procs:
            p.start()
        srv.wait_for_workers()
        for step in range(steps):
            t0 = time.perf_counter()
            res = srv.collect_and_reduce(step)
            srv.broadcast_averaged(step, res)
            times.append(time.perf_counter() - t0)
        srv.shutdown_workers()
    for p in procs:
        p.join(TIMEOUT_S)
    return times[WARMUP:]


def _star_rank(path: str, rank: int, size: int, n: int, steps: int) -> None:
    store = FileStore(path, timeout=TIMEOUT_S)
    t = tcp.create(store, rank, size, timeout=TIMEOUT_S)
    buf = _gradient(n, rank)
    for seq in range(steps):
        star_allreduce(t, buf, seq=seq)
    t.close()
    store.close()


def bench_star(workers: int, n: int, steps: int) -> list[float]:
    """Seconds per star_allreduce of ``n`` float32 on ``workers + 1`` ranks (rank 0 here, the others spawned)."""
    size = workers + 1
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gradcoll-bench-") as tmp:
        path = os.path.join(tmp, "store")
        store = FileStore(path, timeout=TIMEOUT_S)
        procs = [ctx.Process(target=_star_rank, args=(path, r, size, n, steps), daemon=True) for r in range(1, size)]
        for p in procs:
            p.start()
        t = tcp.create(store, 0, size, timeout=TIMEOUT_S)
        buf, times = _gradient(n, 0), []
        for seq in range(steps):
            t0 = time.perf_counter()
            star_allreduce(t, buf, seq=seq)
            times.append(time.perf_counter() - t0)
        for p in procs:
            p.join(TIMEOUT_S)
        t.close()
        store.close()
    return times[WARMUP:]


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks and print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mb", type=float, nargs="+", default=[1.0, 22.0, 100.0], help="gradient size in MB (1e6 bytes)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per figure (default: more for small sizes)")
    args = p.parse_args(argv)
    kernels.warmup()  # JIT compilation must not land in the first timed step
    print(f"{'workers':>7} {'MB':>6} {'coordinator ms':>15} {'star ms':>8} {'overhead':>9} {'coord GB/s':>11}")
    for workers in args.workers:
        for mb in args.mb:
            n = _elements(mb)
            steps = args.steps or (20 if mb <= 4 else 8 if mb <= 32 else 4)
            coord = statistics.median(bench_coordinator(workers, n, steps + WARMUP))
            star = statistics.median(bench_star(workers, n, steps + WARMUP))
            moved = 2 * workers * 4 * n  # n gradients in, n results out
            print(f"{workers:>7} {mb:>6g} {coord * 1e3:>15.1f} {star * 1e3:>8.1f} {coord / star - 1:>+9.1%} "
                  f"{moved / coord / 1e9:>11.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

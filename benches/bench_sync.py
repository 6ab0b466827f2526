"""Benchmarks of gradcoll.sync: Arrow encode/decode throughput and end-to-end sync time.

Run ``python benches/bench_sync.py`` (1M and 10M elements, 2 and 4 peers,
in process and over gRPC) or with ``--elements 1000000 --peers 2`` for a
quick look. End to end means: every peer submits its gradient, waits for the
others, receives all gradients chunk by chunk, checks them, reassembles and
averages them; the time is the slowest peer's. Over gRPC each peer is its
own process, started and connected before the clock starts; the server runs
in the benchmark process with a FileBlockStore in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time

import numpy as np

from gradcoll.sync import (
    FileBlockStore,
    GradientSyncClient,
    GradientSyncRequest,
    GradientSyncService,
    ServerThread,
    aggregate_gradients,
    load_gradient_from_arrow,
    store_gradient_as_arrow,
)

__all__ = ["bench_codec", "bench_inproc", "bench_grpc", "main"]


def _gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_codec(n: int, repeat: int = 3) -> dict[str, float]:
    """Seconds (best of ``repeat``) to encode and decode ``n`` elements."""
    g = _gradient(n, 0)
    data = store_gradient_as_arrow(g)
    return {
        "encode_s": _best(lambda: store_gradient_as_arrow(g), repeat),
        "decode_s": _best(lambda: load_gradient_from_arrow(data), repeat),
        "bytes": len(data),
    }


def bench_inproc(n: int, peers: int) -> float:
    """Seconds for ``peers`` asyncio tasks to sync ``n`` elements through one in-process service."""
    payloads = [store_gradient_as_arrow(_gradient(n, i)) for i in range(peers)]
    with tempfile.TemporaryDirectory() as root:
        service = GradientSyncService(FileBlockStore(root, durable=False))

        async def run() -> None:
            reqs = [GradientSyncRequest("bench", p, peers - 1, 120.0, peer_id=f"p{i}") for i, p in enumerate(payloads)]
            await asyncio.gather(*(service.collect(r) for r in reqs))

        t0 = time.perf_counter()
        asyncio.run(run())
        return time.perf_counter() - t0


def _warm_up(n: int) -> None:
    # Load the kernel backends (Numba's cache, Cython) and pyarrow before any
    # clock starts: a first call pays for loading them.
    g = _gradient(n, 0)
    aggregate_gradients({"a": g, "b": g})
    load_gradient_from_arrow(store_gradient_as_arrow(g[:10]))


def _grpc_peer(address: str, n: int, index: int, peers: int, barrier, conn) -> None:
    payload = store_gradient_as_arrow(_gradient(n, index))
    _warm_up(n)

    async def run() -> float:
        async with GradientSyncClient(address, connect_timeout=30) as client:
            await client.wait_ready()
            barrier.wait(60)  # every peer connected: start the clock together
            t0 = time.perf_counter()
            await client.collect(GradientSyncRequest("bench", payload, peers - 1, 300.0, peer_id=f"p{index}"))
            return time.perf_counter() - t0

    try:
        conn.send(asyncio.run(run()))
    except BaseException as exc:
        conn.send(repr(exc))
    finally:
        conn.close()


def bench_grpc(n: int, peers: int) -> float:
    """Seconds for the slowest of ``peers`` processes to sync ``n`` elements over gRPC."""
    ctx = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory() as root,
        ServerThread(GradientSyncService(FileBlockStore(root, durable=False))) as srv,
    ):
        barrier = ctx.Barrier(peers)
        conns, procs = [], []
        for i in range(peers):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_grpc_peer, args=(srv.address, n, i, peers, barrier, child), daemon=True)
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        try:
            results = []
            for conn in conns:
                if not conn.poll(600):
                    raise TimeoutError("a benchmark peer did not report within 600 s")
                results.append(conn.recv())
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"benchmark peer failed: {errors[0]}")
    return max(results)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks and print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--transport", choices=["inproc", "grpc", "both"], default="both")
    p.add_argument("--repeat", type=int, default=3, help="runs per end-to-end figure (median reported)")
    args = p.parse_args(argv)

    print(f"{'elements':>10} {'Arrow MB':>9} {'encode ms':>10} {'enc GB/s':>9} {'decode ms':>10} {'dec GB/s':>9}")
    for n in args.elements:
        c = bench_codec(n)
        gb = c["bytes"] / 1e9
        print(
            f"{n:>10} {c['bytes'] / 1e6:>9.1f} {c['encode_s'] * 1e3:>10.1f} {gb / c['encode_s']:>9.2f}"
            f" {c['decode_s'] * 1e3:>10.1f} {gb / c['decode_s']:>9.2f}"
        )
    print()
    _warm_up(max(args.elements))
    bench_inproc(1000, 2)
    transports = ["inproc", "grpc"] if args.transport == "both" else [args.transport]
    print(f"{'transport':>9} {'elements':>10} {'peers':>5} {'sync s (median)':>16} {'GB/s out':>9}")
    for transport in transports:
        fn = bench_inproc if transport == "inproc" else bench_grpc
        for n in args.elements:
            for peers in args.peers:
                t = statistics.median(fn(n, peers) for _ in range(args.repeat))
                # Bytes streamed back: every peer receives every peer's gradient (its own too).
                out = peers * peers * n * 8 / 1e9
                print(f"{transport:>9} {n:>10} {peers:>5} {t:>16.3f} {out / t:>9.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""gradcoll's allreduce side by side with torch.distributed (gloo) and Open MPI (mpi4py).

Same ranks, same sizes, float32, op=mean, same timing method for everyone:
barrier, ``iters`` allreduces, barrier; the time per allreduce is rank 0's
wall time over the loop divided by ``iters`` (median of ``--repeats``).
gloo and MPI have no CPU mean, so their anchors run SUM and then divide in
place (what a trainer must do with them); gradcoll's mean is one call that
also checks every value for NaN/Inf.

    python benches/compare_anchors.py -n 2 --sizes 4K 64M
    python benches/compare_anchors.py -n 4 --only gradcoll-shm,mpi-shm

Needs: torch (``pip install torch==2.13.0``, the ``anchors`` extra) for gloo,
mpi4py and Open MPI's ``mpirun`` for the MPI anchors; missing anchors are
skipped with a message. busbw = algbw x 2(n-1)/n (nccl-tests' definition).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)
TAG = "@@anchor "
IMPLS = ["gradcoll-shm", "gradcoll-tcp", "gloo", "mpi-shm", "mpi-tcp"]


def _sizes(lo: str, hi: str) -> list[int]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size

    out, s = [], parse_size(lo)
    while s <= parse_size(hi):
        out.append(s)
        s *= 4
    return out


def _iters(nbytes: int) -> int:
    return int(max(5, min(300, (64 << 20) // max(nbytes, 1) // 4)))


# -- workers: one per implementation, run as every rank -------------------------
def _time_loop(step, barrier, nbytes: int, repeats: int) -> float:
    iters = _iters(nbytes)
    for _ in range(max(2, iters // 10)):
        step()
    samples = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        barrier()
        samples.append((time.perf_counter() - t0) / iters)
    return float(np.median(samples))


def worker(kind: str, sizes: list[int], repeats: int) -> None:
    """Time this implementation's allreduce over ``sizes``; rank 0 prints JSON rows."""
    if kind.startswith("gradcoll"):
        import gradcoll

        g = gradcoll.init_process_group(kind.split("-")[1], "env://", timeout=120)
        rank, world = g.rank, g.size

        def make(buf):
            return lambda: g.allreduce(buf, op="mean")

        barrier = g.barrier
    elif kind == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        rank, world = dist.get_rank(), dist.get_world_size()

        def make(buf):
            t = torch.from_numpy(buf)

            def step():
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
                t.div_(world)

            return step

        barrier = dist.barrier
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()

        def make(buf):
            def step():
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                np.multiply(buf, np.float32(1.0 / world), out=buf)

            return step

        barrier = comm.Barrier
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        t = _time_loop(make(buf), barrier, nbytes, repeats)
        if rank == 0:
            busbw = nbytes / t / 1e9 * (2 * (world - 1) / world)
            print(TAG + json.dumps({"impl": kind, "size": nbytes, "ranks": world, "time_us": t * 1e6,
                                    "busbw_GBps": busbw}), flush=True)
    if kind.startswith("gradcoll"):
        g.close()
    elif kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


# -- driver -------------------------------------------------------------------------
def _available(kind: str) -> str | None:
    if kind == "gloo":
        try:
            import torch.distributed as dist

            return None if dist.is_gloo_available() else "torch was built without gloo"
        except ImportError:
            return "torch not installed: pip install torch==2.13.0 (gradcoll[anchors])"
    if kind.startswith("mpi"):
        if shutil.which("mpirun") is None:
            return "Open MPI's mpirun not found: apt-get install openmpi-bin libopenmpi-dev"
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py not installed: pip install gradcoll[mpi]"
    return None


def run(kind: str, n: int, lo: str, hi: str, repeats: int) -> list[dict]:
    """Run one implementation over ``n`` local ranks; return rank 0's rows."""
    wargs = [sys.executable, HERE, "--worker", kind, "--sizes", lo, hi, "--repeats", str(repeats)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind.startswith("mpi"):
        # mpi-tcp: the TCP BTL alone, over loopback (like gradcoll's tcp transport on one host).
        btl = ["--mca", "btl", "self,vader"] if kind == "mpi-shm" else ["--mca", "btl", "self,tcp",
                                                                       "--mca", "btl_tcp_if_include", "lo"]
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(n), *btl, *wargs]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        out = p.stdout
        ok = p.returncode == 0
        err = p.stderr
    else:
        from gradcoll.cli.launch import launch

        class Sink:
            def __init__(self) -> None:
                self.text = ""

            def write(self, s: str) -> int:
                self.text += s
                return len(s)

            def flush(self) -> None:
                pass

        sink = Sink()
        backend = kind.split("-")[1] if kind.startswith("gradcoll") else "tcp"
        res = launch(wargs, n, backend=backend, prefix=False, out=sink, timeout=1800)
        out, ok, err = sink.text, res.ok, sink.text
    rows = [json.loads(line.split(TAG, 1)[1]) for line in out.splitlines() if TAG in line]
    if not ok:
        print(f"# {kind} failed:\n{err[-2000:]}", file=sys.stderr)
    return rows


def table(rows: list[dict], impls: list[str], n: int) -> str:
    """Time and busbw per size, with gradcoll/anchor ratios (>1 means gradcoll is faster)."""
    by = {(r["impl"], r["size"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    present = [i for i in impls if any((i, s) in by for s in sizes)]
    head = f"{'size':>9} " + " ".join(f"{i + ' us':>15}" for i in present)
    pairs = [("gradcoll-shm", "mpi-shm"), ("gradcoll-tcp", "mpi-tcp"), ("gradcoll-tcp", "gloo"), ("gradcoll-shm", "gloo")]
    pairs = [p for p in pairs if p[0] in present and p[1] in present]
    head += " " + " ".join(f"{a.split('-')[1] + '/' + b:>14}" for a, b in pairs)
    lines = [f"# allreduce, float32, mean, {n} ranks; time per call (busbw GB/s); ratio = anchor time / gradcoll time", head]
    for s in sizes:
        cells = []
        for i in present:
            r = by.get((i, s))
            cells.append(f"{r['time_us']:>8.1f} ({r['busbw_GBps']:>4.2f})" if r else f"{'-':>15}")
        ratios = []
        for a, b in pairs:
            ra, rb = by.get((a, s)), by.get((b, s))
            ratios.append(f"{rb['time_us'] / ra['time_us']:>14.2f}" if ra and rb else f"{'-':>14}")
        label = f"{s // 1024}K" if s < 1 << 20 else f"{s >> 20}M"
        lines.append(f"{label:>9} " + " ".join(cells) + " " + " ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Driver entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--sizes", nargs=2, default=["4K", "64M"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=",".join(IMPLS))
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, _sizes(*a.sizes), a.repeats)
        return 0
    rows: list[dict] = []
    impls = [i for i in a.only.split(",") if i]
    for kind in impls:
        why = _available(kind)
        if why:
            print(f"# skipping {kind}: {why}", file=sys.stderr)
            continue
        print(f"# running {kind} on {a.nprocs} ranks ...", file=sys.stderr, flush=True)
        rows += run(kind, a.nprocs, a.sizes[0], a.sizes[1], a.repeats)
    print(table(rows, impls, a.nprocs))
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""gradcoll's collectives side by side with torch.distributed (gloo) and Open MPI (mpi4py).

Same ranks, same sizes, float32, op=mean, same timing method for everyone:
barrier, ``iters`` calls, barrier; the time per call is rank 0's wall time
over the loop divided by ``iters`` (median of ``--repeats``). ``--rounds R``
runs every implementation R times, interleaved (a, b, a, b, ...), and keeps
each one's best round, so that a busy machine slows everyone alike.
gloo and MPI have no CPU mean, so their anchors run SUM and then divide in
place (what a trainer must do with them); gradcoll's mean is one call that
also checks every value for NaN/Inf.

    python benches/compare_anchors.py -n 2 --sizes 4K 64M
    python benches/compare_anchors.py -n 4 --only gradcoll-shm,mpi-shm --rounds 3
    python benches/compare_anchors.py -n 2 --only gradcoll-shm,gradcoll-shm-det,gradcoll-shm-bf16,memcpy
    python benches/compare_anchors.py -n 4 --op allgather --only gradcoll-shm,mpi-shm

Implementations: ``gradcoll-shm`` and ``gradcoll-tcp`` (``algorithm="auto"``;
on one host over shm that is the direct allreduce over the shared window),
``gradcoll-shm-det`` (``deterministic=True``), ``gradcoll-shm-bf16``
(``wire_dtype="bf16"``), ``gradcoll-shm-alloc`` (the buffer comes from
``ProcessGroup.alloc``: no copy-in), ``gradcoll-shm-same`` (the plain,
deterministic and bf16 calls taking turns in the same processes: the
variants' costs without the difference between launches), ``gloo``, ``mpi-shm`` (Open MPI, shared
memory BTL), ``mpi-tcp``, and ``memcpy``: every rank at once copies its
buffer twice (the copy-in and the copy-out no shared-memory allreduce can
avoid), the memory system's floor; ``floor`` in the table is memcpy's time
over gradcoll-shm's. ``--op``: allreduce (default), broadcast, allgather,
reduce_scatter, barrier (one size).

Needs: torch (``pip install torch==2.13.0``, the ``anchors`` extra) for gloo,
mpi4py and Open MPI's ``mpirun`` for the MPI anchors; missing anchors are
skipped with a message. busbw = algbw x 2(n-1)/n (nccl-tests' definition)
for allreduce, algbw x (n-1)/n for the others.
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
VARIANTS = ["gradcoll-shm-det", "gradcoll-shm-bf16", "gradcoll-shm-alloc", "memcpy", "gradcoll-shm-same"]
OPS = ["allreduce", "broadcast", "allgather", "reduce_scatter", "barrier"]


def _sizes(lo: str, hi: str) -> list[int]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size

    out, s = [], parse_size(lo)
    while s <= parse_size(hi):
        out.append(s)
        s *= 4
    return out


def _iters(nbytes: int, calls: int | None = None) -> int:
    """Calls per timed loop: ``calls`` where given (``--calls``), else 300 for the small sizes down to 5."""
    return calls if calls else int(max(5, min(300, (64 << 20) // max(nbytes, 1) // 4)))


# -- workers: one per implementation, run as every rank -------------------------
def _time_loop(step, barrier, nbytes: int, repeats: int, calls: int | None = None) -> float:
    iters = _iters(nbytes, calls)
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


#: Set in the launcher's environment: gradcoll's allreduces run this algorithm instead of "auto".
ALGORITHM_ENV = "GRADCOLL_BENCH_ALGORITHM"


def _gradcoll(kind: str, op: str):
    import gradcoll

    g = gradcoll.init_process_group(kind.split("-")[1] if kind != "memcpy" else "shm", "env://", timeout=120)
    world = g.size
    kw = {"gradcoll-shm-det": {"deterministic": True}, "gradcoll-shm-bf16": {"wire_dtype": "bf16"}}.get(kind, {})
    if os.environ.get(ALGORITHM_ENV):  # one algorithm instead of "auto" (benches/bench_tcp.py's gradcoll-tcp-ALGO)
        kw = {**kw, "algorithm": os.environ[ALGORITHM_ENV]}

    def make(buf):
        if kind == "memcpy":
            src = buf.copy()

            def copy():
                np.copyto(buf, src)
                np.copyto(src, buf)

            return copy
        if kind == "gradcoll-shm-alloc":
            slot = g.alloc(buf.size, buf.dtype)
            slot[:] = buf
            return lambda: g.allreduce(slot, op="mean")
        if op == "allreduce":
            return lambda: g.allreduce(buf, op="mean", **kw)
        if op == "broadcast":
            return lambda: g.broadcast(buf, root=0)
        if op == "allgather":
            out = np.empty((world, buf.size), buf.dtype)
            return lambda: g.allgather(buf, out=out)
        if op == "reduce_scatter":
            return lambda: g.reduce_scatter(buf, op="mean")
        return lambda: g.barrier()

    return g, g.rank, world, make, g.barrier, g.close


def _gloo(op: str):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    world = dist.get_world_size()

    def make(buf):
        t = torch.from_numpy(buf)
        if op == "allreduce":
            def step():
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
                t.div_(world)
            return step
        if op == "broadcast":
            return lambda: dist.broadcast(t, src=0)
        if op == "allgather":
            out = torch.empty(world * t.numel(), dtype=t.dtype)
            return lambda: dist.all_gather_into_tensor(out, t)
        if op == "reduce_scatter":
            raise SystemExit("gloo has no CPU reduce_scatter")
        return dist.barrier

    return None, dist.get_rank(), world, make, dist.barrier, dist.destroy_process_group


def _mpi(op: str):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()

    def make(buf):
        if op == "allreduce":
            def step():
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                np.multiply(buf, np.float32(1.0 / world), out=buf)
            return step
        if op == "broadcast":
            return lambda: comm.Bcast(buf, root=0)
        if op == "allgather":
            out = np.empty((world, buf.size), buf.dtype)
            return lambda: comm.Allgather(buf, out)
        if op == "reduce_scatter":
            chunk = buf.size // world
            out = np.empty(chunk, buf.dtype)

            def rs():
                comm.Reduce_scatter_block(buf[: chunk * world], out, op=MPI.SUM)
                np.multiply(out, np.float32(1.0 / world), out=out)
            return rs
        return comm.Barrier

    return None, comm.Get_rank(), world, make, comm.Barrier, lambda: None


#: ``gradcoll-shm-same``: the plain, deterministic and bf16-wire allreduce timed in the same processes, taking
#: turns at every size (plain, det, bf16, plain, ...; median over the turns), so that the variants' costs do
#: not carry the difference between two launches (on a machine with few cores, launches of the same code differ widely).
SAME = "gradcoll-shm-same"
SAME_ROWS = {"": "gradcoll-shm/same", "det": "gradcoll-shm-det/same", "bf16": "gradcoll-shm-bf16/same"}


def _same_worker(sizes: list[int], repeats: int) -> None:
    import gradcoll

    g = gradcoll.init_process_group("shm", "env://", timeout=120)
    kws = {"": {}, "det": {"deterministic": True}, "bf16": {"wire_dtype": "bf16"}}
    factor = 2 * (g.size - 1) / g.size
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        samples: dict[str, list[float]] = {v: [] for v in kws}
        for _ in range(max(3, repeats)):
            for v, kw in kws.items():
                samples[v].append(_time_loop(lambda kw=kw: g.allreduce(buf, op="mean", **kw), g.barrier, nbytes, 1))
        if g.rank == 0:
            for v, ts in samples.items():
                t = float(np.median(ts))
                print(TAG + json.dumps({"impl": SAME_ROWS[v], "op": "allreduce", "size": nbytes, "ranks": g.size,
                                        "time_us": t * 1e6, "busbw_GBps": nbytes / t / 1e9 * factor}), flush=True)
    g.close()


def worker(kind: str, sizes: list[int], repeats: int, op: str = "allreduce", calls: int | None = None) -> None:
    """Time this implementation's ``op`` over ``sizes``; rank 0 prints JSON rows."""
    if kind == SAME:
        _same_worker(sizes, repeats)
        return
    if kind.startswith("gradcoll") or kind == "memcpy":
        _, rank, world, make, barrier, close = _gradcoll(kind, op)
    elif kind == "gloo":
        _, rank, world, make, barrier, close = _gloo(op)
    else:
        _, rank, world, make, barrier, close = _mpi(op)
    if op == "barrier":
        sizes = sizes[:1]
    factor = 2 * (world - 1) / world if op == "allreduce" else (world - 1) / world
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        t = _time_loop(make(buf), barrier, nbytes, repeats, calls)
        if rank == 0:
            busbw = nbytes / t / 1e9 * factor
            print(TAG + json.dumps({"impl": kind, "op": op, "size": nbytes, "ranks": world, "time_us": t * 1e6,
                                    "busbw_GBps": busbw}), flush=True)
    close()


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


def run(kind: str, n: int, lo: str, hi: str, repeats: int, op: str = "allreduce",
        calls: int | None = None) -> list[dict]:
    """Run one implementation over ``n`` local ranks; return rank 0's rows."""
    wargs = [sys.executable, HERE, "--worker", kind, "--op", op, "--sizes", lo, hi, "--repeats", str(repeats),
             *(["--calls", str(calls)] if calls else [])]
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
        backend = "tcp" if kind in ("gloo", "gradcoll-tcp") else "shm"
        res = launch(wargs, n, backend=backend, prefix=False, out=sink, timeout=1800)
        out, ok, err = sink.text, res.ok, sink.text
    rows = [json.loads(line.split(TAG, 1)[1]) for line in out.splitlines() if TAG in line]
    if not ok:
        print(f"# {kind} failed:\n{err[-2000:]}", file=sys.stderr)
    return rows


#: (column, numerator impl, denominator impl): anchor-over-gradcoll ratios (> 1: gradcoll is faster), the
#: floor (memcpy over gradcoll: the fraction of the memory system's speed reached) and the variants' costs
#: (variant over plain: at most 1.1 is the goal).
RATIOS = [("shm/mpi-shm", "mpi-shm", "gradcoll-shm"), ("tcp/mpi-tcp", "mpi-tcp", "gradcoll-tcp"),
          ("tcp/gloo", "gloo", "gradcoll-tcp"), ("shm/gloo", "gloo", "gradcoll-shm"),
          ("alloc/mpi-shm", "mpi-shm", "gradcoll-shm-alloc"), ("floor", "memcpy", "gradcoll-shm"),
          ("det cost", "gradcoll-shm-det", "gradcoll-shm"), ("bf16 cost", "gradcoll-shm-bf16", "gradcoll-shm"),
          ("det cost/same", "gradcoll-shm-det/same", "gradcoll-shm/same"),
          ("bf16 cost/same", "gradcoll-shm-bf16/same", "gradcoll-shm/same")]


def best(rows: list[dict]) -> list[dict]:
    """Each implementation's fastest row per size (over the rounds)."""
    keep: dict[tuple[str, int], dict] = {}
    for r in rows:
        k = (r["impl"], r["size"])
        if k not in keep or r["time_us"] < keep[k]["time_us"]:
            keep[k] = r
    return list(keep.values())


def table(rows: list[dict], impls: list[str], n: int, op: str = "allreduce") -> str:
    """Time and busbw per size, with the ratios of ``RATIOS`` whose implementations ran."""
    by = {(r["impl"], r["size"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    present = [i for i in impls if any((i, s) in by for s in sizes)]
    head = f"{'size':>9} " + " ".join(f"{i + ' us':>18}" for i in present)
    pairs = [p for p in RATIOS if p[1] in present and p[2] in present]
    head += " " + " ".join(f"{c:>13}" for c, _, _ in pairs)
    lines = [f"# {op}, float32, mean, {n} ranks; time per call (busbw GB/s); ratio = anchor time / gradcoll time", head]
    for s in sizes:
        cells = []
        for i in present:
            r = by.get((i, s))
            cells.append(f"{r['time_us']:>10.1f} ({r['busbw_GBps']:>5.2f})" if r else f"{'-':>18}")
        ratios = []
        for _, a, b in pairs:
            ra, rb = by.get((a, s)), by.get((b, s))
            ratios.append(f"{ra['time_us'] / rb['time_us']:>13.2f}" if ra and rb else f"{'-':>13}")
        label = f"{s // 1024}K" if s < 1 << 20 else f"{s >> 20}M"
        lines.append(f"{label:>9} " + " ".join(cells) + " " + " ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Driver entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--sizes", nargs=2, default=["4K", "64M"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per timed loop at every size (default: 300 for the small sizes down to 5)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved runs of every implementation; best kept")
    ap.add_argument("--op", default="allreduce", choices=OPS)
    ap.add_argument("--only", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS + VARIANTS)}")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, _sizes(*a.sizes), a.repeats, a.op, a.calls)
        return 0
    rows: list[dict] = []
    impls = [i for i in a.only.split(",") if i]
    runnable = []
    for kind in impls:
        why = _available(kind)
        if why:
            print(f"# skipping {kind}: {why}", file=sys.stderr)
        else:
            runnable.append(kind)
    for rnd in range(a.rounds):
        for kind in runnable:
            print(f"# round {rnd + 1}/{a.rounds}: {kind} on {a.nprocs} ranks ...", file=sys.stderr, flush=True)
            rows += run(kind, a.nprocs, a.sizes[0], a.sizes[1], a.repeats, a.op, a.calls)
    print(f"# python benches/compare_anchors.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    shown = [r for i in impls for r in ([*SAME_ROWS.values()] if i == SAME else [i])]
    print(table(best(rows), shown, a.nprocs, a.op))
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

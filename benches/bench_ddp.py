"""DDP on torch.distributed's backend "gradcoll" against "gloo": training step and gradient-sync time.

Every rank runs both backends in the same processes: the default group is
gloo, and ``dist.new_group(backend="gradcoll")`` builds the gradcoll group
(shared memory: the ranks are on one host). Each model is trained by two
DistributedDataParallel replicas, one per group, from the same initial
weights on the same batches; rounds alternate which backend goes first, so
both see the same machine. Float32, SGD, default DDP buckets (25 MiB).

* step: wall time of ``zero_grad, forward, backward (DDP's bucketed
  allreduces overlap it), optimizer.step()``, rank 0, median over
  ``--steps`` x ``--rounds``.
* sync: the gradient sync alone: the model's gradients in DDP's bucket
  sizes, one asynchronous ``dist.all_reduce`` per bucket, then wait for
  all, after a barrier; median.
* compute: the same step without DDP (no communication), for reference.

The ratios are gloo's time over gradcoll's (above 1: gradcoll is faster).
Every rank runs ``torch.set_num_threads(1)``: several ranks share the
host's cores, and torch's intra-op threads would otherwise fight over them.
The replicas' weights are compared at the end (``max |gradcoll - gloo|``).

    python benches/bench_ddp.py                      # 2 and 4 ranks, the ~25M and ~1M MLPs
    python benches/bench_ddp.py --ranks 2 --models 1M --steps 20

Needs torch (``pip install 'gradcoll[torch]'``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

HERE = os.path.abspath(__file__)
TAG = "@@ddp "
#: name -> layer widths of the MLP (in, hidden..., out).
MODELS = {"25M": [1024, 4096, 4096, 1024], "1M": [512, 1024, 512]}
BUCKET_MB = 25


def _mlp(widths: list[int]):  # type: ignore[no-untyped-def]
    import torch

    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _buckets(model, cap_mb: int):  # type: ignore[no-untyped-def]
    """Flat tensors the sizes of DDP's buckets (reverse parameter order, ``cap_mb`` MiB each)."""
    import torch

    sizes, cur = [], 0
    for p in reversed(list(model.parameters())):
        if cur and (cur + p.numel()) * 4 > cap_mb << 20:
            sizes.append(cur)
            cur = 0
        cur += p.numel()
    sizes.append(cur)
    return [torch.randn(n) / 1000 for n in sizes]


def worker(models: list[str], steps: int, rounds: int, batch: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcoll.torch  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "gradcoll": dist.new_group(backend="gradcoll")}
    for name in models:
        widths = MODELS[name]
        torch.manual_seed(0)
        base = _mlp(widths)
        nparams = sum(p.numel() for p in base.parameters())
        replicas = {b: _mlp(widths) for b in groups}
        for m in replicas.values():
            m.load_state_dict(base.state_dict())
        ddps = {b: DDP(replicas[b], process_group=g, bucket_cap_mb=BUCKET_MB) for b, g in groups.items()}
        opts = {b: torch.optim.SGD(replicas[b].parameters(), lr=1e-3) for b in groups}
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(batch, widths[0], generator=gen), torch.randn(batch, widths[-1], generator=gen)
        local = _mlp(widths)
        local_opt = torch.optim.SGD(local.parameters(), lr=1e-3)
        start = _buckets(base, BUCKET_MB)
        bufs = [b.clone() for b in start]

        def step(net, opt) -> float:  # type: ignore[no-untyped-def]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        def sync(group) -> float:  # type: ignore[no-untyped-def]
            for b, b0 in zip(bufs, start, strict=True):  # the same values every time: repeated sums would overflow
                b.copy_(b0)
            dist.barrier()
            t0 = time.perf_counter()
            for w in [dist.all_reduce(b, group=group, async_op=True) for b in bufs]:
                w.wait()
            return time.perf_counter() - t0

        times: dict[str, dict[str, list[float]]] = {b: {"step": [], "sync": []} for b in groups}
        times["local"] = {"step": []}
        for b in groups:  # warm-up: DDP's first iterations rebuild buckets; the groups connect lazily
            for _ in range(2):
                step(ddps[b], opts[b])
                sync(groups[b])
        step(local, local_opt)
        for r in range(rounds):
            order = list(groups) if r % 2 == 0 else list(groups)[::-1]
            for b in order:
                times[b]["step"] += [step(ddps[b], opts[b]) for _ in range(steps)]
                times[b]["sync"] += [sync(groups[b]) for _ in range(steps)]
            times["local"]["step"] += [step(local, local_opt) for _ in range(steps)]
        diff = max(float((a - c).abs().max()) for a, c in zip(replicas["gradcoll"].parameters(),
                                                                replicas["gloo"].parameters(), strict=True))
        if rank == 0:
            med = {b: {k: statistics.median(v) * 1e3 for k, v in t.items()} for b, t in times.items()}
            print(TAG + json.dumps({"ranks": world, "model": name, "params": nparams, "ms": med,
                                    "max_weight_diff": diff, "transport": groups["gradcoll"].transport}), flush=True)
        del ddps
    dist.destroy_process_group()


def run(n: int, models: list[str], steps: int, rounds: int, batch: int) -> list[dict]:
    from gradcoll.cli.launch import launch

    sink = io.StringIO()
    cmd = [sys.executable, HERE, "--worker", "--models", *models, "--steps", str(steps), "--rounds", str(rounds),
           "--batch", str(batch)]
    # GRADCOLL_BACKEND is what `launch` sets; "shm" is what the backend picks by itself for ranks on one host.
    res = launch(cmd, n, backend="shm", prefix=False, out=sink, timeout=3600, env={"OMP_NUM_THREADS": "1"})
    if not res.ok:
        print(f"# {n} ranks failed:\n{sink.getvalue()[-3000:]}", file=sys.stderr)
    return [json.loads(line.split(TAG, 1)[1]) for line in sink.getvalue().splitlines() if TAG in line]


def table(rows: list[dict]) -> str:
    head = (f"{'ranks':>5} {'model':>5} {'params':>10} {'step gloo':>10} {'step gc':>9} {'compute':>8} "
            f"{'sync gloo':>10} {'sync gc':>9} {'step x':>7} {'sync x':>7} {'|dw|':>8}")
    lines = ["# DDP, float32, torch.set_num_threads(1) per rank; times in ms (median); x = gloo / gradcoll", head]
    for r in rows:
        gl, gc = r["ms"]["gloo"], r["ms"]["gradcoll"]
        lines.append(f"{r['ranks']:>5} {r['model']:>5} {r['params']:>10,} {gl['step']:>10.1f} {gc['step']:>9.1f} "
                     f"{r['ms']['local']['step']:>8.1f} {gl['sync']:>10.1f} {gc['sync']:>9.1f} "
                     f"{gl['step'] / gc['step']:>7.2f} {gl['sync'] / gc['sync']:>7.2f} {r['max_weight_diff']:>8.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=5, help="steps (and syncs) per backend per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.models, a.steps, a.rounds, a.batch)
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print("bench_ddp needs torch: pip install 'gradcoll[torch]'", file=sys.stderr)
        return 2
    rows = [row for n in a.ranks for row in run(n, a.models, a.steps, a.rounds, a.batch)]
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())

"""The ranks of tests/torch/test_backend.py: ``python torch_ranks.py SCENARIO OUTDIR [ARGS...]``.

Each scenario runs on every rank of a job started by ``gradcoll launch``
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) and writes
what it saw to ``OUTDIR/rank{r}.json``; the tests compare those results with
exact values. ``GRADCOLL_BACKEND``, which the launcher always sets, is
removed first unless the scenario is about it, so that the backend chooses
the transport itself.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradcoll
import gradcoll.torch

RESULTS: dict[str, Any] = {}


def _init(**kw: Any) -> tuple[int, int]:
    dist.init_process_group("gradcoll", timeout=timedelta(seconds=kw.pop("timeout", 60)), **kw)
    return dist.get_rank(), dist.get_world_size()


def _reinit(k: int) -> None:
    """The k-th new default group of this process, on a store of its own (``MASTER_PORT + k``).

    With ``env://`` a new group reuses ``MASTER_PORT``: a rank that destroyed its group first may
    reach rank 0's old store, still serving while rank 0 closes its group, and lose it a moment later.
    """
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + k}"
    _init(init_method=where, rank=rank, world_size=n)


def _error(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:  # the tests look at the class, its bases and the message
        return {"type": type(exc).__name__, "runtime": isinstance(exc, RuntimeError),
                "gradcoll": isinstance(exc, gradcoll.GradcollError), "message": str(exc)}
    return {"type": None}


def collectives() -> None:
    """Every supported collective and dtype, async work, subgroups, errors, transport choice."""
    rank, n = _init()
    pg = dist.distributed_c10d._get_default_group()
    RESULTS["transport"] = pg.transport
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "premul": dist._make_nccl_premul_sum(0.5)}
    for dtype in ("float32", "float64", "float16", "bfloat16", "int64", "int32"):
        for name, op in ops.items():
            if dtype.startswith("int") and name in ("avg", "premul"):
                continue
            t = torch.tensor([rank + 1.0, -2.0 * rank, 0.25]).to(getattr(torch, dtype))
            dist.all_reduce(t, op=op)
            RESULTS[f"all_reduce/{dtype}/{name}"] = [t.dtype == getattr(torch, dtype), t.double().tolist()]
    t = torch.full((5,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    RESULTS["async"] = [work.wait(), work.is_completed(), fut.wait()[0].tolist(), t.tolist()]
    b = torch.full((3,), float(rank), dtype=torch.bfloat16)
    dist.broadcast(b, src=n - 1)
    RESULTS["broadcast"] = b.double().tolist()
    outs = [torch.empty(2, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([rank, 10.0 * rank], dtype=torch.float64))
    RESULTS["all_gather"] = [o.tolist() for o in outs]
    into = torch.empty(2 * n, dtype=torch.int64)
    dist.all_gather_into_tensor(into, torch.tensor([rank, -rank]))
    RESULTS["all_gather_into_tensor"] = into.tolist()
    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.tensor([10.0 * i + rank, 1.0]) for i in range(n)])
    RESULTS["reduce_scatter"] = out.tolist()
    out = torch.empty(2, dtype=torch.bfloat16)
    src = torch.arange(2.0 * n).to(torch.bfloat16)
    dist.reduce_scatter_tensor(out, src, op=dist.ReduceOp.AVG)
    RESULTS["reduce_scatter_tensor"] = [out.double().tolist(), src.double().tolist()]
    dist.barrier()
    sub = dist.new_group([0, n - 1])
    if rank in (0, n - 1):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        RESULTS["subgroup"] = [t.item(), dist.get_world_size(sub), dist.get_rank(sub)]
    RESULTS["errors"] = {
        "product": _error(lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT)),
        "dtype": _error(lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32))),
        "gather": _error(lambda: pg.gather([[torch.ones(1)] * n], [torch.ones(1)], dist.GatherOptions())),
        "send": _error(lambda: dist.send(torch.ones(1), dst=(rank + 1) % n)),
    }
    t = torch.ones(3)  # the group still works after refusing what it does not serve
    dist.all_reduce(t)
    RESULTS["after_errors"] = t.tolist()
    # gradcoll's own init_process_group in a process that already runs torch.distributed: meets in torch's store
    own = gradcoll.init_process_group("tcp", timeout=30)
    RESULTS["own_group"] = own.allreduce(torch.full((2,), float(rank)).numpy(), op="sum").tolist()
    own.close()
    dist.destroy_process_group()


def init_methods(method: str, path: str = "") -> None:
    """``init_method=`` tcp:// and file:// with rank, world size and a timeout; the transport override."""
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}" if method == "tcp" else f"file://{path}"
    options = gradcoll.torch.Options(transport="tcp") if method == "tcp" else None
    _init(init_method=where, rank=rank, world_size=n, timeout=20, pg_options=options)
    t = torch.full((4,), rank + 1.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    RESULTS["avg"] = t.tolist()
    RESULTS["transport"] = dist.distributed_c10d._get_default_group().transport
    dist.destroy_process_group()


def _net() -> torch.nn.Module:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)
            self.unused = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    return Net()


def ddp() -> None:
    """DDP on the gradcoll backend, DDP on gloo with gradcoll's comm hook, and DDP on gloo, side by side."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = _init()
    gloo = dist.new_group(backend="gloo")
    own = gradcoll.init_process_group("tcp", timeout=30)
    models = {k: _net() for k in ("gradcoll", "hook", "gloo")}
    nets = {"gradcoll": DDP(models["gradcoll"], bucket_cap_mb=0.001, find_unused_parameters=True),
            "hook": DDP(models["hook"], process_group=gloo, bucket_cap_mb=0.001, find_unused_parameters=True),
            "gloo": DDP(models["gloo"], process_group=gloo, bucket_cap_mb=0.001, find_unused_parameters=True)}
    nets["hook"].register_comm_hook(None, gradcoll.torch.comm_hook(own, nets["hook"]))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        for k, net in nets.items():
            opts[k].zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opts[k].step()
    for k, m in models.items():
        RESULTS[k] = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
    RESULTS["buckets"] = len(nets["gradcoll"].reducer._get_zeros_like_grad_buckets())
    own.close()
    dist.destroy_process_group()


def nonfinite(culprit: str) -> None:
    """A NaN in one rank's input: the direct collective, DDP on the backend, DDP with the comm hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = _init()
    bad = rank == int(culprit)
    t = torch.tensor([1.0, float("nan") if bad else 2.0, 3.0])
    RESULTS["all_reduce"] = _error(lambda: dist.all_reduce(t))
    dist.destroy_process_group()  # a failed collective poisons the group: a new one for each case
    _reinit(1)
    own = gradcoll.init_process_group("tcp", timeout=30)
    for case in ("ddp", "hook"):
        model = _net()
        net = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
        if case == "hook":
            net.register_comm_hook(None, gradcoll.torch.comm_hook(own, net))
        x = torch.randn(4, 8)
        if bad:
            x[1, 2] = float("inf")

        def step() -> None:
            torch.nn.functional.mse_loss(net(x), torch.zeros(4, 4)).backward()

        RESULTS[case] = _error(step)
        if case == "ddp":
            dist.destroy_process_group()
            _reinit(2)
    own.close()


def peer_failure(kind: str) -> None:
    """Rank n-1 dies (``dead``) or never calls (``stall``) the collective the others wait in."""
    rank, n = _init(timeout=float(os.environ.get("FAIL_TIMEOUT", "6")))
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == n - 1:
        if kind == "dead":
            os._exit(0)  # no goodbye: the others find the process gone
        store.wait(["peer_failure/done"], timedelta(seconds=120))  # stalled until the others have their error
        RESULTS["stalled"] = True
        store.set("peer_failure/seen", "1")  # rank 0 hosts the store: it must not exit before this rank saw "done"
        return
    import time

    t0 = time.monotonic()
    RESULTS["error"] = _error(lambda: dist.all_reduce(torch.ones(1 << 16)))
    RESULTS["seconds"] = time.monotonic() - t0
    if rank == 0:
        store.set("peer_failure/done", "1")
        if kind == "stall":
            store.wait(["peer_failure/seen"], timedelta(seconds=120))


def main() -> None:
    scenario, out, *args = sys.argv[1:]
    if scenario != "init_methods" or args[0] != "file":
        os.environ.pop("GRADCOLL_BACKEND", None)
    globals()[scenario](*args)
    rank = os.environ["RANK"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(RESULTS))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: the ranks are done, and a stalled peer is still waiting


if __name__ == "__main__":
    main()

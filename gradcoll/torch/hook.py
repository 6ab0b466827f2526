"""A DDP communication hook that averages gradients on a gradcoll group, for jobs that keep gloo or nccl.

```python
group = gradcoll.init_process_group()                     # next to dist.init_process_group("gloo")
ddp = DistributedDataParallel(model)
ddp.register_comm_hook(None, gradcoll.torch.comm_hook(group, model))
```

DDP keeps its buckets, its overlap with ``backward()`` and everything else
on its own process group; each bucket's averaging runs on ``group``
(finite-checked: a NaN or Inf in any rank's gradient fails ``backward()``
on every rank with a ``RuntimeError`` naming the rank and the parameter).
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real classes.
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from ..errors import NonFiniteError
from ._tensors import Staged
from ._work import Driver

__all__ = ["comm_hook"]


def comm_hook(group: Any, model: torch.nn.Module | None = None, *,
              check_finite: bool = True) -> Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]:
    """A hook for ``DistributedDataParallel.register_comm_hook(state, hook)`` that averages on ``group``.

    ``group`` is a gradcoll [`ProcessGroup`][gradcoll.group.ProcessGroup]
    (from `gradcoll.init_process_group`); ``model`` (the module DDP wraps,
    or DDP itself) lets an error name the parameter holding a NaN. The
    hook's collectives run in order on one thread of their own; ``state`` is
    not used.
    """
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()} if model is not None else {}
    driver = Driver(f"comm-hook-rank{group.rank}")

    def where(bucket: Any, index: int | None) -> str:
        off = 0
        for i, p in enumerate(bucket.parameters()):
            if index is not None and off <= index < off + p.numel():
                name = names.get(id(p), f"#{i} of shape {tuple(p.shape)}")
                return f"parameter {name}[{index - off}] (DDP bucket {bucket.index()})"
            off += p.numel()
        return f"DDP bucket {bucket.index()}"

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        staged = Staged(buf, "mean", f"DDP bucket {bucket.index()}")

        def job() -> Any:
            try:
                group.allreduce(staged.array, op="mean", check_finite=check_finite and not staged.exact,
                                wire_dtype=staged.wire)
            except NonFiniteError as exc:
                exc.args = (f"{exc} -> {where(bucket, exc.index)}", *exc.args[1:])
                raise
            staged.finish()
            return buf

        future: torch.futures.Future[torch.Tensor] = driver.submit(f"DDP bucket {bucket.index()} allreduce",
                                                                  job).get_future()
        return future

    return hook

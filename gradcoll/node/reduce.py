"""``group_mean``: average a flat gradient buffer across every rank of a group.

The original ran its own ring allreduce and, when the reduce failed,
quietly returned zeros, so a broken link looked like a zero gradient. This
one runs gradcoll's ring (mesh) or star (star topology) allreduce and lets
every failure raise: a closed or broken link, a timeout, a NaN/Inf, a rank
that called something else. In the ring the buffer is cut into ``n``
near-equal chunks (the first ``len % n`` one element longer), and the rank
that finishes each chunk divides it by ``n`` before the allgather, so every
rank ends with bit-identical means.

``float64_accumulate=True`` accumulates in float64 and rounds once at the
end, so the result does not depend on which rank's contribution is added
first (float32 loses ``4`` next to ``1e8``; float64 does not). It is not the
group's ``allreduce(deterministic=True)``, which is bitwise reproducible
under any algorithm and layout; ``deterministic=`` is still accepted here as
the flag's old name, and ``mean_reduce`` as the function's (it is also the
name of the local kernel ``gradcoll.kernels.mean_reduce``).
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..group.process_group import ProcessGroup
from .config import Topology, topology_of
from .stage import float64_accumulate_of

__all__ = ["group_mean", "mean_reduce"]


def group_mean(group: ProcessGroup, buf: np.ndarray, *, op: str = "mean", float64_accumulate: bool = False,
               timeout: float | None = None, deterministic: bool | None = None) -> np.ndarray:
    """Average (or with ``op="sum"`` add) ``buf`` across every rank of ``group`` in place; returns ``buf``.

    ``deterministic=`` is the old name of ``float64_accumulate=``.
    """
    wide_sum = float64_accumulate_of(float64_accumulate, deterministic)
    if op not in ("mean", "sum"):
        raise UsageError(f"group_mean takes op 'mean' or 'sum', got {op!r}")
    if not isinstance(buf, np.ndarray) or buf.dtype not in (np.float16, np.float32, np.float64):
        what = buf.dtype if isinstance(buf, np.ndarray) else type(buf).__name__
        raise UsageError(f"group_mean needs a float16/32/64 numpy array, got {what}")
    algorithm = "star" if topology_of(group) is Topology.STAR else "ring"
    if wide_sum and buf.dtype != np.float64:
        wide = buf.astype(np.float64)
        group.allreduce(wide, op=op, algorithm=algorithm, timeout=timeout)
        buf[...] = wide  # one rounding, after the exact-as-possible sum
        return buf
    group.allreduce(buf, op=op, algorithm=algorithm, timeout=timeout)
    return buf


#: The old name of [`group_mean`][gradcoll.node.reduce.group_mean].
mean_reduce = group_mean

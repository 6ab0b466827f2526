"""Allreduce of a device (CUDA) array: gather every rank's buffer through host memory, reduce on the device.

The transports move host memory, so each rank copies its device buffer into
a host staging buffer, the ring [`allgather`][gradcoll.algorithms.allgather]
gives every rank every rank's buffer (row ``r`` from rank ``r``), and the
rows go back to the device once, where the fused CUDA kernel of
[`gradcoll.kernels.mean_reduce`][gradcoll.kernels.mean_reduce] reduces them
in rank order into the caller's buffer. Every rank reduces the same rows in
the same order, so every rank ends with the same bits. Each rank receives
``n - 1`` buffers (a ring allreduce receives about two): bandwidth traded
for one kernel launch and no arithmetic on the host.

``max`` and ``min`` reduce the gathered rows on the host and copy the result
back (there is no device kernel for them); a NaN/Inf in any row raises
[`NonFiniteError`][gradcoll.errors.NonFiniteError] naming the rank (the row)
whose buffer held it, on every rank: every rank sees every row. The staging buffers are the caller's (the group keeps them pinned
and reuses them across calls); they are scratch after the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UsageError
from ..transport.base import Transport
from ._common import check_op
from .allgather import allgather

__all__ = ["device_allreduce", "DEVICE_DTYPES"]

#: Element types a device buffer may have (the CUDA reduction kernels take these).
DEVICE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def device_allreduce(transport: Transport, dev: Any, local: np.ndarray, rows: np.ndarray, *, op: str = "mean",
                     check_finite: bool = True, seq: int = 0, timeout: float | None = None) -> Any:
    """Reduce the 1-D device array ``dev`` across all ranks in place through the host buffers ``local`` and ``rows``.

    ``local`` has ``dev``'s size and dtype, ``rows`` the shape
    ``(transport.size, dev.size)``; returns ``dev``.
    """
    from numba import cuda

    from ..kernels import mean_reduce

    check_op(op)
    dtype, n = np.dtype(dev.dtype), int(dev.size)
    if dtype not in DEVICE_DTYPES:
        raise UsageError(f"rank {transport.rank}: device buffers must be float32 or float64, got {dtype}")
    if local.shape != (n,) or rows.shape != (transport.size, n) or local.dtype != dtype or rows.dtype != dtype:
        raise UsageError(f"rank {transport.rank}: device allreduce staging buffers must be {dtype} of shapes "
                         f"({n},) and ({transport.size}, {n}), got {local.shape} and {rows.shape}")
    dev.copy_to_host(local)
    allgather(transport, local, rows, seq=seq, timeout=timeout)
    if op in ("mean", "sum"):
        mean_reduce(cuda.to_device(rows), out=dev, op=op, check_finite=check_finite)
        return dev
    if check_finite and not np.isfinite(rows).all():
        mean_reduce(rows, op="sum")  # raises NonFiniteError naming the rank (the row) that held it
    dev.copy_to_device(np.maximum.reduce(rows) if op == "max" else np.minimum.reduce(rows))
    return dev

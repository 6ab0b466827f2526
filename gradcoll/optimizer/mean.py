"""Combining updates: the element-wise (weighted) mean through gradcoll's fused kernel.

The optimizer never adds gradients itself; it hands float64 rows to
[`gradcoll.kernels.mean_reduce`][gradcoll.kernels.mean_reduce], which sums them in a fixed order and
checks the result for NaN/Inf in the same pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import kernels
from ..errors import NonFiniteError, UsageError
from .errors import DimensionMismatch, NonFiniteUpdate
from .values import GradientUpdate

__all__ = ["combine", "first_nonfinite"]


def _empty() -> np.ndarray:
    out = np.empty(0, dtype=np.float64)
    out.setflags(write=False)
    return out


def first_nonfinite(gradients: np.ndarray, backend: str | None = None) -> tuple[int, float] | None:
    """``(index, value)`` of the first NaN/Inf in ``gradients``, or ``None`` when all finite."""
    try:
        kernels.check_finite(gradients, backend=backend)
    except NonFiniteError as exc:
        if exc.index is None or exc.value is None:  # check_finite always names the element
            raise
        return exc.index, exc.value
    return None


def _normalise(weights: Sequence[float], n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise UsageError(f"expected {n} weights, one per update, got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise UsageError("weights must be finite and non-negative")
    total = float(w.sum())
    if total <= 0.0:
        raise UsageError("weights must not all be zero")
    return w / total


def _weighted_sum(rows: list[np.ndarray], norm: np.ndarray, backend: str | None) -> np.ndarray:
    # Scaling each row before the sum keeps every partial sum within the range
    # of the inputs (the weights sum to 1), so a finite input cannot overflow.
    scaled = [r * w for r, w in zip(rows, norm, strict=True)]
    total: np.ndarray = kernels.mean_reduce(scaled, op="sum", accumulate_dtype=np.float64, backend=backend)
    return total


def combine(
    updates: Sequence[GradientUpdate],
    weights: Sequence[float] | None = None,
    *,
    backend: str | None = None,
) -> tuple[np.ndarray, tuple[float, ...]]:
    """Element-wise mean of ``updates`` (weighted when ``weights`` is given).

    Returns ``(values, normalised weights)``. ``values`` is a read-only float64
    array, empty when there are no updates or all are empty. Unequal lengths
    raise ``DimensionMismatch``; a NaN/Inf raises ``NonFiniteUpdate``
    naming the update's worker, layer and position.
    """
    n = len(updates)
    if n == 0:
        return _empty(), ()
    dim = updates[0].dim
    for u in updates[1:]:
        if u.dim != dim:
            raise DimensionMismatch(u.layer_id, dim, u.dim, u.worker_id)
    norm = np.full(n, 1.0 / n) if weights is None else _normalise(weights, n)
    if dim == 0:
        return _empty(), tuple(norm.tolist())
    rows = [u.gradients for u in updates]
    try:
        try:
            if weights is None:
                # The common case: one fused pass, sum in order then divide,
                # bit-identical to the NumPy reference of the kernel.
                out = kernels.mean_reduce(rows, op="mean", accumulate_dtype=np.float64, backend=backend)
            else:
                out = _weighted_sum(rows, norm, backend)
        except NonFiniteError as exc:
            if exc.contributor is not None or weights is not None:
                raise
            # Every input is finite but the running sum overflowed before the
            # division (values near the float64 limit): pre-scale instead.
            out = _weighted_sum(rows, norm, backend)
    except NonFiniteError as exc:
        if exc.contributor is None:
            raise
        u = updates[exc.contributor]
        raise NonFiniteUpdate(u.worker_id, u.layer_id, u.step, exc.index, exc.value, contributor=exc.contributor) from exc
    out.setflags(write=False)
    return out, tuple(norm.tolist())

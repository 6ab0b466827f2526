"""Bitwise-reproducible allreduce: exact fixed-point sums, one rounding at the end.

Floating-point addition is not associative, so the bits of an ordinary
allreduce depend on the algorithm, the chunking and the order of arrival.
This one does not:

1. **Agree on a scale.** A tiny allreduce(max) of ``max |x|`` (8 bytes, by
   recursive doubling) gives every rank the same binary exponent ``E`` with
   ``max |x| < 2**E``. It also carries the finite check: a NaN/Inf anywhere
   fails it on every rank, naming the rank.
2. **Convert once.** Every element becomes the integer ``rint(x * 2**(F-E))``
   with ``F = 52 - ceil(log2 n)`` fraction bits, held in a float64 (one
   rounding per contribution, round-half-even, the same on every machine).
   ``|integer| <= 2**F``, so any partial sum of up to ``n`` of them stays
   below ``2**52``, where float64 addition of integers is *exact*.
3. **Sum exactly.** The float64 integers go through the ordinary ring, star
   or recursive-doubling allreduce with ``op="sum"``. Every addition is exact,
   hence associative: the same bits whatever the algorithm, chunking,
   transport, thread count or arrival order, for the same multiset of
   contributions.
4. **Round once.** ``sum * 2**(E-F)`` (exact), divided by ``n`` for a mean
   (one float64 rounding) and stored in the buffer's dtype (one more).

When every float32 input is a multiple of ``2**(E-F)`` - its exponent within
``F - 24`` binades of the largest (25 binades at 8 ranks, 23 at 32, 19 at
1,024) - step 2 rounds nothing, and the result equals the float64 sum
rounded to float32 (``float32(float64 sum / n)``) bit for bit. Smaller
elements are rounded to the ``2**(E-F)`` grid first (absolute error at most
``2**(E-F-1)`` each, still deterministic). Cost: one extra 8-byte round and
float64 (twice the bytes) on the wire. See docs/algorithms/deterministic.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import UsageError
from ..transport.base import Transport
from . import ALLREDUCE
from ._common import Workspace, scratch
from .recursive_doubling import recursive_doubling_allreduce

__all__ = ["deterministic_allreduce", "fraction_bits"]


def fraction_bits(n: int) -> int:
    """Fixed-point fraction bits for ``n`` ranks: the sum of ``n`` values of ``2**F`` must stay <= 2**52."""
    return 52 - max(0, (n - 1).bit_length())


def deterministic_allreduce(transport: Transport, buf: np.ndarray, *, algorithm: str = "ring", op: str = "mean",
                            check_finite: bool = True, seq: int = 0, timeout: float | None = None,
                            workspace: Workspace | None = None, backend: str | None = None,
                            **extra: int) -> np.ndarray:
    """Allreduce ``buf`` (float32/float64) in place with bit-identical results under any schedule; returns ``buf``.

    Uses two sequence numbers: ``seq`` for the scale round, ``seq + 1`` for the data.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError("buf must be a writeable C-contiguous numpy array")
    if buf.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise UsageError(f"deterministic allreduce takes float32 or float64, got {buf.dtype}")
    if op not in ("mean", "sum"):
        raise UsageError(f"deterministic allreduce takes op 'mean' or 'sum', got {op!r}")
    if algorithm not in ALLREDUCE:
        raise UsageError(f"unknown allreduce algorithm {algorithm!r}; known: {', '.join(ALLREDUCE)}")
    flat = buf.reshape(-1)
    n = transport.size
    fixed = _fixed_kernels()
    peak = np.zeros(1, np.float64)
    if flat.size:  # NaN propagates, Inf stays: the check of the scale round sees them
        peak[0] = fixed.peak(flat) if fixed else max(float(flat.max()), -float(flat.min()))
    recursive_doubling_allreduce(transport, peak, op="max", check_finite=check_finite, seq=seq, timeout=timeout,
                                 workspace=workspace, backend=backend)
    if not math.isfinite(peak[0]):  # only reachable with check_finite=False
        flat.fill(np.nan)
        return buf
    e = math.frexp(float(peak[0]))[1]  # peak < 2**e
    f = fraction_bits(n)
    fx = scratch(workspace, "det", flat.size, np.float64)
    if fixed:
        fixed.to_fixed(flat, fx, math.ldexp(1.0, f - e))
    else:
        np.multiply(flat, math.ldexp(1.0, f - e), out=fx)  # exact: a power of two
        np.rint(fx, out=fx)
    ALLREDUCE[algorithm](transport, fx, op="sum", check_finite=False, seq=seq + 1, timeout=timeout,
                         workspace=workspace, backend=backend, **extra)
    divisor = float(n) if op == "mean" else 1.0
    if fixed:
        fixed.from_fixed(fx, flat, math.ldexp(1.0, e - f), divisor)
    else:
        np.multiply(fx, math.ldexp(1.0, e - f), out=fx)
        np.divide(fx, divisor, out=fx)
        np.copyto(flat, fx, casting="same_kind")
    return buf


def _fixed_kernels() -> Any:
    """The fused Numba conversions, or None (then NumPy does the same arithmetic in more passes)."""
    try:
        from .._kernels import numba_fixed
    except ImportError:
        return None
    return numba_fixed

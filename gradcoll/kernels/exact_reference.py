"""NumPy reference of the exact reduction behind ``deterministic=True`` (the oracle for numba_exact).

For one element, ``n`` contributions ``x_1 .. x_n`` (float32 or float64):

1. ``E`` is the binary exponent of the largest magnitude, read off its bits:
   the biased exponent ``b`` of ``max |x_k|`` gives ``max |x_k| < 2**E`` with
   ``E = max(b, 1) - bias + 1``, and at least ``F - 1022`` so that both
   scales below are normal float64 numbers (this clamp only matters for
   float64 elements below about ``2**-970``).
2. Each contribution becomes the integer ``rint(x_k * 2**(F-E))`` (round half
   to even) with ``F = min(51, 52 - ceil(log2 n))`` fraction bits, held in a
   float64. ``|integer| <= 2**F``, so every partial sum of ``n`` of them is an
   integer of at most ``2**52``: float64 adds them exactly, in any order.
3. The sum times ``2**(E-F)`` (exact) is divided by the divisor (``n`` for a
   mean, one float64 rounding) and stored in the output dtype (one more).

With exactly two contributions the grid is skipped: ``float64(x_1) +
float64(x_2)`` is commutative, so already order-independent, and for float32
inputs it is exact up to 29 binades apart and correctly rounded beyond (then
divided and stored as above).

``E`` is a maximum and the integer sum is exact, so the result depends only on
the multiset of contributions: the same bits whatever the order, grouping,
chunking or algorithm. All-zero elements and elements with a NaN or an
infinity are summed in plain float64 instead (exact for zeros; NaN/Inf
propagate as IEEE sums do, independent of order up to the NaN's payload).

A float32 contribution is exactly on the grid (step 2 rounds nothing) when
its exponent lies within ``F - 24`` binades of the element's largest; then
the result is ``out_dtype(float64_sum / divisor)`` bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["NAME", "fraction_bits", "params", "exponents", "exact_reduce", "BITS"]

NAME = "numpy"

#: bits view, magnitude mask, mantissa bits, exponent bias, all-ones exponent, per input dtype
BITS: dict[np.dtype[Any], tuple[Any, int, int, int, int]] = {
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 23, 127, 0xFF),
    np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, 52, 1023, 0x7FF),
}


def fraction_bits(n: int) -> int:
    """Fixed-point fraction bits for ``n`` contributions: ``n`` values of at most ``2**F`` sum to at most ``2**52``."""
    return min(51, 52 - max(0, (n - 1).bit_length()))


@functools.lru_cache(maxsize=64)
def params(dtype: np.dtype[Any], n: int) -> tuple[int, int, int]:
    """``(hi, lo, bmin)`` for ``n`` contributions of ``dtype``, in terms of the biased exponent ``b``.

    With ``b' = max(b, bmin)`` the scale ``2**(F-E)`` has the float64 bits
    ``(hi - b') << 52`` and the unscale ``2**(E-F)`` the bits ``(b' + lo) << 52``.
    """
    _, _, _, bias, _ = BITS[np.dtype(dtype)]
    f = fraction_bits(n)
    bmin = max(1, f - 1022 + bias - 1)  # E = b - bias + 1 >= F - 1022
    return f + bias + 1022, 1024 - bias - f, bmin


def exponents(dtype: np.dtype[Any], n: int, b: np.ndarray) -> np.ndarray:
    """``E`` for biased exponents ``b`` (step 1 of the module docstring)."""
    _, _, _, bias, _ = BITS[np.dtype(dtype)]
    _, _, bmin = params(np.dtype(dtype), n)
    return np.maximum(b.astype(np.int64), bmin) - bias + 1


def exact_reduce(own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float) -> int:
    """``out = sum(own, *rows) / divisor``, summed exactly (module docstring); the first non-finite output index or -1.

    ``own`` (m,), ``rows`` (k, m), ``out`` (m,) may alias ``own``. The number
    of contributions, which sets ``F``, is ``k + 1``.
    """
    dt = own.dtype
    if rows.shape[0] == 1:  # two contributions: the commutative float64 sum
        with np.errstate(invalid="ignore", over="ignore"):
            out[...] = (own.astype(np.float64) + rows[0].astype(np.float64)) / divisor
        bad = np.flatnonzero(~np.isfinite(out))
        return int(bad[0]) if bad.size else -1
    uint, mask, shift, _, top = BITS[dt]
    n = rows.shape[0] + 1
    f = fraction_bits(n)
    x = np.concatenate([own[None, :], rows]).astype(np.float64)
    mag = (np.concatenate([own[None, :], rows]).view(uint) & uint(mask)).max(axis=0)
    b = mag >> uint(shift)
    e = exponents(dt, n, b)
    special = (b == top) | (mag == 0)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf columns are replaced below
        fixed = np.rint(np.ldexp(x, f - e)).sum(axis=0)  # exact: integers of at most 2**52
        res = np.ldexp(fixed, e - f) / divisor
        if special.any():  # in rank order: NumPy's sum starts from +0.0, which would drop the sign of -0 + -0
            cols = x[:, special]
            total = cols[0]
            for row in cols[1:]:
                total = total + row
            res[special] = total / divisor
        out[...] = res
    bad = np.flatnonzero(~np.isfinite(out))
    return int(bad[0]) if bad.size else -1

"""Numba kernels of the deterministic allreduce: to and from the float64 fixed-point carrier.

``to_fixed`` is ``rint(x * 2**k)`` widened to float64 in one pass (the only
rounding of a contribution); ``from_fixed`` scales back by ``2**-k``,
divides by ``n`` for a mean and stores in the buffer's dtype, also one pass.
``peak`` is ``max |x|`` with NaN propagated. No fastmath: the rounding and
NaN behaviour must be IEEE's on every machine.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=False, parallel=True)
def to_fixed(x, out, scale):
    """``out = rint(x * scale)`` (scale a power of two)."""
    for i in prange(x.shape[0]):
        out[i] = np.rint(np.float64(x[i]) * scale)


@njit(cache=True, fastmath=False, parallel=True)
def from_fixed(fx, out, scale, divisor):
    """``out = (fx * scale) / divisor`` rounded once to ``out``'s dtype (after the float64 division)."""
    for i in prange(fx.shape[0]):
        out[i] = (fx[i] * scale) / divisor


@njit(cache=True, fastmath=False)
def peak(x):
    """max |x|; NaN if any element is NaN."""
    m = 0.0
    for i in range(x.shape[0]):
        a = abs(np.float64(x[i]))
        if not a <= m:  # true for a > m and for NaN
            m = a
            if a != a:
                return a
    return m

"""Numba kernels of the deterministic allreduce: the exact reduction of ``gradcoll.kernels.exact_reference``, fused.

Per element: the largest magnitude's exponent as an integer max over the
contributions' bits; the scale ``2**(F-E)`` built from that exponent's bits
(no table, no libm call); every contribution scaled, rounded to an integer
and summed exactly in float64; scaled back, divided and stored. Rounding to
an integer uses ``(y + 1.5 * 2**52) - 1.5 * 2**52``, which is ``rint`` (round
half to even) for ``|y| < 2**51`` and vectorises, where a call to ``rint``
does not. Work goes in 2,048-element blocks so that each inner loop is a
straight vectorisable line. Two contributions (every call of a 2-rank
group) need no grid at all: their float64 sum is commutative.

Serial on purpose: each rank of a group runs it on its own chunk, and
threads would only compete with the other ranks for the cores. No fastmath:
the rounding trick, the NaN/Inf handling and the float64 rounding must be
IEEE's on every machine, or the bits would differ between ranks.

``recip`` is ``1 / divisor`` when that is a power of two (then multiplying
gives the same bits as dividing, several times faster), else 0.
``limit`` is the smallest float64 magnitude that rounds to an infinity in
the output dtype, so the overflow check needs no read-back of ``out``
(which may alias ``own``: reading it back would stop the vectoriser).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from . import exact_reference, reference

NAME = "numba"

_MAGIC = 6755399441055744.0  # 1.5 * 2**52
_BLOCK = 2048


@intrinsic
def _as_float64(typingctx, bits):
    """The float64 whose bits are the int64 ``bits`` (a reinterpretation, not a conversion)."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return sig, codegen


@njit(cache=True, fastmath=False, nogil=True, inline="always")
def _store(res, o, w, divisor, recip, limit):
    """``o[:w] = res[:w] / divisor`` (a multiplication when exact); the number of stored values that are not finite."""
    bad = 0
    if recip > 0.0:  # two loops, not a select inside one: each stays a straight vector loop
        for j in range(w):
            r = res[j] * recip
            o[j] = r
            bad += not (abs(r) < limit)
    else:
        for j in range(w):
            r = res[j] / divisor
            o[j] = r
            bad += not (abs(r) < limit)
    return bad


@njit(cache=True, fastmath=False, nogil=True)
def reduce_pair(own, row, out, divisor, limit, recip):
    """Two contributions: ``(own + row) / divisor`` in float64; True if some output is not finite.

    IEEE addition is commutative, so two contributions need no grid: the
    float64 sum is the same whichever rank holds which (see
    ``gradcoll.kernels.exact_reference.exact_reduce``).
    """
    m = own.shape[0]
    res = np.empty(_BLOCK, np.float64)  # results go through a private block: ``out`` may be ``own``
    bad = 0
    for i0 in range(0, m, _BLOCK):
        w = min(_BLOCK, m - i0)
        a, b_ = own[i0:i0 + w], row[i0:i0 + w]
        for j in range(w):
            res[j] = np.float64(a[j]) + np.float64(b_[j])
        bad += _store(res, out[i0:i0 + w], w, divisor, recip, limit)
    return bad > 0


@njit(cache=True, fastmath=False, nogil=True)
def reduce_rows(own, rows, own_bits, rows_bits, out, mask, shift, top, hi, lo, bmin, divisor, limit, recip):
    """``own`` plus every row of ``rows``; returns True if some output is not finite."""
    m = own.shape[0]
    k = rows.shape[0]
    mb = np.empty(_BLOCK, own_bits.dtype)
    acc = np.empty(_BLOCK, np.float64)
    plain = np.empty(_BLOCK, np.float64)
    bad = 0
    for i0 in range(0, m, _BLOCK):
        w = min(_BLOCK, m - i0)
        ob = own_bits[i0:i0 + w]
        for j in range(w):
            mb[j] = ob[j] & mask
        for r in range(k):
            rb = rows_bits[r, i0:i0 + w]
            for j in range(w):
                mb[j] = max(mb[j], rb[j] & mask)
        x0 = own[i0:i0 + w]
        for j in range(w):
            sc = _as_float64((hi - max(np.int64(mb[j] >> shift), bmin)) << 52)
            x = np.float64(x0[j])
            acc[j] = (x * sc + _MAGIC) - _MAGIC
            plain[j] = x
        for r in range(k):
            xr = rows[r, i0:i0 + w]
            for j in range(w):
                sc = _as_float64((hi - max(np.int64(mb[j] >> shift), bmin)) << 52)
                x = np.float64(xr[j])
                acc[j] += (x * sc + _MAGIC) - _MAGIC
                plain[j] += x
        for j in range(w):
            b = mb[j] >> shift
            be = max(np.int64(b), bmin)
            acc[j] = plain[j] if (b == top) | (mb[j] == 0) else acc[j] * _as_float64((be + lo) << 52)
        bad += _store(acc, out[i0:i0 + w], w, divisor, recip, limit)
    return bad > 0


#: float64 magnitudes from which a store to the dtype gives an infinity (round half to even at the top).
_LIMIT = {np.dtype(np.float32): 2.0**128 - 2.0**103, np.dtype(np.float64): math.inf}


def exact_reduce(own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float) -> int:
    """``out = (own + sum(rows)) / divisor`` by the exact method; the first non-finite output index, or -1.

    The same bits as ``gradcoll.kernels.exact_reference.exact_reduce`` (same arguments), in one fused pass.
    """
    mode, factor = reference.finish(divisor, np.dtype(np.float64))  # the kernel divides the float64 sum
    tail = (float(divisor), _LIMIT[own.dtype], factor if mode == reference.MUL else 0.0)
    if rows.shape[0] == 1:
        flag = reduce_pair(own, rows[0], out, *tail)
    else:
        uint, mask, shift, _, top = exact_reference.BITS[own.dtype]
        hi, lo, bmin = exact_reference.params(own.dtype, rows.shape[0] + 1)
        flag = reduce_rows(own, rows, own.view(uint), rows.view(uint), out, uint(mask), uint(shift), uint(top),
                           np.int64(hi), np.int64(lo), np.int64(bmin), *tail)
    return int(np.flatnonzero(~np.isfinite(out))[0]) if flag else -1


def warmup() -> None:
    """Compile the float32 and float64 specialisations (two contributions and more, in place and not)."""
    for dt in (np.float32, np.float64):
        x = np.ones((4, 8), dt)
        for k in (1, 3):
            exact_reduce(x[0], x[1:k + 1], np.empty(8, dt), float(k + 1))
            exact_reduce(x[0], x[1:k + 1], x[0], float(k + 1))

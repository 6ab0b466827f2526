"""Numba low-precision kernels: encode, decode, and the fused decode-accumulate (bf16/fp16 transfer formats).

Same bits as ``gradcoll.kernels.lowp_reference`` (the oracle). One pass
per call: ``lowp_accumulate`` widens each received wire value, adds it into the
float32 accumulator, optionally divides, and ORs the exponent bits of the
result for the finite check, block by block like ``gradcoll.kernels.numba_cpu``; no
``fastmath`` (its ``nnan``/``ninf`` flags would delete the check). The
bf16 encode is a pure integer round-to-nearest-even; the fp16 encode is the
branch-light IEEE conversion (exponent rebias plus round-half-even on the
dropped bits, with the subnormal range done by one float32 addition that the
hardware rounds to nearest even). The fp16 decode reads a 65,536-entry table.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .lowp_reference import fp16_table

NAME = "numba"
BLOCK = 4096
PARALLEL_ELEMS = 1 << 16

BF16, FP16 = 0, 1


@njit(cache=True, fastmath=False, inline="always")
def _enc_bf16(u):
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x0040))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, fastmath=False, inline="always")
def _enc_fp16(u):
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # >= 65536, Inf or NaN
        if a > np.uint32(0x7F800000):
            return np.uint16(sign | np.uint32(0x7E00) | ((a & np.uint32(0x007FFFFF)) >> np.uint32(13)))
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # half subnormal (or zero): shift the significand, round half to even
        if a <= np.uint32(0x33000000):
            return np.uint16(sign)
        shift = np.uint32(126) - (a >> np.uint32(23))
        mant = (a & np.uint32(0x007FFFFF)) | np.uint32(0x00800000)
        r = mant >> shift
        rem = mant & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (r & np.uint32(1)) != 0):
            r += np.uint32(1)
        return np.uint16(sign | r)
    odd = (a >> np.uint32(13)) & np.uint32(1)
    a = a - np.uint32(0x38000000) + np.uint32(0xFFF) + odd  # rebias 127 -> 15, round half to even
    return np.uint16(sign | (a >> np.uint32(13)))  # a carry into the exponent gives Inf at 65520


@njit(cache=True, fastmath=False, inline="always")
def _encode_block(u, w, lo, hi, fmt):
    s = u[lo:hi]
    d = w[lo:hi]
    m = np.uint32(0)
    if fmt == BF16:
        for i in range(hi - lo):
            v = _enc_bf16(s[i])
            d[i] = v
            m |= (np.uint32(v) & np.uint32(0x7F80)) + np.uint32(0x0080)
    else:
        for i in range(hi - lo):
            v = _enc_fp16(s[i])
            d[i] = v
            m |= (np.uint32(v) & np.uint32(0x7C00)) + np.uint32(0x0400)
    return (m & np.uint32(0x8000)) == 0


@njit(cache=True, fastmath=False)
def encode_serial(u, w, fmt):
    """float32 bits ``u`` -> wire ``w``; True when every encoded value is finite."""
    ok = True
    for lo in range(0, u.shape[0], BLOCK):
        if not _encode_block(u, w, lo, min(lo + BLOCK, u.shape[0]), fmt):
            ok = False
    return ok


@njit(cache=True, fastmath=False, parallel=True)
def encode_parallel(u, w, fmt):
    """Threaded ``encode_serial`` (same bits)."""
    m = u.shape[0]
    bad = 0
    for b in prange((m + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        if not _encode_block(u, w, lo, min(lo + BLOCK, m), fmt):
            bad += 1
    return bad == 0


@njit(cache=True, fastmath=False, inline="always")
def _acc_block(acc, w, table, tmp, lo, hi, fmt, divisor, dodiv, decode_only):
    # Widen the block into ``tmp`` first (integer stores through a uint32 view,
    # or table reads), then one float loop that LLVM vectorises.
    a = acc[lo:hi]
    x = w[lo:hi]
    k = hi - lo
    t = tmp[:k]
    if fmt == BF16:
        tb = t.view(np.uint32)
        for i in range(k):
            tb[i] = np.uint32(x[i]) << np.uint32(16)
    else:
        for i in range(k):
            t[i] = table[x[i]]
    if decode_only:
        for i in range(k):
            a[i] = t[i]
    else:
        for i in range(k):
            a[i] += t[i]
    if dodiv:
        d = np.float32(divisor)
        for i in range(k):
            a[i] = a[i] / d
    bits = a.view(np.uint32)
    m = np.uint32(0)
    for i in range(k):
        m |= (bits[i] & np.uint32(0x7F800000)) + np.uint32(0x00800000)
    return (m & np.uint32(0x80000000)) == 0


@njit(cache=True, fastmath=False)
def accumulate_serial(acc, w, table, fmt, divisor, dodiv, decode_only):
    """``acc += decode(w)`` (or ``acc = decode(w)``), then divide; True when ``acc`` is finite."""
    ok = True
    tmp = np.empty(BLOCK, np.float32)
    for lo in range(0, acc.shape[0], BLOCK):
        if not _acc_block(acc, w, table, tmp, lo, min(lo + BLOCK, acc.shape[0]), fmt, divisor, dodiv, decode_only):
            ok = False
    return ok


@njit(cache=True, fastmath=False, parallel=True)
def accumulate_parallel(acc, w, table, fmt, divisor, dodiv, decode_only):
    """Threaded ``accumulate_serial`` (same bits)."""
    m = acc.shape[0]
    bad = 0
    for b in prange((m + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        tmp = np.empty(BLOCK, np.float32)
        if not _acc_block(acc, w, table, tmp, lo, min(lo + BLOCK, m), fmt, divisor, dodiv, decode_only):
            bad += 1
    return bad == 0


def _fmt(wire: str) -> int:
    return BF16 if wire == "bf16" else FP16


def lowp_encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst``; True when finite (the check costs nothing extra)."""
    fn = encode_parallel if src.shape[0] >= PARALLEL_ELEMS else encode_serial
    ok = bool(fn(src.view(np.uint32), dst, _fmt(wire)))
    return ok or not check


def lowp_decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` -> float32 ``dst``."""
    fn = accumulate_parallel if dst.shape[0] >= PARALLEL_ELEMS else accumulate_serial
    fn(dst, src, fp16_table(), _fmt(wire), 1.0, False, True)


def lowp_accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """Fused ``acc += decode(x)`` then ``acc /= divisor``, with the finite check."""
    fn = accumulate_parallel if acc.shape[0] >= PARALLEL_ELEMS else accumulate_serial
    dodiv = divisor is not None and divisor != 1
    ok = bool(fn(acc, x, fp16_table(), _fmt(wire), float(divisor) if dodiv else 1.0, dodiv, False))  # type: ignore[arg-type]
    return ok or not check


def warmup() -> None:
    """Compile the serial and threaded specialisations."""
    for m in (8, PARALLEL_ELEMS):
        src = np.ones(m, np.float32)
        w = np.empty(m, np.uint16)
        for wire in ("bf16", "fp16"):
            lowp_encode(src, w, wire, True)
            lowp_decode(w, src, wire)
            lowp_accumulate(src, w, wire, 2, True)

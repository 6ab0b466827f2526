"""Numba low-precision kernels: encode, decode, and the fused decode-accumulate (bf16/fp16 transfer formats).

Same bits as ``gradcoll.kernels.lowp_reference`` (the oracle) and the Cython
kernels (``_fused.h``, the same formulas). One pass per call, the shape of the
loop a user writes, like ``gradcoll.kernels.numba_cpu``: ``lowp_accumulate``
widens each received wire value, adds it into the float32 accumulator,
optionally divides, stores once and counts a non-finite result; ``lowp_encode``
counts encoded values with an all-ones exponent. No ``fastmath`` (its
``nnan``/``ninf`` flags would delete the check). The bf16 encode is an
integer round-to-nearest-even. The fp16 encode computes its three ranges side
by side and selects one, so that the loop has no branch and vectorises:
exponent rebias plus round-half-even on the dropped bits for normal results,
``|x| + 0.5f`` for the subnormal range (the float32 addition rounds to
nearest even at exactly the fp16 subnormal spacing), Inf or the quieted NaN
from 65536 up. The fp16 decode reads a 65,536-entry table.

The checked bf16 encode (``check_finite=True``, the common call) has no NaN
select: it rounds every value as a number and flags the inputs whose
magnitude bits are at least ``0x7F7F8000``, which are exactly those that
encode to an all-ones exponent (Inf, NaN, and the finite values that round up
to Inf): ``(x & 0x7FFFFFFF) + 0x00808000`` OR-ed into a 32-bit flag, whose top
bit that sum sets exactly from there on (a compare would be OR-ed as a packed
vector of booleans, five instructions per 8 values instead of three). A NaN rounded as a number can carry into the sign bit,
so when that count is not zero the encode runs again with the select (the
error path only) and ``dst`` holds the oracle's bits either way. The select
slows the loop markedly (docs/kernels.md), so only the
unchecked encode pays for it.

Where the compiled extension is built, the threaded calls (from
``PARALLEL_ELEMS`` on) run its loops instead (``_fused.h``: F16C for fp16, the
AVX2 bf16 loop), one block per ``prange`` iteration, through the addresses it
exports: Numba has no F16C. The loops above then serve the serial calls of
the ``numba`` backend and every call where the extension is not built.

Each thread takes a contiguous run of blocks (of about ``BLOCK`` elements, as
many for every thread: ``_twins.split``), one per iteration, with
unsigned indices: a flat ``prange`` over the elements, with signed indices
(a negative-index fix-up on every access) and a reduction variable, ran
markedly slower (docs/kernels.md).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numba import carray, cfunc, njit, prange, types

from ._compiled import extension
from ._twins import BLOCK as BLOCK
from ._twins import split
from ._twins import twins as _two
from .lowp_reference import fp16_table
from .reference import DIV, MUL, NONE, finish

NAME = "numba"
PARALLEL_ELEMS = 1 << 16

BF16, FP16 = 0, 1
#: The smallest float32 magnitude (bits) whose bf16 encoding has an all-ones exponent: it rounds up to Inf.
BF16_TOO_BIG = 0x7F7F8000
#: Added to a magnitude (at most 0x7FFFFFFF, no carry out), it sets the top bit exactly from BF16_TOO_BIG on.
TOO_BIG_CARRY = 0x80000000 - BF16_TOO_BIG



@njit(cache=True, fastmath=False, inline="always")
def _round_bf16(u):
    """Round to nearest even on the bits, every input taken as a number (a NaN may carry into the sign)."""
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True, fastmath=False, inline="always")
def _enc_bf16(u):
    q = (u >> np.uint32(16)) | np.uint32(0x0040)  # NaN: keep sign and top payload, quiet it
    return np.uint32(q if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else _round_bf16(u))


@njit(cache=True, fastmath=False, inline="always")
def _enc_fp16(u):
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    nrm = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    sub = np.float32(np.uint32(a).view(np.float32) + np.float32(0.5)).view(np.uint32) - np.uint32(0x3F000000)
    big = np.uint32(0x7C00) | (np.uint32(0x0200) | ((a & np.uint32(0x007FFFFF)) >> np.uint32(13))
                               if a > np.uint32(0x7F800000) else np.uint32(0))
    r = sub if a < np.uint32(0x38800000) else nrm
    return np.uint32(sign | (big if a >= np.uint32(0x47800000) else r))


def _encode(u, w, fmt):
    """float32 bits ``u`` -> wire ``w``; the number of blocks holding an encoded Inf/NaN."""
    m = u.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))  # unsigned: no negative-index fix-up
        flag = False
        if fmt == BF16:
            for i in range(lo, hi):
                v = _enc_bf16(u[i])
                w[i] = np.uint16(v)
                flag |= (v & np.uint32(0x7F80)) == np.uint32(0x7F80)
        else:
            for i in range(lo, hi):
                v = _enc_fp16(u[i])
                w[i] = np.uint16(v)
                flag |= (v & np.uint32(0x7C00)) == np.uint32(0x7C00)
        bad += flag
    return bad


def _encode_bf16_checked(u, w):
    """bf16 encode without the NaN select; the number of blocks holding an input that encodes to Inf/NaN."""
    m = u.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))
        flag = np.uint32(0)
        for i in range(lo, hi):
            x = u[i]
            w[i] = np.uint16(_round_bf16(x))
            # top bit: |x| >= BF16_TOO_BIG; cast back each time (Numba widens uint32 arithmetic to 64 bits)
            flag = np.uint32(flag | ((x & np.uint32(0x7FFFFFFF)) + np.uint32(TOO_BIG_CARRY)))
        bad += flag >> np.uint32(31)
    return bad


def _accumulate(acc, w, table, fmt, f, mode, decode_only):
    """``acc = finish(acc + decode(w))`` (``acc = decode(w)`` with ``decode_only``); the non-finite block count."""
    m = acc.shape[0]
    big = np.float32(np.finfo(np.float32).max)
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))
        flag = False
        if fmt == BF16:
            for i in range(lo, hi):
                x = np.uint32(np.uint32(w[i]) << np.uint32(16)).view(np.float32)
                s = x if decode_only else acc[i] + x
                if mode == MUL:
                    s = s * f
                elif mode == DIV:
                    s = s / f
                acc[i] = s
                flag |= not (abs(s) <= big)
        else:
            for i in range(lo, hi):
                x = table[w[i]]
                s = x if decode_only else acc[i] + x
                if mode == MUL:
                    s = s * f
                elif mode == DIV:
                    s = s / f
                acc[i] = s
                flag |= not (abs(s) <= big)
        bad += flag
    return bad


# -- the compiled loops, threaded: Numba has no F16C, and its bf16 encode spends more instructions ----------

def _native_loops() -> tuple[Any, ...] | None:
    """The extension's encode and accumulate loops (``_fused.h``) as ctypes functions, or None."""
    ext = extension()
    if ext is None or not hasattr(ext, "kernel_addresses"):
        return None
    addr = ext.kernel_addresses()
    vp, n, i, f = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_float
    enc = ctypes.CFUNCTYPE(i, vp, vp, n)
    return (enc(addr["encode_bf16"]), enc(addr["encode_fp16"]),
            ctypes.CFUNCTYPE(i, vp, vp, n, f, i, i)(addr["acc_bf16"]),
            ctypes.CFUNCTYPE(i, vp, vp, vp, n, f, i, i)(addr["acc_fp16"]))


_NATIVE = _native_loops()
if _NATIVE is not None:
    _ENC_BF16, _ENC_FP16, _ACC_BF16, _ACC_FP16 = _NATIVE

    # Not cached on disk: the loops' addresses are constants in the machine code and differ in every process.
    @njit(fastmath=False, nogil=True, parallel=True)
    def encode_native(u, w, fmt):
        """The compiled encode, one block (``_twins.split``) per iteration; the non-finite block count."""
        m = u.shape[0]
        bad = 0
        nb, blk = split(m)
        for b in prange(nb):
            lo, hi = min(m, b * blk), min(m, b * blk + blk)
            if hi <= lo:  # one of the last blocks, empty
                continue
            if fmt == FP16:
                bad += 1 - _ENC_FP16(u[lo:hi].ctypes, w[lo:hi].ctypes, hi - lo)
            else:
                bad += 1 - _ENC_BF16(u[lo:hi].ctypes, w[lo:hi].ctypes, hi - lo)
        return bad

    @njit(fastmath=False, nogil=True, parallel=True)
    def accumulate_native(acc, w, table, fmt, f, mode, decode_only):
        """The compiled accumulate (decode with ``decode_only``), block by block; the non-finite block count."""
        m = acc.shape[0]
        md, dec = np.int32(mode), np.int32(decode_only)
        bad = 0
        nb, blk = split(m)
        for b in prange(nb):
            lo, hi = min(m, b * blk), min(m, b * blk + blk)
            if hi <= lo:
                continue
            if fmt == FP16:
                bad += 1 - _ACC_FP16(acc[lo:hi].ctypes, w[lo:hi].ctypes, table.ctypes, hi - lo, f, md, dec)
            else:
                bad += 1 - _ACC_BF16(acc[lo:hi].ctypes, w[lo:hi].ctypes, hi - lo, f, md, dec)
        return bad


    # The same kernels as C functions, which the extension's fast entries call with no Python in between
    # (docs/kernels.md, "The threaded kernels without Python"): compiled on the first request, not cached
    # either.
    def _enc_bf16_entry(u, w, m):
        return encode_native(carray(u, m), carray(w, m), BF16)

    def _enc_fp16_entry(u, w, m):
        return encode_native(carray(u, m), carray(w, m), FP16)

    def _acc_bf16_entry(acc, w, table, m, f, mode):
        return accumulate_native(carray(acc, m), carray(w, m), carray(table, 1 << 16), BF16, f, mode, False)

    def _acc_fp16_entry(acc, w, table, m, f, mode):
        return accumulate_native(carray(acc, m), carray(w, m), carray(table, 1 << 16), FP16, f, mode, False)

    _F32, _U16, _U32 = types.CPointer(types.float32), types.CPointer(types.uint16), types.CPointer(types.uint32)
    _ENTRY_SPECS = {
        "encode_bf16": (types.int64(_U32, _U16, types.int64), _enc_bf16_entry),
        "encode_fp16": (types.int64(_U32, _U16, types.int64), _enc_fp16_entry),
        "accumulate_bf16": (types.int64(_F32, _U16, _F32, types.int64, types.float32, types.int64), _acc_bf16_entry),
        "accumulate_fp16": (types.int64(_F32, _U16, _F32, types.int64, types.float32, types.int64), _acc_fp16_entry),
    }

_ENTRIES: dict[str, Any] = {}
#: ``set_threaded_entry(name, address)`` of the extension (set by ``select``), and the names handed to it.
_register_entry: Any = None
_REGISTERED_NAMES: set[str] = set()


def entry(name: str) -> int:
    """The address of a threaded kernel as a C function: ``encode_bf16``/``encode_fp16`` (``int64 f(uint32* u,
    uint16* w, int64 m)``), ``accumulate_bf16``/``accumulate_fp16`` (``int64 f(float* acc, uint16* w, float*
    table, int64 m, float factor, int64 mode)``), each returning the blocks holding a non-finite value."""
    if _NATIVE is None:
        raise LookupError("the threaded low-precision entries need the compiled extension")
    c = _ENTRIES.get(name)
    if c is None:
        sig, body = _ENTRY_SPECS[name]
        c = _ENTRIES[name] = cfunc(sig, nogil=True)(body)
    return int(c.address)


def _hand_over(name: str) -> None:
    """Give the extension the C entry of ``name`` after its first threaded call through Python."""
    if _register_entry is not None and name not in _REGISTERED_NAMES:
        _REGISTERED_NAMES.add(name)
        _register_entry(name, entry(name))


encode_serial, encode_parallel = _two(_encode)
bf16_checked_serial, bf16_checked_parallel = _two(_encode_bf16_checked)
accumulate_serial, accumulate_parallel = _two(_accumulate)


def _fmt(wire: str) -> int:
    return BF16 if wire == "bf16" else FP16


def lowp_encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst``; True when finite (or unchecked)."""
    par = src.shape[0] >= PARALLEL_ELEMS
    u = src.view(np.uint32)
    if par and _NATIVE is not None:
        ok = encode_native(u, dst, _fmt(wire)) == 0 or not check
        _hand_over("encode_" + wire)
        return ok
    if check and wire == "bf16":
        if (bf16_checked_parallel if par else bf16_checked_serial)(u, dst) == 0:
            return True  # no NaN among the inputs: the select would have changed nothing
        # error path: encode again with the select, so that dst holds the oracle's bits (quieted NaNs)
    fn = encode_parallel if par else encode_serial
    return fn(u, dst, _fmt(wire)) == 0 or not check


def lowp_decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` -> float32 ``dst``."""
    par = dst.shape[0] >= PARALLEL_ELEMS
    if par and _NATIVE is not None:
        accumulate_native(dst, src, fp16_table(), _fmt(wire), np.float32(1.0), NONE, True)
        return
    fn = accumulate_parallel if par else accumulate_serial
    fn(dst, src, fp16_table(), _fmt(wire), np.float32(1.0), NONE, True)


def lowp_accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """Fused ``acc += decode(x)`` then ``acc /= divisor``, with the finite check."""
    par = acc.shape[0] >= PARALLEL_ELEMS
    mode, f = finish(divisor, np.dtype(np.float32))
    if par and _NATIVE is not None:
        ok = accumulate_native(acc, x, fp16_table(), _fmt(wire), np.float32(f), mode, False) == 0 or not check
        _hand_over("accumulate_" + wire)
        return ok
    fn = accumulate_parallel if par else accumulate_serial
    return fn(acc, x, fp16_table(), _fmt(wire), np.float32(f), mode, False) == 0 or not check


def warmup() -> None:
    """Compile the serial and threaded specialisations."""
    for m in (8, PARALLEL_ELEMS):
        src = np.ones(m, np.float32)
        w = np.empty(m, np.uint16)
        for wire in ("bf16", "fp16"):
            lowp_encode(src, w, wire, True)
            lowp_encode(src, w, wire, False)
            par = m >= PARALLEL_ELEMS  # the Numba loops too, where the compiled ones serve the threaded calls
            (encode_parallel if par else encode_serial)(src.view(np.uint32), w, _fmt(wire))
            (bf16_checked_parallel if par else bf16_checked_serial)(src.view(np.uint32), w)
            (accumulate_parallel if par else accumulate_serial)(src, w, fp16_table(), _fmt(wire), np.float32(1.0),
                                                                NONE, False)
            lowp_decode(w, src, wire)
            lowp_accumulate(src, w, wire, 2, True)

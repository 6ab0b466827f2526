"""The ``numba`` backend: JIT-compiled CPU kernels, threaded for large buffers.

Kernels are plain ``@njit`` functions compiled lazily on first use (or by
``warmup``) and cached on disk (``cache=True``). They never use
``fastmath``: its ``nnan``/``ninf`` flags let LLVM assume that no NaN or Inf
exists and delete the finite check.

Memory is walked in blocks of ``BLOCK`` elements. For one block, the
contributions are added in order 0..n-1 into the output (the block stays in
L1/L2 between passes, so DRAM sees each input once and the output once), the
block is divided, and its exponent bits are OR-ed together: a branch-free
integer reduction that LLVM vectorises without fastmath, tested once per
block. Threads split the blocks; the order of additions for any element is the
same whatever the thread count, so results are bit-identical to the serial
kernel, the Cython kernels and the NumPy reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit, prange

from . import reference

NAME = "numba"

#: Elements per block: 4096 float32 = 16 KiB of output per block (L1-resident).
BLOCK = 4096
#: From this many output elements on, the threaded kernels are used (measured).
PARALLEL_ELEMS = 1 << 16

_M32 = np.uint32(0x7F800000)
_C32 = np.uint32(0x00800000)
_T32 = np.uint32(0x80000000)
_M64 = np.uint64(0x7FF0000000000000)
_C64 = np.uint64(0x0010000000000000)
_T64 = np.uint64(0x8000000000000000)


@njit(cache=True, fastmath=False, inline="always")
def _finite(o):
    """True when ``o`` (a block) holds no NaN/Inf: exponent-bit OR, no branch per element."""
    if o.itemsize == 4:
        b = o.view(np.uint32)
        m = np.uint32(0)
        for i in range(b.shape[0]):
            m |= (b[i] & _M32) + _C32
        return (m & _T32) == 0
    else:
        b = o.view(np.uint64)
        m = np.uint64(0)
        for i in range(b.shape[0]):
            m |= (b[i] & _M64) + _C64
        return (m & _T64) == 0


@njit(cache=True, fastmath=False, inline="always")
def _block_finite(out, lo, hi):
    return _finite(out[lo:hi])


# The block bodies index 1-D slices with 0-based counters: plain ``out[i]``
# over ``range(lo, hi)`` on the full arrays keeps bounds/wraparound logic in
# the loop and LLVM then refuses to vectorise it (measured 4x slower).
@njit(cache=True, fastmath=False, inline="always")
def _reduce_block(x, out, lo, hi, divisor, dodiv):
    n = x.shape[0]
    o = out[lo:hi]
    k = hi - lo
    x0 = x[0, lo:hi]
    for i in range(k):
        o[i] = x0[i]
    for j in range(1, n):
        xj = x[j, lo:hi]
        for i in range(k):
            o[i] += xj[i]
    if dodiv:
        d = o.dtype.type(divisor)
        for i in range(k):
            o[i] = o[i] / d


@njit(cache=True, fastmath=False, inline="always")
def _reduce_block_t(xs, out, lo, hi, divisor, dodiv):
    n = len(xs)
    o = out[lo:hi]
    k = hi - lo
    x0 = xs[0][lo:hi]
    for i in range(k):
        o[i] = x0[i]
    for j in range(1, n):
        xj = xs[j][lo:hi]
        for i in range(k):
            o[i] += xj[i]
    if dodiv:
        d = o.dtype.type(divisor)
        for i in range(k):
            o[i] = o[i] / d


@njit(cache=True, fastmath=False)
def reduce2d_serial(x, out, divisor, dodiv, check):
    """Serial fixed-order reduce of the rows of 2-D ``x`` into ``out``; True when finite."""
    m = out.shape[0]
    ok = True
    for lo in range(0, m, BLOCK):
        hi = min(lo + BLOCK, m)
        _reduce_block(x, out, lo, hi, divisor, dodiv)
        if check and not _block_finite(out, lo, hi):
            ok = False
    return ok


@njit(cache=True, fastmath=False, parallel=True)
def reduce2d_parallel(x, out, divisor, dodiv, check):
    """Threaded version of ``reduce2d_serial`` (same bits)."""
    m = out.shape[0]
    nblocks = (m + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, m)
        _reduce_block(x, out, lo, hi, divisor, dodiv)
        if check and not _block_finite(out, lo, hi):
            bad += 1
    return bad == 0


@njit(cache=True, fastmath=False)
def reduce_tuple_serial(xs, out, divisor, dodiv, check):
    """Serial fixed-order reduce of a tuple of 1-D arrays into ``out``."""
    m = out.shape[0]
    ok = True
    for lo in range(0, m, BLOCK):
        hi = min(lo + BLOCK, m)
        _reduce_block_t(xs, out, lo, hi, divisor, dodiv)
        if check and not _block_finite(out, lo, hi):
            ok = False
    return ok


@njit(cache=True, fastmath=False, parallel=True)
def reduce_tuple_parallel(xs, out, divisor, dodiv, check):
    """Threaded version of ``reduce_tuple_serial`` (same bits)."""
    m = out.shape[0]
    nblocks = (m + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, m)
        _reduce_block_t(xs, out, lo, hi, divisor, dodiv)
        if check and not _block_finite(out, lo, hi):
            bad += 1
    return bad == 0


@njit(cache=True, fastmath=False, inline="always")
def _acc_block(acc, x, lo, hi, scale, doscale, divisor, dodiv):
    a = acc[lo:hi]
    b = x[lo:hi]
    k = hi - lo
    for i in range(k):
        a[i] += b[i]
    if dodiv:
        d = a.dtype.type(divisor)
        for i in range(k):
            a[i] = a[i] / d
    if doscale:
        s = a.dtype.type(scale)
        for i in range(k):
            a[i] = a[i] * s


@njit(cache=True, fastmath=False)
def accumulate_serial(acc, x, scale, doscale, divisor, dodiv, check):
    """In place ``acc += x`` (then divide/scale) with the block finite check."""
    m = acc.shape[0]
    ok = True
    for lo in range(0, m, BLOCK):
        hi = min(lo + BLOCK, m)
        _acc_block(acc, x, lo, hi, scale, doscale, divisor, dodiv)
        if check and not _block_finite(acc, lo, hi):
            ok = False
    return ok


@njit(cache=True, fastmath=False, parallel=True)
def accumulate_parallel(acc, x, scale, doscale, divisor, dodiv, check):
    """Threaded version of ``accumulate_serial``."""
    m = acc.shape[0]
    nblocks = (m + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, m)
        _acc_block(acc, x, lo, hi, scale, doscale, divisor, dodiv)
        if check and not _block_finite(acc, lo, hi):
            bad += 1
    return bad == 0


@njit(cache=True, fastmath=False)
def finite_serial(buf):
    """True when every element of ``buf`` is finite."""
    m = buf.shape[0]
    for lo in range(0, m, BLOCK):
        if not _block_finite(buf, lo, min(lo + BLOCK, m)):
            return False
    return True


@njit(cache=True, fastmath=False, parallel=True)
def finite_parallel(buf):
    """Threaded ``finite_serial``."""
    m = buf.shape[0]
    nblocks = (m + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        if not _block_finite(buf, lo, min(lo + BLOCK, m)):
            bad += 1
    return bad == 0


@njit(cache=True, fastmath=False, parallel=True)
def scale_parallel(buf, factor):
    """Threaded in-place multiply."""
    f = buf.dtype.type(factor)
    for i in prange(buf.shape[0]):
        buf[i] = buf[i] * f


#: Tuples longer than this are stacked instead (one specialisation per length).
MAX_TUPLE = 16


def reduce_rows(rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool) -> bool:
    """Fixed-order reduce of ``rows`` (2-D array or list of 1-D arrays) into ``out``."""
    par = out.shape[0] >= PARALLEL_ELEMS
    dodiv = divisor != 1
    target = reference.accumulator(out, acc_dtype)
    if isinstance(rows, np.ndarray):
        fn = reduce2d_parallel if par else reduce2d_serial
        ok = fn(rows, target, float(divisor), dodiv, check)
    elif len(rows) <= MAX_TUPLE:
        fn = reduce_tuple_parallel if par else reduce_tuple_serial
        ok = fn(tuple(rows), target, float(divisor), dodiv, check)
    else:
        fn = reduce2d_parallel if par else reduce2d_serial
        ok = fn(np.stack(rows), target, float(divisor), dodiv, check)
    return reference.store(out, target, ok, check)


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """In place ``acc += x`` with optional divide/scale; True when finite."""
    fn = accumulate_parallel if acc.shape[0] >= PARALLEL_ELEMS else accumulate_serial
    doscale = scale is not None
    dodiv = divisor is not None and divisor != 1
    factor = float(scale) if scale is not None else 1.0
    div = float(divisor) if divisor is not None and dodiv else 1.0
    return bool(fn(acc, x, factor, doscale, div, dodiv, check))


def is_all_finite(buf: np.ndarray) -> bool:
    """True when every element is finite."""
    return bool(finite_parallel(buf) if buf.shape[0] >= PARALLEL_ELEMS else finite_serial(buf))


def scale(buf: np.ndarray, factor: float) -> None:
    """In-place ``buf *= factor``."""
    scale_parallel(buf, float(factor))


def warmup() -> None:
    """Compile the common specialisations (float32/float64, 2-D and 2-8 tuples, serial and threaded),
    and those of the low-precision and exact kernels."""
    for dt in (np.float32, np.float64):
        for m in (8, PARALLEL_ELEMS):
            x = np.ones((2, m), dt)
            out = np.empty(m, dt)
            reduce_rows(x, out, np.dtype(dt), 2, True)
            for n in (2, 3, 4, 8):
                reduce_rows([x[0]] * n, out, np.dtype(dt), n, True)
            accumulate(out, x[0], None, 2, True)
            is_all_finite(out)
            scale(out, 1.0)
        reduce_rows(np.ones((2, 8), np.float32), np.empty(8, np.float64), np.dtype(np.float64), 2, True)
    from . import numba_exact, numba_lowp  # the low-precision and exact kernels are Numba's too

    numba_lowp.warmup()
    numba_exact.warmup()

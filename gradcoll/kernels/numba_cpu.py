"""The ``numba`` backend: JIT-compiled CPU kernels, threaded for large buffers.

Kernels are plain ``@njit`` functions compiled lazily on first use (or by
``warmup``) and cached on disk (``cache=True``). Each body is written once and
compiled twice (``_twins``: each cached apart), serial and ``parallel=True``: ``prange`` is ``range`` in the
serial one. The ``prange`` runs over blocks of equal size whose number is a multiple of the
threads' (``_twins.split``), and Numba gives each thread one contiguous run of them,
so the additions for any element are the same whatever the thread count.

One pass, the shape of the loop a user writes (docs/kernels.md, "Why the
kernels were slow"): for each element, the inputs of a tuple of 1-D arrays are
summed in registers in order 0..n-1, the sum is divided (or multiplied by the
reciprocal when that is exact: a power of two, the same bits) and stored once.
The finite check is ``not (abs(s) <= big)``, ``big`` the largest finite value:
one ordered comparison, False for NaN and for both infinities, counted into
an integer. It vectorises without ``fastmath``, which is never used: its
``nnan``/``ninf`` flags would let LLVM delete exactly this test, and no other
flag is safe either (``reassoc`` reorders the sum, ``contract`` fuses
multiply-adds, ``arcp`` turns the division into a multiplication, ``nsz``
may flip the sign of a zero).

At most ``GROUP`` inputs go into one pass: LLVM vectorises a loop only after
proving, at run time, that the output overlaps no input, and it gives up
beyond 8 such checks. More inputs are added in further passes that read the
running sum back from the output (the same order of additions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, cfunc, njit, prange, types

from . import reference
from ._compiled import extension
from ._native import accumulate_native
from ._twins import BLOCK as BLOCK
from ._twins import THREADS as THREADS
from ._twins import split
from ._twins import twins as _two
from .reference import DIV, MUL, NONE, finish

NAME = "numba"

#: From this many output elements on, the threaded kernels are used (measured).
PARALLEL_ELEMS = 1 << 16
#: Inputs summed in one pass (LLVM's limit on run-time alias checks, module docstring).
GROUP = 8
def _sum(xs, out, f, mode, big):
    """out = finish(xs[0] + ... + xs[n-1]); the number of blocks holding a non-finite result."""
    n = len(xs)
    m = out.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))  # unsigned: no negative-index fix-up
        flag = False
        for i in range(lo, hi):
            s = out.dtype.type(xs[0][i])
            for j in range(1, n):
                s += xs[j][i]
            if mode == MUL:
                s = s * f
            elif mode == DIV:
                s = s / f
            out[i] = s
            flag |= not (abs(s) <= big)
        bad += flag
    return bad


def _sum_into(xs, out, f, mode, big):
    """out = finish(out + xs[0] + ... + xs[n-1]): a further pass over more inputs."""
    n = len(xs)
    m = out.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))
        flag = False
        for i in range(lo, hi):
            s = out[i]
            for j in range(n):
                s += xs[j][i]
            if mode == MUL:
                s = s * f
            elif mode == DIV:
                s = s / f
            out[i] = s
            flag |= not (abs(s) <= big)
        bad += flag
    return bad


def _accumulate(acc, x, f, mode, sc, doscale, big):
    """acc = scale(finish(acc + x)); the number of blocks holding a non-finite result."""
    m = acc.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))
        flag = False
        for i in range(lo, hi):
            s = acc[i] + x[i]
            if mode == MUL:
                s = s * f
            elif mode == DIV:
                s = s / f
            if doscale:
                s = s * sc
            acc[i] = s
            flag |= not (abs(s) <= big)
        bad += flag
    return bad


def _count_nonfinite(buf, big):
    m = buf.shape[0]
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        flag = False
        for i in range(np.uint64(min(m, b * blk)), np.uint64(min(m, b * blk + blk))):
            flag |= not (abs(buf[i]) <= big)
        bad += flag
    return bad


sum_serial, sum_parallel = _two(_sum)
sum_into_serial, sum_into_parallel = _two(_sum_into)
accumulate_serial, accumulate_parallel = _two(_accumulate)
finite_serial, finite_parallel = _two(_count_nonfinite)


@njit(cache=True, fastmath=False, parallel=True)
def scale_parallel(buf, factor):
    """Threaded in-place multiply."""
    f = buf.dtype.type(factor)
    for i in prange(buf.shape[0]):
        buf[i] = buf[i] * f


_BIG: dict[np.dtype, Any] = {}


def _big(dtype: np.dtype) -> Any:
    """The largest finite value of ``dtype``: ``abs(s) <= big`` is False exactly for NaN and the infinities.

    Remembered per dtype: a call of ``np.finfo`` costs as much as the kernel on a small array."""
    big = _BIG.get(dtype)
    if big is None:
        big = _BIG[dtype] = dtype.type(np.finfo(dtype).max)
    return big


def _tuples(rows: Sequence[np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """The inputs in passes of at most GROUP (the first) and GROUP - 1 (the rest: the output is read too)."""
    if not all(r.flags.writeable for r in rows):  # one array type for the tuple: all read-only views
        rows = [_readonly(r) for r in rows]
    out = [tuple(rows[:GROUP])]
    out += [tuple(rows[lo:lo + GROUP - 1]) for lo in range(GROUP, len(rows), GROUP - 1)]
    return out


def _readonly(a: np.ndarray) -> np.ndarray:
    v: np.ndarray = a.view()
    v.flags.writeable = False
    return v


def reduce_rows(rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype, divisor: float,
                check: bool) -> bool:
    """Fixed-order reduce of ``rows`` (2-D array or list of 1-D arrays) into ``out``."""
    target = reference.accumulator(out, acc_dtype)
    mode, f = finish(divisor, target.dtype)
    fac, big = target.dtype.type(f), _big(target.dtype)
    par = _parallel(target.shape[0], len(rows))
    passes = _tuples(list(rows))
    bad = 0
    for k, xs in enumerate(passes):
        fn = (sum_parallel if par else sum_serial) if k == 0 else (sum_into_parallel if par else sum_into_serial)
        bad = fn(xs, target, fac, mode if k == len(passes) - 1 else NONE, big)  # a NaN of a pass reaches the last
    return reference.store(out, target, bad == 0 or not check, check)


_PLAIN: dict[tuple[np.dtype, float], tuple[Any, int, Any]] = {}


def reduce_plain(xs: tuple[np.ndarray, ...], out: np.ndarray, divisor: float, check: bool) -> bool:
    """``reduce_rows`` of a call the extension validated (its fast entry above its limit): at most ``GROUP``
    writeable 1-D arrays of ``out``'s dtype and size. The factor, mode and bound are remembered per dtype and
    divisor: what runs between two large calls runs with a cold cache, so it is kept short."""
    key = (out.dtype, divisor)
    p = _PLAIN.get(key)
    if p is None:
        mode, f = finish(divisor, out.dtype)
        p = _PLAIN[key] = (out.dtype.type(f), mode, _big(out.dtype))
    par = _parallel(out.shape[0], len(xs))
    ok = (sum_parallel if par else sum_serial)(xs, out, p[0], p[1], p[2]) == 0 or not check
    if par and _register is not None and (out.dtype, len(xs)) not in _REGISTERED:
        _REGISTERED.add((out.dtype, len(xs)))  # the extension runs the entry itself from its next such call
        _register(out.dtype == np.float64, len(xs), reduce_entry(out.dtype, len(xs)))
    return ok


#: ``set_threaded_reduce(double, n, address)`` of the extension where it takes the entries (set by ``select``),
#: and the (dtype, count) pairs handed to it.
_register: Any = None
_REGISTERED: set[tuple[np.dtype, int]] = set()
#: ``set_threaded_entry(name, address)`` of the extension (set by ``select``), and the names handed to it.
_register_entry: Any = None
_REGISTERED_NAMES: set[str] = set()


# -- the threaded reduce as C entry points (the extension calls them with no Python in between) ----------------
# Above its limit the extension's fast entry called ``reduce_plain`` through Python: a tuple, this module's
# frame, Numba's dispatcher typing the tuple: a sizeable share of a mid-sized call
# (docs/kernels.md, "The threaded kernels without Python"). Each entry is a ``cfunc`` for one count of inputs,
# ``int64 entry(T** xs, T* out, int64 m, T f, int64 mode, T big)``, that calls ``sum_parallel`` (the same
# compiled kernel, so the same bits) on arrays over the pointers. Written out per count: the tuple's length is
# what makes Numba unroll the loop over the inputs. Compiled on first use and cached on disk.

def _e1(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m),), carray(o, m), f, mode, big)


def _e2(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m)), carray(o, m), f, mode, big)


def _e3(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m)), carray(o, m), f, mode, big)


def _e4(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m), carray(p[3], m)), carray(o, m),
                        f, mode, big)


def _e5(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m), carray(p[3], m), carray(p[4], m)),
                        carray(o, m), f, mode, big)


def _e6(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m), carray(p[3], m), carray(p[4], m),
                         carray(p[5], m)), carray(o, m), f, mode, big)


def _e7(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m), carray(p[3], m), carray(p[4], m),
                         carray(p[5], m), carray(p[6], m)), carray(o, m), f, mode, big)


def _e8(p, o, m, f, mode, big):
    return sum_parallel((carray(p[0], m), carray(p[1], m), carray(p[2], m), carray(p[3], m), carray(p[4], m),
                         carray(p[5], m), carray(p[6], m), carray(p[7], m)), carray(o, m), f, mode, big)


def _acc_entry(a, x, m, f, mode, sc, doscale, big, loop):
    if loop != 0:  # the extension's own loop, block by block (``_native``)
        return accumulate_native(loop, carray(a, m), carray(x, m), f, mode, sc, doscale != 0)
    return accumulate_parallel(carray(a, m), carray(x, m), f, mode, sc, doscale != 0, big)


_ENTRY_BODIES = (_e1, _e2, _e3, _e4, _e5, _e6, _e7, _e8)
assert len(_ENTRY_BODIES) == GROUP
_ENTRIES: dict[tuple[np.dtype, int], Any] = {}


def reduce_entry(dtype: np.dtype, n: int) -> int:
    """The address of the threaded reduce of ``n`` (1 to ``GROUP``) inputs of ``dtype`` (float32 or float64)
    as a C function (above); compiled, or loaded from the disk cache, on the first request."""
    key = (np.dtype(dtype), n)
    c = _ENTRIES.get(key)
    if c is None:
        t = types.float64 if key[0] == np.float64 else types.float32
        sig = types.int64(types.CPointer(types.CPointer(t)), types.CPointer(t), types.int64, t, types.int64, t)
        c = _ENTRIES[key] = cfunc(sig, cache=True, nogil=True)(_ENTRY_BODIES[n - 1])
    return int(c.address)


def accumulate_entry(dtype: np.dtype) -> int:
    """The address of the threaded accumulate of ``dtype`` as a C function, ``int64 f(T* acc, T* x, int64 m,
    T factor, int64 mode, T scale, int64 doscale, T big, int64 loop)``: the blocks holding a non-finite result.
    ``loop`` is the address of the extension's loop to run on each block (``_native``), or 0 for Numba's."""
    key = (np.dtype(dtype), 0)
    c = _ENTRIES.get(key)
    if c is None:
        t = types.float64 if key[0] == np.float64 else types.float32
        p = types.CPointer(t)
        sig = types.int64(p, p, types.int64, t, types.int64, t, types.int64, t, types.int64)
        c = _ENTRIES[key] = cfunc(sig, cache=True, nogil=True)(_acc_entry)
    return int(c.address)


def _parallel(m: int, n: int) -> bool:
    """Threads for a reduce of ``n`` inputs into ``m`` outputs: from ``PARALLEL_ELEMS`` outputs for 2 inputs,
    by the bytes moved for more (``(n + 1) / 3`` times as many per output)."""
    return m * (n + 1) >= 3 * PARALLEL_ELEMS


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """In place ``acc += x`` with optional divide/scale; True when finite."""
    mode, f = finish(divisor, acc.dtype)
    t = acc.dtype.type
    par = acc.shape[0] >= PARALLEL_ELEMS
    sc = t(scale if scale is not None else 1.0)
    loop = _native_loop(acc.dtype) if par and acc.flags.c_contiguous and x.flags.c_contiguous else 0
    if loop:
        bad = accumulate_native(loop, acc, x, t(f), mode, sc, scale is not None)
    else:
        fn = accumulate_parallel if par else accumulate_serial
        bad = fn(acc, x, t(f), mode, sc, scale is not None, _big(acc.dtype))
    name = "accumulate_f64" if acc.dtype == np.float64 else "accumulate_f32"
    if par and _register_entry is not None and name not in _REGISTERED_NAMES:
        _REGISTERED_NAMES.add(name)
        _register_entry(name, accumulate_entry(acc.dtype))
    return bad == 0 or not check


_LOOPS: dict[np.dtype, int] = {}


def _native_loop(dtype: np.dtype) -> int:
    """The address of the extension's accumulate loop for ``dtype`` (``_native``), or 0 without the extension."""
    loop = _LOOPS.get(dtype)
    if loop is None:
        ext = extension()
        addr = ext.kernel_addresses() if ext is not None and hasattr(ext, "kernel_addresses") else {}
        loop = _LOOPS[dtype] = int(addr.get("acc_f64" if dtype == np.float64 else "acc_f32", 0))
    return loop


def is_all_finite(buf: np.ndarray) -> bool:
    """True when every element is finite."""
    fn = finite_parallel if buf.shape[0] >= PARALLEL_ELEMS else finite_serial
    return bool(fn(buf, _big(buf.dtype)) == 0)


def scale(buf: np.ndarray, factor: float) -> None:
    """In-place ``buf *= factor``."""
    scale_parallel(buf, float(factor))


def warmup() -> None:
    """Compile the common specialisations (float32/float64, 2-D and 2-8 inputs, serial and threaded),
    and those of the low-precision and exact kernels."""
    for dt in (np.float32, np.float64):
        for m in (8, PARALLEL_ELEMS):
            x = np.ones((2, m), dt)
            out = np.empty(m, dt)
            for n in (2, 3, 4, 8, 9):
                reduce_rows([x[0]] * n, out, np.dtype(dt), n, True)
            accumulate(out, x[0], None, 2, True)
            accumulate(out, x[0], 0.5, None, True)
            accumulate(out[::1], x[0][::-1], None, 2, True)  # not contiguous: Numba's own loop, not the C one
            is_all_finite(out)
            scale(out, 1.0)
        reduce_rows(np.ones((2, 8), np.float32), np.empty(8, np.float64), np.dtype(np.float64), 2, True)
    from . import numba_exact, numba_lowp  # the low-precision and exact kernels are Numba's too

    numba_lowp.warmup()
    numba_exact.warmup()

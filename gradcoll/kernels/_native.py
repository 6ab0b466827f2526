"""The threaded accumulate over the compiled extension's loop: Numba's threads, the C loop (``_fused.h``) on
each block.

Numba's own accumulate checks every result with ``not (abs(s) <= big)``: a mask and a compare per vector,
counted into the block's flag. The C loop checks two result vectors at once (``t = s0 + s1``, then the bits
of ``t - t``, which are zero unless a lane is an Inf or a NaN or the sum of the two overflowed, where it
rescans what it wrote), so it costs less than Numba's check and comes close to the loop without a check
(docs/kernels.md, "Aligned stores and a cheaper check").

The C loop's address is an argument, not a constant of the compiled code, so the kernel is cached on disk
like every other; ``call_acc`` calls it through a pointer made from that integer. Same bits as
``numba_cpu._accumulate``: the same IEEE operations in the same order, element by element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ._twins import split


@intrinsic  # type: ignore[untyped-decorator]  # (numba ships no types)
def call_acc(typingctx: Any, loop: Any, acc: Any, x: Any, m: Any, d: Any, mode: Any, sc: Any,
             doscale: Any) -> Any:
    """``int loop(T* acc, const T* x, ptrdiff_t m, T d, int mode, T sc, int doscale)`` (``gc_acc_f`` or
    ``gc_acc_d``) at the address ``loop``; ``acc`` and ``x`` are addresses too. 1 when every result is
    finite."""
    sig = types.int32(types.int64, types.uintp, types.uintp, types.int64, d, types.int32, d, types.int32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        loop_v, acc_v, x_v, m_v, d_v, mode_v, sc_v, ds_v = args
        byte_ptr = ir.IntType(8).as_pointer()
        ft = context.get_value_type(d)
        fnty = ir.FunctionType(ir.IntType(32), [byte_ptr, byte_ptr, ir.IntType(64), ft, ir.IntType(32), ft,
                                                ir.IntType(32)])
        fn = builder.inttoptr(loop_v, fnty.as_pointer())
        return builder.call(fn, [builder.inttoptr(acc_v, byte_ptr), builder.inttoptr(x_v, byte_ptr), m_v, d_v,
                                 mode_v, sc_v, ds_v])

    return sig, codegen


@njit(cache=True, fastmath=False, nogil=True, parallel=True)
def accumulate_native(loop, acc, x, f, mode, sc, doscale):
    """acc = scale(finish(acc + x)) by the C loop at ``loop``, one block (``_twins.split``) per iteration;
    ``acc`` and ``x`` contiguous 1-D arrays of one float dtype. The number of blocks holding a non-finite
    result."""
    m = acc.shape[0]
    size = acc.itemsize
    pa, px = acc.ctypes.data, x.ctypes.data
    md, ds = np.int32(mode), np.int32(1 if doscale else 0)
    bad = 0
    nb, blk = split(m)
    for b in prange(nb):
        lo, hi = min(m, b * blk), min(m, b * blk + blk)
        if hi > lo:
            off = np.uintp(lo * size)
            bad += 1 - call_acc(np.int64(loop), pa + off, px + off, np.int64(hi - lo), f, md, sc, ds)
    return bad

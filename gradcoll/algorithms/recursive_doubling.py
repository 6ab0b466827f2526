"""Recursive-doubling allreduce: the latency-optimal algorithm for small buffers.

Let ``p`` be the largest power of two not above ``n`` and ``r = n - p``.

1. Fold (only when ``n`` is not a power of two): among the first ``2r``
   ranks, each even rank sends its buffer to the odd rank above it, which
   adds it in, and then sits out. That leaves exactly ``p`` active ranks,
   renumbered ``0..p-1``.
2. Butterfly: in round ``k`` (``k = 0 .. log2 p - 1``) active rank ``v``
   exchanges its whole partial result with active rank ``v XOR 2**k`` and
   adds what it receives. After round ``k`` every active rank holds the sum
   over its block of ``2**(k+1)`` ranks; after the last round, the total.
   ``mean`` divides by ``n`` in the fused kernel call of the last round.
3. Unfold: each odd rank of the first ``2r`` sends the result back to the
   even rank that sat out.

Bitwise identical results: in every round both partners hold the same two
operands, the partial sum ``A`` of the lower block and ``B`` of the upper
block, and compute ``A + B`` and ``B + A``. IEEE-754 addition is commutative
(exactly, not just up to rounding), and the blocks - so the grouping of the
sum - are the same for every rank, so every rank ends with the same bits.

Each active rank sends ``log2(p) * S`` bytes in ``log2(p)`` rounds (plus one
fold and one unfold step of ``S`` bytes when ``n`` is not a power of two).
An overflow sets element 0 of the partial to NaN, which every later round
carries to every rank, so all ranks detect it together. See
docs/algorithms/recursive_doubling.md.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import NonFiniteError
from ..transport.base import Transport
from ._common import Coll, Workspace, as_flat, check_op, data_tag, scratch
from ._handshake import handshake, local_status, make_record, raise_nonfinite

__all__ = ["recursive_doubling_allreduce"]

_FOLD, _ROUND, _UNFOLD = 4, 5, 6


def recursive_doubling_allreduce(
    transport: Transport,
    buf: np.ndarray,
    *,
    op: str = "mean",
    check_finite: bool = True,
    seq: int = 0,
    timeout: float | None = None,
    workspace: Workspace | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive doubling; returns ``buf``."""
    flat = as_flat(buf, reduce=True)
    check_op(op)
    coll = Coll(transport, "recursive-doubling allreduce", seq, flat.nbytes, timeout)
    status = local_status(flat, check_finite, backend)
    handshake(coll, make_record("allreduce", "recursive_doubling", op, flat.dtype, flat.size, seq, status=status))
    n, me = coll.size, coll.rank
    if n == 1 or flat.size == 0:
        return buf
    p = 1 << (n.bit_length() - 1)
    r = n - p
    rounds = p.bit_length() - 1
    tmp = scratch(workspace, "rd", flat.size, flat.dtype)
    combine = _combiner(op, n, check_finite, backend)
    coll.begin(rounds + (2 if r else 0))
    if me < 2 * r and me % 2 == 0:  # sits out: fold in, then wait for the result
        coll.step = 1
        coll.send(me + 1, flat, data_tag(seq, _FOLD))
        coll.step = coll.steps
        coll.recv(me + 1, flat, data_tag(seq, _UNFOLD))
    else:
        if me < 2 * r:
            coll.step = 1
            coll.recv(me - 1, tmp, data_tag(seq, _FOLD))
            combine(flat, tmp, False)
            v = me // 2
        else:
            v = me - r
        for k in range(rounds):
            coll.step = k + 1 + (1 if r else 0)
            pv = v ^ (1 << k)
            peer = 2 * pv + 1 if pv < r else pv + r
            coll.sendrecv(peer, flat, tmp, data_tag(seq, _ROUND))
            combine(flat, tmp, k == rounds - 1)
        if me < 2 * r:
            coll.step = coll.steps
            coll.send(me - 1, flat, data_tag(seq, _UNFOLD))
    if check_finite and op in ("mean", "sum") and not np.isfinite(flat[0]):
        raise_nonfinite(coll, None, -1, float(flat[0]))
    return buf


def _combiner(op: str, n: int, check: bool, backend: str | None):  # type: ignore[no-untyped-def]
    """``combine(acc, x, last)``: add ``x`` into ``acc``; plants a NaN at ``acc[0]`` on overflow."""
    if op in ("mean", "sum"):
        divide = n if op == "mean" else None

        def combine(acc: np.ndarray, x: np.ndarray, last: bool) -> None:
            try:
                kernels.accumulate(acc, x, divide_by=divide if last else None, check_finite=check, backend=backend)
            except NonFiniteError:
                acc[0] = np.nan  # inputs were checked finite: an overflow; make every rank see it
        return combine
    ufunc = np.maximum if op == "max" else np.minimum

    def combine_minmax(acc: np.ndarray, x: np.ndarray, last: bool) -> None:
        ufunc(acc, x, out=acc)
    return combine_minmax

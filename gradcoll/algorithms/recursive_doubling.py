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
carries to every rank, so all ranks detect it together; a bad input was
planted there before the data moved (see ``gradcoll.algorithms._guard``, which also carries
the mismatch and timeout checks). See docs/algorithms/recursive_doubling.md.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import NonFiniteError
from ..transport.base import Transport
from ._common import Coll, Workspace, scratch
from ._guard import guarded_allreduce

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
    return guarded_allreduce(
        transport, buf, name="recursive-doubling allreduce", algo="recursive_doubling", op=op,
        check_finite=check_finite, seq=seq, timeout=timeout, backend=backend,
        body=lambda coll, flat: _exchange(coll, flat, op, check_finite, workspace, backend),
    )


def _exchange(coll: Coll, flat: np.ndarray, op: str, check: bool, workspace: Workspace | None,
              backend: str | None) -> None:
    n, me = coll.size, coll.rank
    p = 1 << (n.bit_length() - 1)
    r = n - p
    rounds = p.bit_length() - 1
    tmp = scratch(workspace, "rd", flat.size, flat.dtype)
    combine = _combiner(op, n, check, backend)
    fold, rnd, unfold = coll.tag0 + _FOLD, coll.tag0 + _ROUND, coll.tag0 + _UNFOLD
    coll.begin(rounds + (2 if r else 0))
    if me < 2 * r and me % 2 == 0:  # sits out: fold in, then wait for the result
        coll.step = 1
        coll.send(me + 1, flat, fold)
        coll.step = coll.steps
        coll.recv(me + 1, flat, unfold)
        return
    if me < 2 * r:
        coll.step = 1
        coll.recv(me - 1, tmp, fold)
        if flat.size:
            combine(flat, tmp, False)
        v = me // 2
    else:
        v = me - r
    for k in range(rounds):
        coll.step = k + 1 + (1 if r else 0)
        pv = v ^ (1 << k)
        peer = 2 * pv + 1 if pv < r else pv + r
        coll.sendrecv(peer, flat, tmp, rnd)
        if flat.size:
            combine(flat, tmp, k == rounds - 1)
    if me < 2 * r:
        coll.step = coll.steps
        coll.send(me - 1, flat, unfold)


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

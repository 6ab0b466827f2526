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

from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from . import tags
from ._common import Coll, Options, Workspace, combiner, scratch
from ._guard import guarded_allreduce

__all__ = ["recursive_doubling_allreduce", "butterfly", "rd_pass"]


def recursive_doubling_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                                 seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                                 backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive doubling; returns ``buf``."""
    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name="recursive-doubling allreduce", algo="recursive_doubling", body=rd_pass)


def butterfly(coll: Coll, mine: np.ndarray, phases: tuple[int, int, int], fold_in: Callable[[int, int], None],
              exchange: Callable[[int, int, int, int], None], done: Callable[[], None] = lambda: None) -> None:
    """The recursive-doubling schedule, shared with the raw-contribution allreduces; ``mine`` ends with the result.

    A rank that sits out sends ``mine`` to its odd partner (``phases[0]``)
    and receives the result from it (``phases[2]``) at the end. The others
    call ``fold_in(partner, tag)`` when a partner folds in, ``exchange(k,
    v, peer, tag)`` for round ``k`` (``v`` this rank's virtual rank), then
    ``done()``, and send the result back to the partner that sat out.
    """
    n, me = coll.size, coll.rank
    p = 1 << (n.bit_length() - 1)
    r = n - p
    rounds = p.bit_length() - 1
    fold, rnd, unfold = (coll.tag0 + phase for phase in phases)
    coll.begin(rounds + (2 if r else 0))
    if me < 2 * r and me % 2 == 0:  # sits out: fold in, then wait for the result
        coll.step = 1
        coll.send(me + 1, mine, fold)
        coll.step = coll.steps
        coll.recv(me + 1, mine, unfold)
        return
    if me < 2 * r:
        coll.step = 1
        fold_in(me - 1, fold)
        v = me // 2
    else:
        v = me - r
    for k in range(rounds):
        coll.step = k + 1 + (1 if r else 0)
        pv = v ^ (1 << k)
        exchange(k, v, 2 * pv + 1 if pv < r else pv + r, rnd)
    done()
    if me < 2 * r:
        coll.step = coll.steps
        coll.send(me - 1, mine, unfold)


def rd_pass(coll: Coll, flat: np.ndarray, opts: Options, divisor: int | None = None) -> None:
    """The allreduce's schedule; ``mean`` divides by ``divisor`` (default the size; see ``ring_pass``)."""
    tmp = scratch(opts.workspace, "rd", flat.size, flat.dtype)
    combine = combiner(opts, coll.size if divisor is None else divisor)  # an overflow marks element 0, carried on
    last = (1 << (coll.size.bit_length() - 1)).bit_length() - 2

    def fold_in(partner: int, tag: int) -> None:
        coll.recv(partner, tmp, tag)
        if flat.size:
            combine(flat, tmp, False)

    def exchange(k: int, v: int, peer: int, tag: int) -> None:
        coll.sendrecv(peer, flat, tmp, tag)
        if flat.size:
            combine(flat, tmp, k == last)

    butterfly(coll, flat, (tags.RD_FOLD, tags.RD_ROUND, tags.RD_UNFOLD), fold_in, exchange)

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

A power-of-two group over a transport with compiled rounds
(``Transport.rounds``: tcp's) runs every round, float32 or float64 mean or
sum, in one compiled call (``rd_plan``, ``SCHEDULE``, through
``_planned.run_plan``): the same rounds, tags and bits as the guard's
path, which runs what that call declines.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from ..transport.plan import DIVIDE, make
from . import tags
from ._common import Coll, Options, Workspace, combiner, scratch, sit_out
from ._guard import guarded_allreduce
from ._planned import Plan, Schedule, register, run_plan
from .rows import RowsCall

__all__ = ["recursive_doubling_allreduce", "butterfly", "rd_pass", "rd_rows"]


def recursive_doubling_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                                 seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                                 backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive doubling; returns ``buf``."""
    if type(buf) is np.ndarray and op in _STEP_OPS and backend in (None, "cython") \
            and run_plan(transport, buf, op, check_finite, seq, timeout, workspace, _rest, SCHEDULE):
        return buf
    return _guarded(transport, buf, op, check_finite, seq, timeout, workspace, backend)


def _guarded(transport: Transport, buf: np.ndarray, op: str, check_finite: bool, seq: int, timeout: float | None,
             workspace: Workspace | None, backend: str | None) -> np.ndarray:
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
    if sit_out(coll, mine, fold, unfold):
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


def rd_pass(coll: Coll, flat: np.ndarray, opts: Options, divisor: int | None = None, done: int = 0) -> None:
    """The allreduce's schedule; ``mean`` divides by ``divisor`` (default the size; see ``ring_pass``). ``done``:
    the rounds of a power-of-two group already done (by one compiled call); the schedule goes on after them."""
    tmp = scratch(opts.workspace, "rd", flat.size, flat.dtype)
    combine = combiner(opts, coll.size if divisor is None else divisor)  # an overflow marks element 0, carried on
    last = (1 << (coll.size.bit_length() - 1)).bit_length() - 2

    def fold_in(partner: int, tag: int) -> None:
        coll.recv(partner, tmp, tag)
        if flat.size:
            combine(flat, tmp, False)

    def exchange(k: int, v: int, peer: int, tag: int) -> None:
        if k < done:
            return
        coll.sendrecv(peer, flat, tmp, tag)
        if flat.size:
            combine(flat, tmp, k == last)

    butterfly(coll, flat, (tags.RD_FOLD, tags.RD_ROUND, tags.RD_UNFOLD), fold_in, exchange)


def rd_plan(rank: int, n: int, count: int, mean: bool) -> Plan:
    """The recursive doubling of rank ``rank`` of a power-of-two ``n`` on ``count`` elements as one plan
    (``gradcoll.transport.plan``): round ``k`` sends the whole buffer to ``rank XOR 2^k`` and adds the partner's
    into it (the last divides a mean)."""
    rounds = n.bit_length() - 1
    return Plan([0, count], tuple(rank ^ (1 << k) for k in range(rounds)), None,
                make((0, 0, count, 0, count, DIVIDE if mean and k == rounds - 1 else 0) for k in range(rounds)),
                (tags.RD_ROUND,) * rounds, count)


def _build(rank: int, n: int, count: int, mean: bool, itemsize: int) -> Plan:
    return rd_plan(rank, n, count, mean)


def _rest(coll: Coll, flat: np.ndarray, opts: Options, done: int) -> None:
    """The rounds of ``rd_plan``'s call from ``done`` on (the group's fast path runs the plan; see ``_planned``)."""
    rd_pass(coll, flat, opts, done=done)


#: Recursive doubling as one plan (``rd_plan``), for the group's fast path (``_planned.Prepared``).
SCHEDULE = Schedule("recursive-doubling allreduce", "recursive_doubling", False, _build, "rd")
register(SCHEDULE, _rest, _guarded)


_STEP_OPS = ("mean", "sum")


def rd_rows(coll: Coll, call: RowsCall) -> None:
    """Recursive doubling's rows form (``gradcoll.algorithms.rows``): an allgather of the raw rows, then every
    rank reduces all ``n`` of them itself (the same rows, so the same bits).

    Virtual rank ``v`` holds real ranks ``2v, 2v+1`` for ``v < r = n - p``
    (the even one folds its row into the odd one first) and ``v + r``
    otherwise, so an aligned block of virtual ranks is a contiguous range of
    real ranks and every round is one message each way: ``2**k`` rows out,
    ``2**k`` in (more where folded ranks sit). ``(p - 1)`` buffers per rank
    and ``n`` times the buffer in scratch: the schedule for small buffers.
    """
    data = call.data
    n, me = coll.size, coll.rank
    r = n - (1 << (n.bit_length() - 1))
    rows = np.empty((0, data.size), data.dtype)
    coll.marks = (0,)

    def first(u: int) -> int:  # the first real rank of virtual rank u
        return u + min(u, r)

    def fold_in(partner: int, tag: int) -> None:
        coll.recv(partner, rows[partner], tag)

    def exchange(k: int, v: int, peer: int, tag: int) -> None:
        a, b = v & ~((1 << k) - 1), (v ^ (1 << k)) & ~((1 << k) - 1)
        out = rows[first(a): first(a + (1 << k))].reshape(-1)  # 1-D: a memoryview of (k, 0) cannot be cast
        coll.sendrecv(peer, out, rows[first(b): first(b + (1 << k))].reshape(-1), tag)

    if not (me < 2 * r and me % 2 == 0):  # a rank that sits out needs no rows
        rows = call.scratch("rd", (n, data.size))
        rows[me] = data
    butterfly(coll, data, (tags.RAW_FOLD, tags.RAW_ROUND, tags.RAW_UNFOLD), fold_in, exchange,
              lambda: call.rows.reduce(rows, data))

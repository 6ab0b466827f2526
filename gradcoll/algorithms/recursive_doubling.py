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

Small buffers on a power-of-two group over a transport with a compiled
exchange-and-reduce (``Transport.exchange_reduce``: tcp's, for small float32
and float64 mean/sum) take ``_stepped``: the same rounds, tags and bits,
one compiled call per round (send, receive, header check, fused reduce and
finite check), or every round in one call where the transport has that
(``Transport.exchange_rounds``: tcp's), and the frame of the
guard reduced to what the happy path needs. The error path is the guard's: on any failure it builds the
collective's ``Coll`` as the guard would have and calls ``fail``. A rank
whose input is not finite, or whose transport declines the first round,
runs the guard's general path instead (its frames are the same). The
group's fast path runs the same rounds as a plan (``rd_plan``, ``SCHEDULE``:
``_planned.Prepared``), with the same frames.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from ..transport.plan import DIVIDE, make
from . import tags
from ._common import TRANSLATED, Coll, Options, Workspace, combiner, scratch
from ._guard import ERRORS, fail, guarded_allreduce, lean_frame
from ._planned import Plan, Schedule, register
from ._planned import _coll as planned_coll

__all__ = ["recursive_doubling_allreduce", "butterfly", "rd_pass"]


def recursive_doubling_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                                 seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                                 backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive doubling; returns ``buf``."""
    if type(buf) is np.ndarray and op in _STEP_OPS and backend in (None, "cython") \
            and _stepped(transport, buf, op, check_finite, seq, timeout, workspace):
        return buf
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
register(SCHEDULE, _rest)


_NAME = "recursive-doubling allreduce"
_STEP_OPS = ("mean", "sum")
_DECLINED, _MOVED = -1, 0  # the outcomes of exchange_reduce this module acts on (gradcoll.transport.tcp_fast)


def _stepped(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None,
             ws: Workspace | None) -> bool:
    """The allreduce of ``buf`` with one compiled exchange-and-reduce per round; False: declined, nothing moved.

    The guard's frame without its happy-path costs: the same descriptor tag
    (so a rank on the general path meets the same frames), the input's
    finite check inside the first compiled call, and the marker read from
    the last round's own check. Runs where the size is a power of two and
    ``t`` has ``exchange_reduce``.
    """
    frame = lean_frame(t, buf, "exchange_reduce", "recursive_doubling", op, check, seq, timeout)
    if frame is None:
        return False
    flat, desc, tag0, limit, started = frame
    step, n = t.exchange_reduce, t.size  # type: ignore[attr-defined]
    tmp = scratch(ws, "rd", flat.size, flat.dtype)
    rounds, me = n.bit_length() - 1, t.rank
    coll: Coll | None = None
    found: list[tuple[int, float]] = []  # this rank's input, not finite beyond the first round's first piece
    k0 = 0
    many = getattr(t, "exchange_rounds", None)
    if many is not None and rounds > 1:  # every round in one compiled call (the first k0 of them done)
        at, t0 = [0], time.perf_counter()
        try:
            peers = t.__dict__.get("_rd_peers")
            if peers is None:
                peers = t._rd_peers = tuple(me ^ (1 << k) for k in range(rounds))  # type: ignore[attr-defined]
            k0 = many(peers, flat, tmp, tag0 + tags.RD_ROUND,
                      max(0.0, started + limit - time.monotonic()), n if op == "mean" else 1, check, found, at)
        except ERRORS as exc:
            coll = _coll(t, flat, seq, limit, started, desc, tag0, rounds, at[0], found)
            fail(coll, coll.translate(exc, me ^ (1 << at[0])) if isinstance(exc, TRANSLATED) else exc)
        finally:
            t.note_wait(time.perf_counter() - t0)
        if found:
            coll = _coll(t, flat, seq, limit, started, desc, tag0, rounds, 0, found)
    for k in range(k0, rounds):
        peer, last = me ^ (1 << k), k == rounds - 1
        t0 = time.perf_counter()
        try:
            how = step(peer, flat, tmp, tag0 + tags.RD_ROUND, max(0.0, started + limit - time.monotonic()),
                       n if last and op == "mean" else 1, check and k == 0, check, found)
        except ERRORS as exc:
            coll = _coll(t, flat, seq, limit, started, desc, tag0, rounds, k, found)
            fail(coll, coll.translate(exc, peer) if isinstance(exc, TRANSLATED) else exc)
        finally:
            t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
        if found and coll is None:
            coll = _coll(t, flat, seq, limit, started, desc, tag0, rounds, k, found)
        if how == _DECLINED and k == 0:
            return False
        if how <= _MOVED:  # moved by the engine, or (another thread's work queued) to move on the general path
            coll = coll or _coll(t, flat, seq, limit, started, desc, tag0, rounds, k, found)
            coll.step = k + 1
            if how == _DECLINED:
                try:
                    coll.sendrecv(peer, flat, tmp, tag0 + tags.RD_ROUND)
                except ERRORS as exc:
                    fail(coll, exc)
            if flat.size:
                combiner(Options(op, check, seq, limit), n)(flat, tmp, last)
    if check and flat.size and not math.isfinite(flat[0]):  # the marker every round carried on
        coll = coll or _coll(t, flat, seq, limit, started, desc, tag0, rounds, rounds - 1, found)
        fail(coll, None, (0, float(flat[0])))
    return True


def _coll(t: Transport, flat: np.ndarray, seq: int, limit: float, started: float, desc: tuple[int, ...],
          tag0: int, rounds: int, k: int, found: list[tuple[int, float]]) -> Coll:
    """The ``Coll`` the guard would have run this call with, at round ``k``: for the error path and the general
    rounds. ``found``: this rank's non-finite input element, as the guard's local check reports it."""
    return planned_coll(t, _NAME, flat, seq, limit, started, desc, tag0, rounds, k, found)

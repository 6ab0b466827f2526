"""Halving-doubling allreduce: a reduce-scatter by recursive halving, then an allgather by recursive doubling.

Let ``p`` be the largest power of two not above ``n`` and ``r = n - p``.
The buffer of ``count`` elements is split into ``p`` near-equal chunks
(``chunk_bounds``).

1. Fold (only when ``n`` is not a power of two): as in recursive doubling,
   each even rank of the first ``2r`` sends its buffer to the odd rank above
   it, which adds it in, and then sits out. ``p`` active ranks remain,
   renumbered ``0..p-1``.
2. Reduce-scatter: every active rank ``v`` starts with all ``p`` chunks. In
   round ``k`` (``k = 0 .. log2 p - 1``) it pairs with ``v XOR 2**k``,
   splits the chunks it still holds into two halves, keeps the lower half
   if bit ``k`` of ``v`` is 0 (else the upper), sends the other half to its
   partner, and adds the partner's copy of its own half into it. After the
   last round it holds one chunk (index: ``v`` with its ``log2 p`` bits
   reversed), summed over every rank; ``mean`` divides it by ``n`` in the
   fused kernel call of that round.
3. Allgather: the rounds in reverse order (``k = log2 p - 1 .. 0``); in
   each, a rank sends every chunk it holds to the same partner as in the
   reduce-scatter's round ``k`` and receives the partner's, so it holds
   twice as many. After the last round every rank holds the whole result.
4. Unfold: each odd rank of the first ``2r`` sends the result to the even
   rank that sat out.

Every active rank sends ``2 (p - 1) / p * S`` bytes in ``2 log2 p`` rounds
for a buffer of ``S`` bytes: the ring's bytes in the rounds of recursive
doubling (plus a fold and an unfold of ``S`` when ``n`` is not a power of
two). Each chunk is summed by one rank and copied to the others, so the
result is bitwise identical on every rank. An overflow plants a NaN at the
first element of the half being summed, which is the first element of a
chunk; every later round carries it to the chunk's owner, and the allgather
to every rank. See docs/algorithms/halving_doubling.md.

Over tcp, power-of-two groups run every round as one compiled call of the
transport's exchange-and-reduce (``Transport.exchange_reduce`` with a send
array of its own): a reduce-scatter round adds the peer's bytes as they
arrive, an allgather round (``copy``) receives them in place. All the rounds
are one such call where the transport has that (``Transport.exchange_plan``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from ..transport.plan import set_tags
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, combiner, plant, scratch
from ._guard import LEAN_DTYPES, guarded_allreduce
from ._handshake import local_status
from ._hd_planned import NAME, SCHEDULE, hd_schedule, plan_arrays, planned
from ._planned import register
from ._verdict import NONFINITE

__all__ = ["halving_doubling_allreduce", "hd_pass", "hd_schedule"]

_STEP_OPS = ("mean", "sum")
_STEP_DTYPES = LEAN_DTYPES
_DECLINED, _MOVED = -1, 0  # exchange_reduce's outcomes: nothing moved; moved, not reduced (gradcoll.transport.tcp_fast)


def halving_doubling_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                               seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                               backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive halving and doubling; returns ``buf``."""
    opts = Options(op, check_finite, seq, timeout, workspace, backend)
    n = transport.size
    if getattr(transport, "exchange_reduce", None) is None or n < 2 or n & (n - 1) or op not in _STEP_OPS \
            or backend not in (None, "cython"):
        return guarded_allreduce(transport, buf, opts, name=_NAME, algo="halving_doubling", body=hd_pass)
    if type(buf) is np.ndarray and planned(transport, buf, op, check_finite, seq, timeout, workspace, _rest):
        return buf
    stepped: list[bool] = []

    def prepare(coll: Coll, flat: np.ndarray) -> None:
        # The compiled rounds check the input a piece at a time as they send it and add into it (the first
        # round touches every element); anything else checks it here, as the frame would have.
        if flat.dtype in _STEP_DTYPES and flat.flags.c_contiguous and flat.flags.writeable:
            stepped.append(True)
            return
        coll.status = local_status(flat, opts.check_finite, opts.backend)
        if coll.status is not None:
            plant(flat)

    def body(coll: Coll, flat: np.ndarray, o: Options) -> None:
        hd_pass(coll, flat, o, stepped=bool(stepped))

    return guarded_allreduce(transport, buf, opts, name=_NAME, algo="halving_doubling", body=body, prepare=prepare)


_NAME = NAME


def _rest(coll: Coll, flat: np.ndarray, opts: Options, done: int) -> None:
    """The rounds of ``_hd_planned``'s call from ``done`` on, through the compiled step."""
    hd_pass(coll, flat, opts, stepped=True, done=done)


register(SCHEDULE, _rest)


def hd_pass(coll: Coll, flat: np.ndarray, opts: Options, divisor: int | None = None, *, stepped: bool = False,
            done: int | None = None) -> None:
    """The allreduce's schedule; ``mean`` divides by ``divisor`` (default the size; see ``ring.ring_pass``).

    ``stepped``: the rounds go through the transport's
    compiled ``exchange_reduce`` (a power-of-two group, float32/float64,
    mean or sum), which also checks this rank's input in the first round:
    nothing else has checked it (``halving_doubling_allreduce``'s
    ``prepare``). A round it declines runs here, the first one after the
    frame's own check. ``done``: the rounds already done (by ``_hd_planned``'s one call); None: every round
    in one call where the transport has that, else none.
    """
    n, me = coll.size, coll.rank
    p = 1 << (n.bit_length() - 1)
    r = n - p
    rounds = p.bit_length() - 1
    bounds = chunk_bounds(flat.size, p)
    coll.marks = [bounds[c] for c in range(p) if bounds[c + 1] > bounds[c]]
    combine = combiner(opts, n if divisor is None else divisor)
    fold, rs, ag, unfold = (coll.tag0 + phase for phase in (tags.HD_FOLD, tags.HD_RS, tags.HD_AG, tags.HD_UNFOLD))
    coll.begin(2 * rounds + (2 if r else 0))
    if me < 2 * r and me % 2 == 0:  # sits out: fold in, then wait for the result
        coll.step = 1
        coll.send(me + 1, flat, fold)
        coll.step = coll.steps
        coll.recv(me + 1, flat, unfold)
        return
    half = bounds[p // 2]  # the first round's halves are the largest parts a rank receives (the fold: all of it)
    tmp = scratch(opts.workspace, "hd", max(flat.size - half, half, 1) if r == 0 else max(flat.size, 1), flat.dtype)
    base = 0
    if me < 2 * r:
        coll.step = 1
        coll.recv(me - 1, tmp[: flat.size], fold)
        if flat.size:
            combine(flat, tmp[: flat.size], False)
        v, base = me // 2, 1
    else:
        v = me - r
    plan = hd_schedule(v, p)

    def rank_of(pv: int) -> int:
        return 2 * pv + 1 if pv < r else pv + r

    step = _step(coll, opts, n if divisor is None else divisor) if stepped else None
    if done is None:
        done = _all_rounds(coll, opts, n if divisor is None else divisor, flat, tmp, plan, bounds, rs, ag) \
            if step is not None and r == 0 else 0
    for k, (pv, klo, khi, slo, shi) in enumerate(plan):
        if k < done:
            continue
        coll.step = base + k + 1
        a, b, c, d = bounds[klo], bounds[khi], bounds[slo], bounds[shi]
        how = _DECLINED if step is None else step(k, rank_of(pv), flat, (a, b, c, d), tmp[: b - a], rs,
                                                  k == rounds - 1)
        if how > _MOVED:  # moved and reduced
            continue
        if how == _DECLINED:
            coll.sendrecv(rank_of(pv), flat[c:d], tmp[: b - a], rs)
        if b > a:
            combine(flat[a:b], tmp[: b - a], k == rounds - 1)
    for k in range(rounds - 1, -1, -1):
        if 2 * rounds - 1 - k < done:
            continue
        pv, klo, khi, slo, shi = plan[k]
        coll.step = base + 2 * rounds - k
        mine, theirs = flat[bounds[klo] : bounds[khi]], flat[bounds[slo] : bounds[shi]]
        if step is None or step(k, rank_of(pv), flat, (bounds[slo], bounds[shi], bounds[klo], bounds[khi]), None,
                                ag, False) == _DECLINED:
            coll.sendrecv(rank_of(pv), mine, theirs, ag)
    if me < 2 * r:
        coll.step = coll.steps
        coll.send(me - 1, flat, unfold)


def _all_rounds(coll: Coll, opts: Options, divisor: int, flat: np.ndarray, tmp: np.ndarray,
                plan: list[tuple[int, int, int, int, int]], bounds: list[int], rs: int, ag: int) -> int:
    """Every round of a power-of-two group in one compiled call where the transport has that
    (``Transport.exchange_plan``): how many rounds it did (0: none, nothing moved; the loops run the rest).

    The reduce-scatter rounds, then the allgather's in reverse, each as ``_step`` runs it; the first one
    checks this rank's input (a non-finite element goes into ``coll.status``).
    """
    t = coll.t
    run = getattr(t, "exchange_plan", None)
    if run is None:
        return 0
    rounds = len(plan)
    peers, spec = plan_arrays(plan, bounds, opts.op == "mean")
    set_tags(spec, [rs] * rounds + [ag] * rounds)
    found: list[tuple[int, float]] = []
    at = [0]
    t0 = time.perf_counter()
    try:
        return int(run(peers, flat, tmp, spec, coll.deadline.remaining(), divisor, opts.check_finite, found, at))
    except BaseException:
        coll.step = at[0] + 1  # the round that failed, for the error (no fold: the group is a power of two)
        raise
    finally:
        t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
        if found and coll.status is None:  # this rank's input: the culprit's record, even if a round failed
            coll.status = (NONFINITE, int(found[0][0]), float(found[0][1]))


def _step(coll: Coll, opts: Options, divisor: int) -> Callable[..., int]:
    """One round through ``Transport.exchange_reduce``: its outcome (``_DECLINED``: nothing moved).

    A reduce-scatter round sends ``flat[c:d]`` and adds the peer's copy of
    ``flat[a:b]`` into it through ``tmp``; an allgather round (``tmp`` None)
    sends ``flat[c:d]`` and receives ``flat[a:b]``, and reduces nothing.

    In round 0 it checks this rank's input; a non-finite element goes into
    ``coll.status`` (the culprit's record, as the frame's check would have
    put it). A first round declined (the input's first piece not finite, or
    other work queued on the transport) gets the frame's check here.
    """
    t, check = coll.t, opts.check_finite
    exchange = t.exchange_reduce  # type: ignore[attr-defined]

    def step(k: int, peer: int, flat: np.ndarray, where: tuple[int, int, int, int], tmp: np.ndarray | None,
             tag: int, last: bool) -> int:
        a, b, c, d = where
        found: list[tuple[int, float]] = []
        first = check and k == 0 and tmp is not None
        t0 = time.perf_counter()
        try:
            how = int(exchange(peer, flat[a:b], flat[a:b] if tmp is None else tmp, tag, coll.deadline.remaining(),
                               divisor if last and opts.op == "mean" else 1, first, check, found, flat[c:d], (c, a),
                               tmp is None))
        finally:
            t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
            if found and coll.status is None:  # this rank's input: the culprit's record, even if the round failed
                coll.status = (NONFINITE, int(found[0][0]), float(found[0][1]))
        if how == _DECLINED and first:
            coll.status = local_status(flat, check, opts.backend)
            if coll.status is not None:
                plant(flat)
        return how

    return step

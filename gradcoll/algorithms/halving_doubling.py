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

Over a transport with compiled rounds (``Transport.rounds``: tcp's),
power-of-two groups run every round, float32 or float64 mean or sum, in one
compiled call (``_hd_planned``): a reduce-scatter round adds the peer's
bytes as they arrive, an allgather round receives them in place. A call it
declines before a byte moves runs in the guard's frame (``hd_pass``), and
so do the rounds after one that stopped early.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, combiner, scratch, sit_out
from ._guard import guarded_allreduce
from ._hd_planned import NAME, SCHEDULE, hd_schedule, planned
from ._planned import register
from .rows import RowsCall

__all__ = ["halving_doubling_allreduce", "hd_pass", "hd_rows", "hd_schedule"]

_STEP_OPS = ("mean", "sum")


def halving_doubling_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                               seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                               backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by recursive halving and doubling; returns ``buf``."""
    if type(buf) is np.ndarray and op in _STEP_OPS and backend in (None, "cython") \
            and planned(transport, buf, op, check_finite, seq, timeout, workspace, _rest):
        return buf
    return _guarded(transport, buf, op, check_finite, seq, timeout, workspace, backend)


def _guarded(transport: Transport, buf: np.ndarray, op: str, check_finite: bool, seq: int, timeout: float | None,
             workspace: Workspace | None, backend: str | None) -> np.ndarray:
    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend), name=NAME,
                             algo="halving_doubling", body=hd_pass)


def _rest(coll: Coll, flat: np.ndarray, opts: Options, done: int) -> None:
    """The rounds of ``_hd_planned``'s call from ``done`` on (the first, which checked the input, is done)."""
    hd_pass(coll, flat, opts, done=done)


register(SCHEDULE, _rest, _guarded)


def hd_pass(coll: Coll, flat: np.ndarray, opts: Options, divisor: int | None = None, *, done: int = 0) -> None:
    """The allreduce's schedule; ``mean`` divides by ``divisor`` (default the size; see ``ring.ring_pass``).
    ``done``: the rounds of a power-of-two group already done (by ``_hd_planned``'s one compiled call)."""
    n, me = coll.size, coll.rank
    got = _begin(coll, flat, (tags.HD_FOLD, tags.HD_RS, tags.HD_AG, tags.HD_UNFOLD))
    if got is None:
        return
    p, r, rounds, bounds, (fold, rs, ag, unfold) = got
    combine = combiner(opts, n if divisor is None else divisor)
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

    for k, (pv, klo, khi, slo, shi) in enumerate(plan):
        if k < done:
            continue
        coll.step = base + k + 1
        a, b, c, d = bounds[klo], bounds[khi], bounds[slo], bounds[shi]
        coll.sendrecv(rank_of(pv), flat[c:d], tmp[: b - a], rs)
        if b > a:
            combine(flat[a:b], tmp[: b - a], k == rounds - 1)
    _share(coll, flat, plan, bounds, base, rank_of, ag, unfold, r, done)


def _share(coll: Coll, flat: np.ndarray, plan: list[tuple[int, int, int, int, int]], bounds: list[int], base: int,
           rank_of: Callable[[int], int], ag: int, unfold: int, r: int, done: int = 0) -> None:
    """Both forms' end: the allgather rounds (the reduce-scatter's backwards, from round ``done`` of all ``2 log2
    p``), then the result to the rank that sat out."""
    rounds, me = len(plan), coll.rank
    for k in range(rounds - 1, -1, -1):
        if 2 * rounds - 1 - k < done:
            continue
        pv, klo, khi, slo, shi = plan[k]
        coll.step = base + 2 * rounds - k
        coll.sendrecv(rank_of(pv), flat[bounds[klo]: bounds[khi]], flat[bounds[slo]: bounds[shi]], ag)
    if me < 2 * r:
        coll.step = coll.steps
        coll.send(me - 1, flat, unfold)


def _begin(coll: Coll, flat: np.ndarray, phases: tuple[int, int, int, int]
           ) -> tuple[int, int, int, list[int], tuple[int, ...]] | None:
    """Both forms' start: ``(p, r, rounds, bounds, tags)`` (the ``p`` chunks' starts are the marker slots), or
    None on a rank that sat out (it folded ``flat`` in and has the result)."""
    n = coll.size
    p = 1 << (n.bit_length() - 1)
    rounds = p.bit_length() - 1
    bounds = chunk_bounds(flat.size, p)
    coll.marks = [bounds[c] for c in range(p) if bounds[c + 1] > bounds[c]]
    tags_ = tuple(coll.tag0 + phase for phase in phases)
    coll.begin(2 * rounds + (2 if n > p else 0))
    if sit_out(coll, flat, tags_[0], tags_[3]):
        return None
    return p, n - p, rounds, bounds, tags_


def hd_rows(coll: Coll, call: RowsCall) -> None:
    """Halving-doubling's rows form (``gradcoll.algorithms.rows``): a recursive halving of the raw rows, the
    owner's reduce, then the recursive-doubling allgather of the results.

    The rounds are ``hd_schedule``'s. In reduce-scatter round ``k`` an
    active rank holds the rows of a block of ``2**k`` virtual ranks (a
    contiguous range of real ranks, as in ``rd_rows``) for the chunks it
    still keeps; it sends those rows of the half it gives up and receives
    the partner's block's rows of the half it keeps: ``S/2`` each way per
    round, ``S/2 log2 p`` in all (the plain form's ``S (p - 1)/p``: raw
    rows cannot be added on the way). After the last round it holds all
    ``n`` rows of its chunk, reduces them, and the allgather rounds copy the
    results as the plain form's do.
    """
    data, me = call.data, coll.rank
    got = _begin(coll, data, (tags.RAW_FOLD, tags.RAW_ROUND, tags.RAW_AG, tags.RAW_UNFOLD))
    if got is None:
        return
    p, r, rounds, bounds, (fold, rs, ag, unfold) = got

    def first(u: int) -> int:  # the first real rank of virtual rank u
        return u + min(u, r)

    def rank_of(pv: int) -> int:
        return 2 * pv + 1 if pv < r else pv + r

    if me < 2 * r:
        v, base = me // 2, 1
        held = call.scratch("hd_fold", (2, data.size))
        coll.step = 1
        coll.recv(me - 1, held[0], fold)
        held[1] = data
    else:
        v, base = me - r, 0
        held = data.reshape(1, -1)
    lo, hi = first(v), first(v + 1)  # the ranks whose rows ``held`` has
    off = 0  # the first element ``held`` covers
    plan = hd_schedule(v, p)
    for k, (pv, klo, khi, slo, shi) in enumerate(plan):
        coll.step = base + k + 1
        pa = pv & ~((1 << k) - 1)
        plo, phi = first(pa), first(pa + (1 << k))
        out = np.ascontiguousarray(held[:, bounds[slo] - off: bounds[shi] - off])
        nlo, nhi = min(lo, plo), max(hi, phi)
        kept = call.scratch(f"hd{k % 2}", (nhi - nlo, bounds[khi] - bounds[klo]))
        coll.sendrecv(rank_of(pv), out.reshape(-1), kept[plo - nlo: phi - nlo].reshape(-1), rs)
        kept[lo - nlo: hi - nlo] = held[:, bounds[klo] - off: bounds[khi] - off]
        held, lo, hi, off = kept, nlo, nhi, bounds[klo]
    if rounds:
        call.rows.reduce(held, data[off: off + held.shape[1]])
    _share(coll, data, plan, bounds, base, rank_of, ag, unfold, r)

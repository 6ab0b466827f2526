"""Whole-buffer gathers for the reductions that must see every raw contribution.

The deterministic allreduce and the low-precision wire allreduce reduce
each element in one place from all ``n`` contributions (so the result does
not depend on how partial sums were grouped). Their ``star`` schedule
gathers the inputs on rank 0 and sends the result back (``star_gather``,
``star_reply``). Their ``recursive_doubling`` schedule is an allgather
of the inputs in ``log2 p`` rounds (``p`` the largest power of two <= ``n``)
followed by a local reduction:

* virtual rank ``v`` holds real ranks ``2v, 2v+1`` for ``v < r = n - p``
  (the even one folds its buffer into the odd one first) and ``v + r``
  otherwise, so an aligned block of virtual ranks is a contiguous range of
  real ranks, and every round is one message each way: ``2**k`` rows out,
  ``2**k`` rows in (more where folded ranks sit);
* afterwards ``rows[i]`` holds rank ``i``'s buffer on every rank that took
  part; the ranks that sat out get the result from their partner
  (``rd_result``).

Bytes per rank: ``(p - 1)`` buffers, against ``log2 p`` for a
recursive doubling of partial sums: the latency schedule for small buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..transport.base import Request
from ._common import Coll

__all__ = ["star_gather", "star_reply", "rd_steps", "sits_out", "rd_allgather", "rd_result"]


def star_gather(coll: Coll, mine: np.ndarray, make_rows: Callable[[], np.ndarray], up: int,
                down: int) -> tuple[np.ndarray, list[Request]] | None:
    """Step 1 of the star (2 steps). Rank 0: receives of every other rank's ``mine``
    into ``make_rows()[p - 1]``, returned with their requests (wait for them in rank
    order, then ``star_reply``). Any other rank: sends ``mine``, receives the
    result into it, returns None.
    """
    coll.begin(2)
    coll.step = 1
    if coll.rank != 0:
        r = coll.irecv(0, mine, down)  # rank 0 replies only after it has read ``up`` whole
        coll.send(0, mine, up)
        coll.step = 2
        coll.wait(r, 0)
        return None
    rows = make_rows()
    return rows, [coll.irecv(p, rows[p - 1], up) for p in range(1, coll.size)]


def star_reply(coll: Coll, result: np.ndarray, down: int) -> None:
    """Step 2 of the star on rank 0: ``result`` to every other rank."""
    coll.step = 2
    for req, p in [(coll.isend(p, result, down), p) for p in range(1, coll.size)]:
        coll.wait(req, p)


def _shape(n: int) -> tuple[int, int, int]:
    p = 1 << (n.bit_length() - 1)
    return p, n - p, p.bit_length() - 1


def rd_steps(n: int) -> int:
    """Steps of the schedule on ``n`` ranks (for ``Coll.begin``)."""
    _, r, rounds = _shape(n)
    return rounds + (2 if r else 0)


def sits_out(n: int, rank: int) -> bool:
    """True for a rank that folds its buffer into a partner and waits for the result."""
    _, r, _ = _shape(n)
    return rank < 2 * r and rank % 2 == 0


def rd_allgather(coll: Coll, mine: np.ndarray, rows: np.ndarray | None, fold: int, rnd: int) -> bool:
    """Gather every rank's ``mine`` into ``rows`` (``(n, m)``, None on a rank that sits out).

    Returns False on a rank that sits out: it has sent ``mine`` to its
    partner and must call ``rd_result`` for the result.
    """
    n, me = coll.size, coll.rank
    _, r, rounds = _shape(n)
    if sits_out(n, me):
        coll.step = 1
        coll.send(me + 1, mine, fold)
        return False
    assert rows is not None
    rows[me] = mine
    if me < 2 * r:
        coll.step = 1
        coll.recv(me - 1, rows[me - 1], fold)
        v = me // 2
    else:
        v = me - r

    def first(u: int) -> int:  # the first real rank of virtual rank u
        return u + min(u, r)

    for k in range(rounds):
        coll.step = k + 1 + (1 if r else 0)
        pv = v ^ (1 << k)
        a, b = v & ~((1 << k) - 1), pv & ~((1 << k) - 1)
        peer = 2 * pv + 1 if pv < r else pv + r
        out = rows[first(a): first(a + (1 << k))].reshape(-1)  # 1-D: a memoryview of (k, 0) cannot be cast
        coll.sendrecv(peer, out, rows[first(b): first(b + (1 << k))].reshape(-1), rnd)
    return True


def rd_result(coll: Coll, result: np.ndarray, unfold: int) -> None:
    """Hand the finished ``result`` to the partner that sat out (or, on that partner, receive it)."""
    n, me = coll.size, coll.rank
    _, r, _ = _shape(n)
    if me >= 2 * r:
        return
    coll.step = coll.steps
    if sits_out(n, me):
        coll.recv(me + 1, result, unfold)
    else:
        coll.send(me - 1, result, unfold)

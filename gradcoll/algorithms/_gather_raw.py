"""Whole-buffer gathers for the reductions that must see every raw contribution.

The deterministic allreduce and the low-precision wire allreduce reduce
each element in one place from all ``n`` contributions (so the result does
not depend on how partial sums were grouped). Their ``star`` schedule
gathers the inputs on rank 0 and sends the result back (``raw_star``).
Their ``recursive_doubling`` schedule (``raw_recursive_doubling``) is an allgather
of the inputs in ``log2 p`` rounds (``p`` the largest power of two <= ``n``)
followed by a local reduction:

* virtual rank ``v`` holds real ranks ``2v, 2v+1`` for ``v < r = n - p``
  (the even one folds its buffer into the odd one first) and ``v + r``
  otherwise, so an aligned block of virtual ranks is a contiguous range of
  real ranks, and every round is one message each way: ``2**k`` rows out,
  ``2**k`` rows in (more where folded ranks sit);
* afterwards ``rows[i]`` holds rank ``i``'s buffer on every rank that took
  part; the ranks that sat out get the result from their partner.

Bytes per rank: ``(p - 1)`` buffers, against ``log2 p`` for a
recursive doubling of partial sums: the latency schedule for small buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import tags
from ._common import Coll
from .recursive_doubling import butterfly

__all__ = ["raw_star", "raw_recursive_doubling"]


def raw_star(coll: Coll, mine: np.ndarray, make_rows: Callable[[], np.ndarray],
             reduce: Callable[[np.ndarray, Callable[[int], object]], None]) -> None:
    """The star (2 steps), ``mine`` in place. Any rank but 0 sends ``mine`` and receives the result into it.

    Rank 0 receives every other rank's ``mine`` into ``make_rows()[p - 1]``
    and calls ``reduce(rows, wait)``, which reduces them into ``mine``
    (``wait(p)`` waits for rank ``p``'s row: call it in rank order), then
    sends ``mine`` to everyone.
    """
    up, down = coll.tag0 + tags.RAW_UP, coll.tag0 + tags.RAW_DOWN
    coll.begin(2)
    coll.step = 1
    if coll.rank != 0:
        r = coll.irecv(0, mine, down)  # rank 0 replies only after it has read ``up`` whole
        coll.send(0, mine, up)
        coll.step = 2
        coll.wait(r, 0)
        return
    rows = make_rows()
    reqs = [coll.irecv(p, rows[p - 1], up) for p in range(1, coll.size)]
    reduce(rows, lambda p: coll.wait(reqs[p - 1], p))
    coll.step = 2
    for req, p in [(coll.isend(p, mine, down), p) for p in range(1, coll.size)]:
        coll.wait(req, p)


def raw_recursive_doubling(coll: Coll, mine: np.ndarray, make_rows: Callable[[], np.ndarray],
                           reduce: Callable[[np.ndarray], None]) -> None:
    """Gather every rank's ``mine`` into ``rows = make_rows()`` (``(n, m)``), ``reduce(rows)`` into ``mine``.

    A rank that sits out sends ``mine`` to its partner instead and receives
    the result from it into ``mine`` at the end.
    """
    n, me = coll.size, coll.rank
    r = n - (1 << (n.bit_length() - 1))
    rows = np.empty((0, mine.size), mine.dtype)

    def first(u: int) -> int:  # the first real rank of virtual rank u
        return u + min(u, r)

    def fold_in(partner: int, tag: int) -> None:
        coll.recv(partner, rows[partner], tag)

    def exchange(k: int, v: int, peer: int, tag: int) -> None:
        a, b = v & ~((1 << k) - 1), (v ^ (1 << k)) & ~((1 << k) - 1)
        out = rows[first(a): first(a + (1 << k))].reshape(-1)  # 1-D: a memoryview of (k, 0) cannot be cast
        coll.sendrecv(peer, out, rows[first(b): first(b + (1 << k))].reshape(-1), tag)

    if not (me < 2 * r and me % 2 == 0):  # a rank that sits out needs no rows
        rows = make_rows()
        rows[me] = mine
    butterfly(coll, mine, (tags.RAW_FOLD, tags.RAW_ROUND, tags.RAW_UNFOLD), fold_in, exchange, lambda: reduce(rows))

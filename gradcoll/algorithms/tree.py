"""Binomial-tree allreduce: a binomial reduce to rank 0, then a binomial broadcast of the result.

Rank ``q``'s parent is ``q`` with its lowest set bit cleared; its children
are ``q + 2**k`` for every ``2**k`` below that bit (below ``n``, for rank 0).

1. Reduce (phase ``STAR_UP``): a rank receives its children's partial sums
   in order of increasing distance, adds each into its buffer, and sends the
   buffer to its parent. Rank 0 ends with the total; ``mean`` divides by
   ``n`` in the fused kernel call of its last addition.
2. Broadcast (phase ``STAR_DOWN``): the result travels back down the same
   tree, farthest children first.

``2 ceil(log2 n)`` steps, ``S`` bytes per message, any world size; rank 0
receives ``ceil(log2 n) S`` instead of the star's ``(n - 1) S``. One rank
finishes every element and the others copy it, so the result is bitwise
identical on every rank. The phases are the star's: its descriptor tag (which
names the algorithm) keeps its frames apart from the star's.

The rows form (``tree_rows``) sends raw rows up the same tree: a rank
forwards its subtree's rows, contiguous by rank, and rank 0 reduces all
``n`` of them at once. See docs/algorithms/tree.md.
"""

from __future__ import annotations

import numpy as np

from ..model.work import Work, register_work
from ..transport.base import Transport
from . import tags
from ._common import Coll, Options, Workspace, combiner, scratch
from ._guard import guarded_allreduce
from .rows import RowsCall

__all__ = ["tree_allreduce", "tree_pass", "tree_rows", "tree_work"]

NAME = "tree allreduce"


def tree_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                   seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                   backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place by a binomial reduce to rank 0 and a binomial broadcast; returns ``buf``."""
    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name=NAME, algo="tree", body=tree_pass)


def _links(rank: int, n: int) -> tuple[int | None, list[int], int]:
    """``(parent, children, end)`` of ``rank``: children nearest first (rank 0 has no parent); its subtree is
    the ranks ``rank .. end - 1``."""
    low = rank & -rank if rank else 1 << max(0, (n - 1).bit_length())
    children = [rank + d for d in (1 << k for k in range(low.bit_length() - 1)) if rank + d < n]
    return (rank - low if rank else None), children, min(n, rank + low)


def tree_pass(coll: Coll, flat: np.ndarray, opts: Options) -> None:
    """The schedule over ``flat``: partial sums up the tree, the result down."""
    n, q = coll.size, coll.rank
    parent, children, _ = _links(q, n)
    steps = 2 * max(1, (n - 1).bit_length())
    up, down = coll.tag0 + tags.STAR_UP, coll.tag0 + tags.STAR_DOWN
    combine = combiner(opts, n)
    coll.marks = (0,)
    coll.begin(steps)
    tmp = scratch(opts.workspace, "tree", (2, max(1, flat.size)), flat.dtype)
    reqs = [coll.irecv(c, tmp[i % 2, : flat.size], up) for i, c in enumerate(children[:2])]
    for i, c in enumerate(children):
        coll.step = i + 1
        coll.wait(reqs[i], c)
        if flat.size:
            combine(flat, tmp[i % 2, : flat.size], parent is None and i == len(children) - 1)
        if i + 2 < len(children):
            reqs.append(coll.irecv(children[i + 2], tmp[i % 2, : flat.size], up))
    if parent is not None:
        coll.step = steps // 2
        got = coll.irecv(parent, flat, down)  # the parent replies only after it has read ``up`` whole
        coll.send(parent, flat, up)
        coll.wait(got, parent)
    coll.step = steps // 2 + 1
    sends = [(coll.isend(c, flat, down), c) for c in reversed(children)]
    for req, c in sends:
        coll.wait(req, c)


def tree_rows(coll: Coll, call: RowsCall) -> None:
    """The rows form: each rank's subtree is the ranks ``q .. q + low - 1``, so its rows travel up as one block."""
    data, n, q = call.data, coll.size, coll.rank
    parent, children, end = _links(q, n)
    steps = 2 * max(1, (n - 1).bit_length())
    up, down = coll.tag0 + tags.RAW_UP, coll.tag0 + tags.RAW_DOWN
    coll.marks = (0,)
    coll.begin(steps)
    rows = call.scratch("tree", (end - q, data.size))
    rows[0] = data
    reqs = [(coll.irecv(c, rows[c - q: min(end, 2 * c - q) - q].reshape(-1), up), c) for c in children]
    for i, (req, c) in enumerate(reqs):
        coll.step = i + 1
        coll.wait(req, c)
    if parent is None:
        call.rows.reduce(rows, data)
    else:
        coll.step = steps // 2
        got = coll.irecv(parent, data, down)
        coll.send(parent, rows.reshape(-1), up)
        coll.wait(got, parent)
    coll.step = steps // 2 + 1
    for req, c in [(coll.isend(c, data, down), c) for c in reversed(children)]:
        coll.wait(req, c)


def tree_work(n: int, s: float) -> Work:
    """The cost model's terms: ``2 ceil(log2 n)`` messages of ``S`` on the critical path (rank 0's), which adds
    ``ceil(log2 n)`` contributions; every other rank adds its children's and copies in and out."""
    depth = float((n - 1).bit_length())
    return Work(2.0 * depth, 2.0 * depth * s, depth * s, 4.0 * depth * s, s, 3.0 * s, 0.0, s)


register_work("tree", tree_work)

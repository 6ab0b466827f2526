"""Star allreduce: everyone sends to rank 0, rank 0 reduces in one fused pass, then sends the result back.

A non-root sends its whole buffer to rank 0 and waits for the result. Rank 0
receives the rows into a preallocated ``n x count`` buffer whose row ``p`` is
rank ``p``'s contribution (its own input copied into row 0). One call of the
fused [`mean_reduce`][gradcoll.kernels.mean_reduce] adds the rows in rank order
0..n-1, divides (for ``mean``) and checks every element for NaN/Inf (an
overflow plants a NaN in element 0 of the result); ``max``/``min`` use NumPy,
which carries the NaN a bad input was planted as. Rank 0 then sends every
rank the result. Mismatches, timeouts and non-finite results are found as in
every allreduce (``gradcoll.algorithms._guard``): no agreement round precedes the data.

Summation is in rank order, so the result is bitwise equal to
``numpy.sum(rows, axis=0)`` in rank order (divided by ``n`` for ``mean``),
and identical on every rank. Each non-root sends ``S`` bytes and receives
``S``; rank 0 receives and sends ``(n - 1) S``. Two communication steps.
See docs/algorithms/star.md.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import NonFiniteError
from ..transport.base import Transport
from . import tags
from ._common import Coll, Options, Workspace, plant, scratch
from ._guard import guarded_allreduce
from .rows import RowsCall

__all__ = ["star_allreduce", "star_rows"]

ROOT = 0


def star_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True, seq: int = 0,
                   timeout: float | None = None, workspace: Workspace | None = None,
                   backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place through rank 0; returns ``buf``."""
    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name="star allreduce", algo="star", body=_star)


def _star(coll: Coll, flat: np.ndarray, opts: Options) -> None:
    if coll.rank == ROOT:
        _root(coll, flat, opts)
        return
    coll.begin(2)
    coll.step = 1
    up = coll.isend(ROOT, flat, coll.tag0 + tags.STAR_UP)
    down = coll.irecv(ROOT, flat, coll.tag0 + tags.STAR_DOWN)  # rank 0 replies only after reading ``up``
    coll.wait(up, ROOT)
    coll.step = 2
    coll.wait(down, ROOT)


def _root(coll: Coll, flat: np.ndarray, opts: Options) -> None:
    n = coll.size
    coll.begin(2)
    coll.step = 1
    rows = scratch(opts.workspace, "star", (n, flat.size), flat.dtype)
    up = coll.tag0 + tags.STAR_UP
    reqs = [coll.irecv(p, rows[p], up) for p in range(1, n)]
    np.copyto(rows[0], flat)
    for p, req in zip(range(1, n), reqs, strict=True):
        coll.wait(req, p)
    if flat.size:
        _reduce_rows(rows, flat, opts)
    coll.step = 2
    down = coll.tag0 + tags.STAR_DOWN
    sends = [coll.isend(p, flat, down) for p in range(1, n)]
    for p, req in zip(range(1, n), sends, strict=True):
        coll.wait(req, p)


def _reduce_rows(rows: np.ndarray, flat: np.ndarray, opts: Options) -> None:
    """Reduce ``rows`` into ``flat`` in rank order; a NaN/Inf in a sum is marked at element 0."""
    if opts.op in ("mean", "sum"):
        try:
            kernels.mean_reduce(rows, out=flat, op=opts.op, check_finite=opts.check_finite, backend=opts.backend)
        except NonFiniteError:
            plant(flat)
        return
    (np.maximum if opts.op == "max" else np.minimum).reduce(rows, axis=0, out=flat)


def star_rows(coll: Coll, call: RowsCall) -> None:
    """The star's rows form (``gradcoll.algorithms.rows``): rank 0 gathers every row, reduces, sends the result.

    Two steps; rank 0 receives and sends ``(n - 1) S``, the others ``S``.
    """
    data, n = call.data, coll.size
    up, down = coll.tag0 + tags.RAW_UP, coll.tag0 + tags.RAW_DOWN
    coll.marks = (0,)
    coll.begin(2)
    coll.step = 1
    if coll.rank != ROOT:
        r = coll.irecv(ROOT, data, down)  # rank 0 replies only after it has read ``up`` whole
        coll.send(ROOT, data, up)
        coll.step = 2
        coll.wait(r, ROOT)
        return
    rows = call.scratch("star", (n, data.size))
    reqs = [coll.irecv(p, rows[p], up) for p in range(1, n)]
    rows[0] = data
    for p in range(1, n):
        coll.wait(reqs[p - 1], p)
    call.rows.reduce(rows, data)
    coll.step = 2
    for req, p in [(coll.isend(p, data, down), p) for p in range(1, n)]:
        coll.wait(req, p)

"""Star allreduce: everyone sends to rank 0, rank 0 reduces in one fused pass, then sends the result back.

The handshake is folded into the data movement. A non-root sends its
handshake record and, right behind it, its whole buffer; then it waits for
the table and, if the verdict is good, for the result. Rank 0 collects the
records; only if every rank called the same thing does it receive the rows,
into a preallocated ``n x count`` buffer whose row ``p`` is rank ``p``'s
contribution (its own input copied into row 0). One call of the fused
:func:`~gradcoll.kernels.mean_reduce` adds the rows in rank order 0..n-1,
divides (for ``mean``) and checks every element for NaN/Inf; ``max``/``min``
check each row and use NumPy. Rank 0 then sends every rank the table (with
the reduction's outcome in the result slot) followed by the result.

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
from ._common import Coll, Workspace, as_flat, check_op, data_tag, scratch
from ._handshake import (
    NONFINITE,
    OK,
    ROOT,
    Record,
    gather_records,
    handshake,
    local_status,
    make_record,
    receive_all,
    recv_table,
    send_record,
    send_table,
    verdict,
)

__all__ = ["star_allreduce"]

_UP, _DOWN = 2, 3


def star_allreduce(
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
    """Allreduce ``buf`` in place through rank 0; returns ``buf``."""
    flat = as_flat(buf, reduce=True)
    check_op(op)
    coll = Coll(transport, "star allreduce", seq, flat.nbytes, timeout)
    if coll.size == 1:
        status = local_status(flat, check_finite, backend)
        handshake(coll, make_record("allreduce", "star", op, flat.dtype, flat.size, seq, status=status))
        return buf  # the mean of one contribution is itself
    rec = make_record("allreduce", "star", op, flat.dtype, flat.size, seq)
    if coll.rank == ROOT:
        _root(coll, flat, op, check_finite, rec, workspace, backend)
    else:
        send_record(coll, rec)
        up = coll.isend(ROOT, flat, data_tag(seq, _UP))
        # Wait for the verdict before the send completes: rank 0 does not read
        # the rows of a collective it rejects.
        verdict(coll, recv_table(coll, phases=2))
        coll.begin(2)
        coll.step = 1
        coll.wait(up, ROOT)
        coll.step = 2
        coll.recv(ROOT, flat, data_tag(seq, _DOWN))
    return buf


def _root(coll: Coll, flat: np.ndarray, op: str, check: bool, rec: Record, ws: Workspace | None,
          backend: str | None) -> None:
    n = coll.size
    table = gather_records(coll, rec)
    if any(s.status != OK or s.desc() != rec.desc() for s in table[:n]):
        send_table(coll, table)
        verdict(coll, table)  # raises
    coll.begin(2)
    coll.step = 1
    rows = scratch(ws, "star", (n, flat.size), flat.dtype)
    np.copyto(rows[0], flat)
    failed = receive_all(coll, {p: rows[p] for p in range(1, n)}, data_tag(coll.seq, _UP))
    for p, status in failed.items():
        table[p] = table[p]._replace(status=status)
    if all(s.status == OK for s in table[:n]):
        _reduce_rows(rows, flat, op, check, coll, table, backend)
    send_table(coll, table)
    coll.step = 2
    verdict(coll, table)
    out = data_tag(coll.seq, _DOWN)
    sends = [coll.isend(p, flat, out) for p in range(1, n)]
    for p, req in zip(range(1, n), sends):
        coll.wait(req, p)


def _reduce_rows(rows: np.ndarray, flat: np.ndarray, op: str, check: bool, coll: Coll, table: list[Record],
                 backend: str | None) -> None:
    """Reduce ``rows`` into ``flat``; on NaN/Inf put the lowest bad rank (or the overflow) in the result slot."""
    n = coll.size
    overflow: NonFiniteError | None = None
    if op in ("mean", "sum"):
        try:
            kernels.mean_reduce(rows, out=flat, op=op, check_finite=check, backend=backend)
            return
        except NonFiniteError as exc:
            overflow = exc
    elif not check or all(local_status(rows[p], True, backend) is None for p in range(n)):
        # max/min can hide a NaN/Inf (max(-inf, 1) is 1), hence the row checks first.
        (np.maximum if op == "max" else np.minimum).reduce(rows, axis=0, out=flat)
        return
    # Error path only: name the lowest rank whose input is bad, as the other algorithms do.
    for p in range(n):
        status = local_status(rows[p], True, backend)
        if status is not None:
            table[n] = table[n]._replace(status=NONFINITE, peer=p, index=status[1], value=status[2])
            return
    index = -1 if overflow is None or overflow.index is None else int(overflow.index)
    value = float("inf") if overflow is None or overflow.value is None else float(overflow.value)
    table[n] = table[n]._replace(status=NONFINITE, peer=-1, index=index, value=value)

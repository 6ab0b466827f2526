"""Ring reduce-scatter: every rank ends with its own chunk of the reduced buffer.

This is the first half of the ring allreduce (see ``gradcoll.algorithms.ring``), with the
schedule rotated by one so that rank ``q`` finishes with chunk ``q`` of the
near-equal split (the first ``count % n`` chunks one element longer). Each
rank sends ``(n - 1) / n * S`` bytes in ``n - 1`` steps. Other parts of the
buffer are used as scratch and hold partial sums afterwards.

Only the owner of a chunk sees its final value, so when ``check_finite`` is
on and the op can overflow (mean, sum) a second handshake round lets every
rank learn whether any chunk overflowed: no rank returns while another
halts. See docs/algorithms/collectives.md.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Transport
from ._common import Coll, Options, Workspace, as_flat, check_op, chunk_bounds
from ._handshake import handshake, local_status, make_record
from .ring import SEGMENT_BYTES, ring_pass

__all__ = ["reduce_scatter"]


def reduce_scatter(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True, seq: int = 0,
                   timeout: float | None = None, segment_bytes: int = SEGMENT_BYTES, workspace: Workspace | None = None,
                   backend: str | None = None) -> np.ndarray:
    """Reduce ``buf`` across ranks; returns the view of ``buf`` holding this rank's reduced chunk."""
    flat = as_flat(buf, reduce=True)
    check_op(op)
    n, me = transport.size, transport.rank
    coll = Coll(transport, "ring reduce_scatter", seq, flat.nbytes, timeout)
    status = local_status(flat, check_finite, backend)
    handshake(coll, make_record("reduce_scatter", "ring", op, flat.dtype, flat.size, seq, status=status))
    bounds = chunk_bounds(flat.size, n)
    mine = flat[bounds[me] : bounds[me + 1]]
    if n == 1 or flat.size == 0:
        return mine
    ring_pass(coll, flat, Options(op, check_finite, seq, timeout, workspace, backend), allgather=False, shift=-1,
              segment_bytes=segment_bytes)
    if check_finite and op in ("mean", "sum"):
        status = local_status(mine, True, backend)
        if status is not None:
            status = (status[0], status[1] + bounds[me], status[2])
        coll.begin(0)  # a fresh deadline for the agreement round
        handshake(coll, make_record("reduce_scatter", "ring", op, flat.dtype, flat.size, seq, status=status),
                  overflow=True)
    return mine

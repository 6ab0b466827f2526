"""Ring allgather: every rank ends with every rank's buffer, stacked in rank order.

Rank ``q`` first copies its own buffer into row ``q`` of the output. In step
``s`` (``0 .. n-2``) it sends row ``q - s`` to ``q + 1`` and receives row
``q - s - 1`` from ``q - 1``, the row it forwards in the next step. Each rank
sends and receives ``(n - 1) S`` bytes in ``n - 1`` steps (``S`` = one
rank's buffer); no row is ever written twice. Any dtype works. See
docs/algorithms/collectives.md.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..transport.base import Request, Transport
from . import tags
from ._common import Coll, as_flat
from ._handshake import handshake, make_record

__all__ = ["allgather"]


def allgather(
    transport: Transport,
    buf: np.ndarray,
    out: np.ndarray | None = None,
    *,
    seq: int = 0,
    timeout: float | None = None,
) -> np.ndarray:
    """Gather every rank's ``buf`` into ``out`` of shape ``(size, *buf.shape)``; returns ``out``."""
    flat = as_flat(buf, reduce=False)
    n, me = transport.size, transport.rank
    shape = (n,) + tuple(buf.shape)
    if out is None:
        out = np.empty(shape, buf.dtype)
    elif not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != buf.dtype:
        raise UsageError(f"rank {me}: allgather out must be a {buf.dtype} array of shape {shape}")
    rows = as_flat(out, reduce=False, what="out").reshape(n, flat.size)
    coll = Coll(transport, "allgather", seq, flat.nbytes, timeout)
    handshake(coll, make_record("allgather", "ring", None, flat.dtype, flat.size, seq))
    rows[me] = flat
    if n == 1:
        return out
    right, left = (me + 1) % n, (me - 1) % n
    tag = coll.tag0 + tags.ALLGATHER
    sends: list[Request] = []
    coll.begin(n - 1)
    for s in range(n - 1):
        coll.step = s + 1
        req = coll.irecv(left, rows[(me - s - 1) % n], tag)
        sends.append(coll.isend(right, rows[(me - s) % n], tag))
        coll.wait(req, left)
    for req in sends:
        coll.wait(req, right)
    return out

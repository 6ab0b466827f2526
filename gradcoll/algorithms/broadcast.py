"""Broadcast along a binomial tree rooted at ``root``.

Ranks are renumbered relative to the root (``v = (rank - root) mod n``). A
rank ``v > 0`` receives from ``v`` with its lowest set bit cleared, then
forwards to ``v + m`` for every power of two ``m`` below that bit (largest
subtree first); the root forwards to ``1, 2, 4, ...``. Every rank receives
the buffer exactly once, so ``S`` bytes reach each non-root, in
``ceil(log2 n)`` steps; the root sends ``S`` to ``ceil(log2 n)`` children.
Any dtype works (no arithmetic). See docs/algorithms/collectives.md.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..transport.base import Request, Transport
from . import tags
from ._common import Coll, as_flat
from ._handshake import handshake, make_record

__all__ = ["broadcast"]


def broadcast(
    transport: Transport, buf: np.ndarray, *, root: int = 0, seq: int = 0, timeout: float | None = None
) -> np.ndarray:
    """Copy rank ``root``'s ``buf`` into ``buf`` on every rank, in place; returns ``buf``."""
    flat = as_flat(buf, reduce=False)
    n, me = transport.size, transport.rank
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise UsageError(f"rank {me}: broadcast root {root!r} out of range for world size {n}")
    root = int(root)
    coll = Coll(transport, "broadcast", seq, flat.nbytes, timeout)
    handshake(coll, make_record("broadcast", "tree", None, flat.dtype, flat.size, seq, root=root))
    if n == 1:
        return buf
    tag = coll.tag0 + tags.BROADCAST
    v = (me - root) % n
    coll.begin(max(1, (n - 1).bit_length()))
    if v:
        low = v & -v
        coll.step = low.bit_length()
        coll.recv((v - low + root) % n, flat, tag)
    else:
        low = 1 << (n - 1).bit_length()
        coll.step = 1
    sends: list[tuple[int, Request]] = []
    m = low >> 1
    while m:
        if v + m < n:
            child = (v + m + root) % n
            sends.append((child, coll.isend(child, flat, tag)))
        m >>= 1
    for child, req in sends:
        coll.wait(req, child)
    return buf

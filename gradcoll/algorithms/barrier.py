"""Barrier: no rank leaves before every rank has arrived.

It is the handshake alone (see ``gradcoll.algorithms._handshake``): every rank sends rank 0
a 64-byte record, rank 0 answers each once it has heard from all. Two
communication steps; rank 0 handles ``2 (n - 1)`` tiny messages. A rank that
does not arrive is named in the CollectiveTimeout every other rank raises.
"""

from __future__ import annotations

from ..transport.base import Transport
from ._common import Coll
from ._handshake import handshake, make_record

__all__ = ["barrier"]


def barrier(transport: Transport, *, seq: int = 0, timeout: float | None = None) -> None:
    """Block until every rank has called barrier (or raise naming who did not)."""
    if transport.shared_memory and transport.size > 1:  # one host: through the shared window
        from .window_collectives import window_barrier

        window_barrier(transport, seq=seq, timeout=timeout)
        return
    coll = Coll(transport, "barrier", seq, 0, timeout)
    handshake(coll, make_record("barrier", "-", None, None, 0, seq))

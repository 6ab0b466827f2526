"""Broadcast, allgather, reduce_scatter and barrier over the group's shared window (one host).

The engines of the direct allreduce (``_window_plan``, ``_direct_c``), with
another step in the middle, run these; so do their descriptors, ticks and
error path (``_window_run``). Every rank publishes its arrival with its
descriptor, so every collective here is also a barrier that detects a
mismatched call, and a late, dead or closed rank is named as in the
allreduce.

* ``barrier``: one empty piece: publish, wait for everyone, compare.
* ``broadcast``: the root copies its buffer into its slot (in pieces); every
  other rank copies it out. ``S`` in at the root, ``S`` out everywhere else,
  instead of ``log2 n`` hops through pair rings.
* ``allgather``: every rank copies its buffer in; every rank copies all
  ``n`` slots out, in rank order: ``S`` in, ``n S`` out.
* ``reduce_scatter``: the first half of the two-shot allreduce: rank ``q``
  reduces chunk ``q`` from every slot, in rank order, and keeps it.

The transports whose ranks share memory run these in place of the
point-to-point versions (``broadcast``, ``allgather``, ``reduce_scatter``,
``barrier`` hand over when ``transport.shared_memory``). See
docs/algorithms/collectives.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transport.base import Transport
from ._window_plan import BCAST, GATHER, OPS, PLAIN, describe, shape
from ._window_run import group_window, run

__all__ = ["window_barrier", "window_broadcast", "window_allgather", "window_reduce_scatter", "PIECE_BYTES"]

#: Bytes per piece of a broadcast or an allgather.
PIECE_BYTES = 256 << 10
_EMPTY = np.empty(0, np.uint8)


def window_barrier(t: Transport, *, seq: int, timeout: float | None) -> None:
    """Return once every rank has arrived (a CollectiveTimeout naming the ranks that did not, else)."""
    win = group_window(t, timeout, "barrier", seq)

    def build() -> tuple[Any, bytes]:
        return (shape(t.size, 0, _EMPTY.dtype, win.slot_bytes, two=False, op=GATHER, variant=PLAIN,
                      piece_bytes=PIECE_BYTES, seg_bytes=PIECE_BYTES), describe("barrier", None, None, 0, seq))

    run(t, win, ("barrier",), build, _EMPTY, None, name="barrier", seq=seq, timeout=timeout, check=False)


def window_broadcast(t: Transport, flat: np.ndarray, *, root: int, seq: int, timeout: float | None) -> None:
    """Copy rank ``root``'s ``flat`` (C-contiguous, any dtype) into ``flat`` on every rank."""
    win = group_window(t, timeout, "broadcast", seq, flat.nbytes)
    raw = flat.view(np.uint8)

    def build() -> tuple[Any, bytes]:
        return (shape(t.size, raw.size, raw.dtype, win.slot_bytes, two=False, op=BCAST, variant=PLAIN,
                      piece_bytes=PIECE_BYTES, seg_bytes=PIECE_BYTES, root=root),
                describe("broadcast", None, flat.dtype, flat.size, seq, root=root))

    run(t, win, ("broadcast", raw.size, flat.dtype.char, root), build, raw, None, name="broadcast", seq=seq,
        timeout=timeout, check=False)


def window_allgather(t: Transport, flat: np.ndarray, rows: np.ndarray, *, seq: int, timeout: float | None) -> None:
    """Every rank's ``flat`` into row ``r`` of ``rows`` (``(n, flat.size)``, C-contiguous), on every rank."""
    win = group_window(t, timeout, "allgather", seq, flat.nbytes)
    raw = flat.view(np.uint8)

    def build() -> tuple[Any, bytes]:
        return (shape(t.size, raw.size, raw.dtype, win.slot_bytes, two=False, op=GATHER, variant=PLAIN,
                      piece_bytes=PIECE_BYTES, seg_bytes=PIECE_BYTES),
                describe("allgather", None, flat.dtype, flat.size, seq))

    run(t, win, ("allgather", raw.size, flat.dtype.char), build, raw, rows.reshape(-1).view(np.uint8),
        name="allgather", seq=seq, timeout=timeout, check=False)


def window_reduce_scatter(t: Transport, flat: np.ndarray, *, op: str, check_finite: bool, seq: int,
                          timeout: float | None, backend: str | None = None) -> None:
    """Reduce ``flat`` across ranks; chunk ``r`` of ``chunk_bounds`` ends on rank ``r`` (the rest is unchanged)."""
    from .direct import SEG_BYTES

    win = group_window(t, timeout, "direct reduce_scatter", seq, flat.nbytes)

    def build() -> tuple[Any, bytes]:
        return (shape(t.size, flat.size, flat.dtype, win.slot_bytes, two=True, op=OPS[op], variant=PLAIN,
                      piece_bytes=SEG_BYTES, seg_bytes=SEG_BYTES, scatter=True),
                describe("reduce_scatter", op, flat.dtype, flat.size, seq, extra=(int(check_finite),)))

    run(t, win, ("reduce_scatter", flat.size, flat.dtype.char, op, check_finite), build, flat, None,
        name="direct reduce_scatter", seq=seq, timeout=timeout, check=check_finite, backend=backend)

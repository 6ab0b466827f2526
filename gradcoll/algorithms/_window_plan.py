"""The plan of a collective over a shared window: where each piece lives, its descriptor, its engine.

A *shape* is what every rank computes from the call alone (so every rank
computes the same one): one-shot or two-shot, how the buffer is cut into
pieces, where piece ``k`` of rank ``r`` sits in the window, and where a
reducer puts its share's result. ``Shape.engine`` builds what runs it: the
compiled ``_direct_c.Plan`` where the extension is built, else the Python
``_window_py.PyPlan``, with one interface (``start``, ``run``, ``pieces``,
``waited``).

Geometry. A window slot of ``slot_bytes`` holds a ring of ``DEPTH``
buffers of ``ring`` bytes (two thirds of the slot) and then a ring of
``DEPTH`` result buffers of ``rslot`` bytes. Piece ``k`` of a collective
whose first tick is ``t0`` uses buffer ``(t0 + k) % DEPTH``.

* One-shot: piece ``k`` is elements ``[k P, (k+1) P)``; every rank reads
  that piece from every slot and reduces it into its own buffer.
* Two-shot: the buffer is split into ``n`` near-equal chunks
  (``chunk_bounds``); piece ``k`` is segment ``k`` of every chunk, share
  ``q`` of it segment ``k`` of chunk ``q``, which rank ``q`` reduces into its
  result buffer; every rank then copies every share out.
* An allocated buffer (``ProcessGroup.alloc``) already sits in a *region*:
  slot ``r`` of another window holds rank ``r``'s array at the same offset.
  Its pieces are read there (nothing is copied in); it runs two-shot.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import exact_reference, lowp_reference, reference
from ..transport.base import Window
from ._common import chunk_bounds
from ._handshake import RECORD_SIZE, Record, pack, unpack, with_status

__all__ = ["Shape", "shape", "describe", "Engine", "OPS", "PLAIN", "EXACT", "BF16", "FP16", "GATHER", "BCAST",
           "DEPTH", "PAGE"]

PAGE = 4096
DEPTH = 4
#: Op codes and variants of the engines (``_direct_c`` has the same numbers).
OPS = {"mean": 0, "sum": 1, "max": 2, "min": 3}
GATHER, BCAST = 4, 5
PLAIN, EXACT, BF16, FP16 = 0, 1, 2, 3
_LIMIT = {np.dtype(np.float32): 2.0**128 - 2.0**103, np.dtype(np.float64): math.inf}

Engine = Any  # _direct_c.Plan or _window_py.PyPlan


@dataclass(frozen=True)
class Shape:
    """The geometry of one collective's call (see the module docstring); the same on every rank."""

    n: int
    two: bool
    op: int
    variant: int
    dtype: np.dtype[Any]
    count: int
    item: int  # bytes of an element in the caller's buffer
    witem: int  # bytes of an element in the window (2 on a bf16/fp16 wire)
    piece: int  # one-shot: elements per piece
    seg: int  # two-shot: elements per share of a piece
    bounds: tuple[int, ...]
    depth: int
    ring: int
    rslot: int
    res_off: int
    npieces: int
    region: tuple[Window, int] | None = None  # the window holding an allocated buffer, and its offset
    root: int = -1
    scatter: bool = False

    def share(self, k: int, q: int) -> tuple[int, int]:
        """Elements ``[a, b)`` of share ``q`` of piece ``k`` (two-shot), or of piece ``k`` (one-shot)."""
        if self.two:
            a = self.bounds[q] + k * self.seg
            b = min(a + self.seg, self.bounds[q + 1])
            return min(a, b), b
        a = k * self.piece
        return a, min(a + self.piece, self.count)

    def data(self, win: Window, r: int, t0: int, k: int, q: int) -> np.ndarray:
        """Rank ``r``'s copy of share ``q`` of piece ``k`` as bytes (a view into the window)."""
        a, b = self.share(k, q)
        if self.region is not None:
            rwin, off = self.region
            start = off + (a if self.two else k * self.piece) * self.witem
            return rwin.slot(r)[start: start + (b - a) * self.witem]  # type: ignore[no-any-return]
        start = ((t0 + k) % self.depth) * self.ring + (q * self.seg if self.two else 0) * self.witem
        return win.slot(r)[start: start + (b - a) * self.witem]  # type: ignore[no-any-return]

    def result(self, win: Window, r: int, t0: int, k: int) -> np.ndarray:
        """Rank ``r``'s result buffer for piece ``k`` (two-shot), as bytes."""
        start = self.res_off + ((t0 + k) % self.depth) * self.rslot
        return win.slot(r)[start: start + self.rslot]  # type: ignore[no-any-return]

    def engine(self, win: Window, desc: bytes, check: bool, compiled: Any, python: Any) -> Engine:
        """The compiled plan (``compiled`` is ``_direct_c``) or, without it, the Python one (``python``:
        ``_window_py.PyPlan``, passed in so that this module does not import the one that imports it)."""
        dt = self.dtype
        divisor = float(self.n) if self.op == OPS["mean"] else 1.0
        mode, factor = reference.finish(divisor, dt)  # the one rule: multiply only where it is exact in dt
        recip = factor if mode == reference.MUL else 0.0
        exact = exact_reference.params(dt, self.n) if self.variant == EXACT else (0, 0, 0)
        table = lowp_reference.fp16_table() if self.variant == FP16 else None
        limit = _LIMIT.get(dt, math.inf)
        if compiled is not None:
            region = None
            if self.region is not None:
                lay = self.region[0].layout()
                region = (lay.address + lay.slots, lay.stride, self.region[1])
            return compiled.Plan(win.layout(), getattr(win, "spin_s", 0.0), getattr(win, "yields", 0), two=self.two,
                                 op=self.op, variant=self.variant, f64=dt == np.float64, check=check,
                                 count=self.count, item=self.item, witem=self.witem, piece=self.piece, seg=self.seg,
                                 bounds=list(self.bounds), depth=self.depth, ring=self.ring, rslot=self.rslot,
                                 res_off=self.res_off, divisor=divisor, recip=recip, limit=limit,
                                 exact=tuple(int(v) for v in exact), table=table, desc=desc, region=region,
                                 root=self.root, scatter=self.scatter)
        return python(self, win, desc, check, divisor, backend=None)


def shape(n: int, count: int, dtype: np.dtype[Any], slot_bytes: int, *, two: bool, op: int, variant: int,
          piece_bytes: int, seg_bytes: int, region: tuple[Window, int] | None = None, root: int = -1,
          scatter: bool = False) -> Shape:
    """The shape of a call of ``count`` elements of ``dtype`` on ``n`` ranks over slots of ``slot_bytes``."""
    item = dtype.itemsize
    witem = 2 if variant in (BF16, FP16) else item
    ring = (2 * slot_bytes // 3 // DEPTH) // PAGE * PAGE
    rslot = ring // 2 // 64 * 64
    bounds = tuple(chunk_bounds(count, n))
    piece = seg = 1
    if two or region is not None:
        two = True
        room = rslot if region is not None else min(ring // n, rslot)
        seg = max(1, min(seg_bytes, room) // witem)
        npieces = max(1, -(-(bounds[1] - bounds[0]) // seg))
    else:
        piece = max(1, min(piece_bytes, ring) // witem)
        npieces = max(1, -(-count // piece))
    return Shape(n, two, op, variant, dtype, count, item, witem, piece, seg, bounds, DEPTH, ring, rslot,
                 DEPTH * ring, npieces, region, root, scatter)


_EXTRA = struct.Struct("<I")


def describe(kind: str, op: str | None, dtype: np.dtype[Any] | None, count: int, seq: int, *, root: int = -1,
             extra: tuple[int, ...] = ()) -> bytes:
    """A window descriptor: the handshake record of the call, with a hash of ``extra`` in its last 4 bytes.

    ``extra`` holds what the record has no field for (variant, check_finite,
    mode, region) and which ranks must still agree on.
    """
    desc = with_status(_descriptor(kind, op, dtype, count, seq, root), None)
    out = pack([desc])
    _EXTRA.pack_into(out, RECORD_SIZE - 4, hash(extra) & 0xFFFFFFFF)
    return bytes(out)


def _descriptor(kind: str, op: str | None, dtype: np.dtype[Any] | None, count: int, seq: int,
                root: int) -> tuple[int, ...]:
    from ._handshake import descriptor

    return descriptor(kind, "direct", op, dtype, count, seq, root)


def records(win: Window, t0: int) -> tuple[list[Record], list[bool]]:
    """Every rank's descriptor of the call at tick ``t0``, and whether its extra hash equals rank 0's."""
    raw = [win.descriptor(r, t0) for r in range(win.size)]
    recs = [unpack(d, 1)[0] for d in raw]
    return recs, [d[-4:] == raw[0][-4:] for d in raw]

"""Low-precision wire allreduce: float32 gradients travel as bf16 or fp16, every sum is float32.

Only the transfer is rounded. Each rank encodes its buffer once (round to
nearest even, fused with the finite check, so a value that overflows fp16 is
caught before it is sent); receivers widen exactly and accumulate in float32
with the fused [`accumulate_wire`][gradcoll.kernels.accumulate_wire]. The reduced value
is rounded to the wire format once more for the return trip, and every rank,
the reducing one included, keeps exactly that rounded value, so the result
is bitwise identical everywhere. Schedules (``algorithm``):

* ``ring``: a *direct* reduce-scatter then the ring allgather. In step ``s``
  rank ``q`` sends its encoded chunk ``q + s`` to rank ``q + s`` and adds
  chunk ``q`` from rank ``q - s``; after ``n - 1`` steps it owns chunk ``q``.
  The bytes and steps equal the ring's, but every contribution is rounded
  once instead of every partial sum once per hop, which is what keeps the
  error independent of the world size (docs/algorithms/wire.md).
* ``star``: rank 0 adds the encoded rows in rank order and sends the
  encoded result back.
* ``recursive_doubling``: a recursive-doubling allgather of the encoded
  buffers (``gradcoll.algorithms._gather_raw``, ``log2 p`` rounds), then every rank adds all
  ``n`` rows in rank order: every contribution rounded once, as in the ring
  and the star, so the error bound is theirs, and the same bits everywhere.

Inputs: float32 with ``wire``, float16 (wire ``fp16``), or uint16 bit
patterns (or ml_dtypes bfloat16) holding ``wire`` values: those are already
encoded, reduced in float32 and written back in their own format.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import kernels
from ..errors import NonFiniteError, UsageError
from ..transport.base import Transport
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, plant, scratch
from ._gather_raw import raw_recursive_doubling, raw_star
from ._guard import first_marker, guarded_allreduce
from ._verdict import NONFINITE

__all__ = ["wire_allreduce", "wire_of"]

_NAN = {"bf16": 0x7FC0, "fp16": 0x7E00}
_CODE = {"bf16": 1, "fp16": 2}


def wire_of(buf: np.ndarray, wire: str | None) -> str | None:
    """The wire format a buffer travels in: ``wire``, or the one its half dtype implies, or None."""
    if wire is not None and wire not in kernels.WIRE_DTYPES:
        raise UsageError(f"wire_dtype must be one of {', '.join(kernels.WIRE_DTYPES)} or None; got {wire!r}")
    if buf.dtype == np.float16:
        if wire not in (None, "fp16"):
            raise UsageError(f"a float16 buffer travels as fp16, not {wire}")
        return "fp16"
    if buf.dtype.name == "bfloat16":
        if wire not in (None, "bf16"):
            raise UsageError(f"a bfloat16 buffer travels as bf16, not {wire}")
        return "bf16"
    if buf.dtype == np.uint16 and wire is None:
        raise UsageError("a uint16 buffer needs wire_dtype= to say which format its bits are")
    if wire is not None and buf.dtype not in (np.dtype(np.float32), np.dtype(np.uint16)):
        raise UsageError(f"wire_dtype={wire!r} takes float32 buffers (or its own bit patterns), got {buf.dtype}")
    return wire


def wire_allreduce(transport: Transport, buf: np.ndarray, *, wire: str | None = None, algorithm: str = "ring",
                   op: str = "mean", check_finite: bool = True, seq: int = 0, timeout: float | None = None,
                   workspace: Workspace | None = None, backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place with a ``wire`` (bf16/fp16) transfer and float32 accumulation; returns ``buf``."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError("buf must be a writeable C-contiguous numpy array")
    fmt = wire_of(buf, wire)
    if fmt is None:
        raise UsageError("wire_allreduce needs wire= for a float32 buffer")
    if op not in ("mean", "sum"):
        raise UsageError(f"a low-precision wire allreduce takes op 'mean' or 'sum', got {op!r}")
    if algorithm not in _SCHEDULES:
        raise UsageError(f"unknown allreduce algorithm {algorithm!r} for the wire path")
    if transport.size == 1:
        return buf  # nothing travels, so nothing is rounded (nor checked)
    opts = Options(op, check_finite, seq, timeout, workspace, backend)
    job = _Wire(buf.reshape(-1), fmt, algorithm, opts)
    return guarded_allreduce(transport, buf, opts, name=f"{algorithm} allreduce ({fmt} wire)", algo=algorithm,
                             flat=job.described, variant=tags.wire_variant(_CODE[fmt]), prepare=job.encode,
                             body=job.run, find_bad=job.marker)


class _Wire:
    """One wire allreduce: the wire bits ``enc``, the float32 accumulator ``own``, and the frame's seams."""

    def __init__(self, flat: np.ndarray, fmt: str, algorithm: str, opts: Options) -> None:
        self.flat, self.fmt, self.algorithm, self.opts = flat, fmt, algorithm, opts
        self.encoded = flat.dtype != np.float32  # the buffer already holds wire bits
        self.described = flat.view(np.uint16) if self.encoded else flat  # what the descriptor names
        self.enc, self.own = np.empty(0, np.uint16), np.empty(0, np.float32)

    def encode(self, coll: Coll, _: np.ndarray) -> None:
        """The pre-encode, fused with the input check (Jidoka: name this rank, never send an overflowed value)."""
        flat, fmt, ws, backend, check = self.flat, self.fmt, self.opts.workspace, self.opts.backend, self.opts.check_finite
        if not flat.size:
            return
        if self.encoded:
            enc, own = flat.view(np.uint16), scratch(ws, "wire_acc", flat.size, np.float32)
            kernels.decode_wire(enc, own, fmt, backend=backend)
            ok = kernels.reference_wire().wire_finite(enc, fmt) if check else True
        else:
            enc, own = scratch(ws, "wire_enc", flat.size, np.uint16), flat
            try:
                kernels.encode_wire(flat, enc, fmt, check_finite=check, backend=backend)
                ok = True
            except NonFiniteError:
                ok = False
        if not ok:
            mask = kernels.reference_wire().WIRES[fmt]
            i = int(np.flatnonzero((enc & mask) == mask)[0])
            coll.status = (NONFINITE, i, float(own[i]))
            plant(enc, _NAN[fmt])
            plant(own)
        self.enc, self.own = enc, own

    def run(self, coll: Coll, _: np.ndarray, opts: Options) -> None:
        """The data phase, then the result back in the buffer's own format."""
        _SCHEDULES[self.algorithm](coll, self, coll.size if opts.op == "mean" else None)
        if not self.encoded and self.flat.size:
            kernels.decode_wire(self.enc, self.flat, self.fmt, backend=opts.backend)  # own chunks were rounded too

    def marker(self, coll: Coll, _: np.ndarray) -> tuple[int, float] | None:
        """The result's marker, read in the wire bits (whose value the float32 side holds)."""
        mask = kernels.reference_wire().WIRES[self.fmt]
        return first_marker(coll, self.enc, self.own if self.encoded else self.flat, lambda bits: (bits & mask) == mask)

    def finish(self, acc: np.ndarray, enc: np.ndarray, x: np.ndarray | None, divide: int | None) -> None:
        """``acc += decode(x)`` (divided), then the rounded result into ``enc``; a wire NaN marks an overflow."""
        check, backend = self.opts.check_finite, self.opts.backend
        try:
            if x is not None:
                kernels.accumulate_wire(acc, x, self.fmt, divide_by=divide, check_finite=check, backend=backend)
            elif divide is not None:
                acc /= np.float32(divide)
            kernels.encode_wire(acc, enc, self.fmt, check_finite=check, backend=backend)
        except NonFiniteError:
            plant(enc, _NAN[self.fmt])

    def add(self, acc: np.ndarray, x: np.ndarray) -> None:
        """``acc += decode(x)``; an overflow marks ``acc`` (the owner's encode then plants the wire NaN)."""
        try:
            kernels.accumulate_wire(acc, x, self.fmt, check_finite=self.opts.check_finite, backend=self.opts.backend)
        except NonFiniteError:
            plant(acc)


def _ring(coll: Coll, w: _Wire, divide: int | None) -> None:
    n, q = coll.size, coll.rank
    own, enc = w.own, w.enc
    bounds = chunk_bounds(own.size, n)
    coll.marks = [bounds[c] for c in range(n) if bounds[c + 1] > bounds[c]]  # each owner marks its chunk's start
    rows = scratch(w.opts.workspace, "wire_rows", (n - 1, bounds[1] - bounds[0]), np.uint16)
    rs, ag = coll.tag0 + tags.RAW_RS, coll.tag0 + tags.RAW_AG
    lo, hi = bounds[q], bounds[q + 1]
    coll.begin(2 * (n - 1))
    coll.step = 1
    recvs = [coll.irecv((q - s) % n, rows[s - 1, : hi - lo], rs) for s in range(1, n)]
    sends = [coll.isend((q + s) % n, enc[bounds[(q + s) % n]: bounds[(q + s) % n + 1]], rs) for s in range(1, n)]
    acc = own[lo:hi]
    for s in range(1, n):  # fixed order s = 1..n-1: the same sum whatever arrives first
        coll.step = s
        coll.wait(recvs[s - 1], (q - s) % n)
        if hi > lo:
            if s < n - 1:
                w.add(acc, rows[s - 1, : hi - lo])
            else:
                w.finish(acc, enc[lo:hi], rows[s - 1, : hi - lo], divide)
    for s, r in enumerate(sends, 1):
        coll.wait(r, (q + s) % n)
    right, left = (q + 1) % n, (q - 1) % n
    for t in range(n - 1):  # ring allgather of the encoded chunks: no rounding, only copies
        coll.step = n + t
        c_out, c_in = (q - t) % n, (q - t - 1) % n
        r = coll.irecv(left, enc[bounds[c_in]: bounds[c_in + 1]], ag)
        s_ = coll.isend(right, enc[bounds[c_out]: bounds[c_out + 1]], ag)
        coll.wait(r, left)
        coll.wait(s_, right)


def _star(coll: Coll, w: _Wire, divide: int | None) -> None:
    n, own, enc = coll.size, w.own, w.enc

    def reduce(rows: np.ndarray, wait: Callable[[int], object]) -> None:
        for p in range(1, n):  # rank order: the same sum on every run
            wait(p)
            if own.size:
                if p < n - 1:
                    w.add(own, rows[p - 1])
                else:
                    w.finish(own, enc, rows[p - 1], divide)

    raw_star(coll, enc, lambda: scratch(w.opts.workspace, "wire_rows", (n - 1, own.size), np.uint16), reduce)


def _rd(coll: Coll, w: _Wire, divide: int | None) -> None:
    """Recursive-doubling allgather of the encoded buffers, then every rank adds all rows in rank order."""
    n, own, enc = coll.size, w.own, w.enc

    def reduce(rows: np.ndarray) -> None:
        if own.size:
            kernels.decode_wire(rows[0], own, w.fmt, backend=w.opts.backend)  # its own input too: the same rows
            for k in range(1, n - 1):
                w.add(own, rows[k])
            w.finish(own, enc, rows[n - 1], divide)

    raw_recursive_doubling(coll, enc, lambda: scratch(w.opts.workspace, "wire_all", (n, enc.size), np.uint16), reduce)


_SCHEDULES = {"ring": _ring, "star": _star, "recursive_doubling": _rd}

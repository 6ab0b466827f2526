"""Low-precision wire allreduce: float32 gradients travel as bf16 or fp16, every sum is float32.

Only the transfer is rounded. Each rank encodes its buffer once (round to
nearest even, fused with the finite check, so a value that overflows fp16 is
caught before it is sent); receivers widen exactly and accumulate in float32
with the fused [`accumulate_wire`][gradcoll.kernels.accumulate_wire]. The reduced value
is rounded to the wire format once more for the return trip, and every rank,
the reducing one included, keeps exactly that rounded value, so the result
is bitwise identical everywhere. Every schedule runs it
(``gradcoll.algorithms.rows``): the encoded rows of a piece meet where the
piece is reduced, are widened and added in rank order, and the encoded
result is shared; every contribution, the reducing rank's own included, is
rounded once, which keeps the error independent of the world size
(docs/algorithms/wire.md), and the same bits under every schedule. ``max``
and ``min`` take the largest (smallest) widened value. With ``exact=True``
(``deterministic=True`` and a wire together) the widened rows are reduced by
the deterministic allreduce's exact kernel instead.

Inputs: float32 with ``wire``, float16 (wire ``fp16``), or uint16 bit
patterns (or ml_dtypes bfloat16) holding ``wire`` values: those are already
encoded, reduced in float32 and written back in their own format.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .. import kernels
from ..errors import NonFiniteError, UsageError
from ..transport.base import Transport
from . import tags
from ._common import OPS, Coll, Options, Workspace, plant, scratch
from ._guard import first_marker, guarded_allreduce
from ._verdict import NONFINITE
from .registry import schedule
from .rows import RowsCall, RowsSchedule

__all__ = ["wire_allreduce", "wire_of", "WireRows"]

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
                   workspace: Workspace | None = None, backend: str | None = None, segment_bytes: int = 1 << 20,
                   hosts: Sequence[Hashable] | None = None, exact: bool = False, **_: object) -> np.ndarray:
    """Allreduce ``buf`` in place with a ``wire`` (bf16/fp16) transfer and float32 accumulation; returns ``buf``.

    ``exact``: reduce the widened rows by the exact kernel (the same bits whatever the schedule and arrival).
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError("buf must be a writeable C-contiguous numpy array")
    fmt = wire_of(buf, wire)
    if fmt is None:
        raise UsageError("wire_allreduce needs wire= for a float32 buffer")
    if op not in OPS:
        raise UsageError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    entry = schedule(algorithm)
    if transport.size == 1:
        return buf  # nothing travels, so nothing is rounded (nor checked)
    if entry.rows is None:  # the shared window: its slots hold the wire values, the sums are float32
        if op not in ("mean", "sum") or exact:
            raise UsageError(f"rank {transport.rank}: the {algorithm} allreduce's wire form takes op 'mean' or "
                             f"'sum' and no deterministic=True; got op {op!r}" + (", deterministic" if exact else ""))
        from .direct import direct_wire

        return direct_wire(transport, buf, wire=fmt, op=op, check_finite=check_finite, seq=seq, timeout=timeout,
                           backend=backend)
    opts = Options(op, check_finite, seq, timeout, workspace, backend)
    job = _Wire(buf.reshape(-1), fmt, entry.rows, opts, segment_bytes, hosts, exact)
    variant = tags.wire_variant(_CODE[fmt]) + ((0x44,) if exact else ())
    return guarded_allreduce(transport, buf, opts, name=f"{algorithm} allreduce ({fmt} wire)", algo=algorithm,
                             flat=job.described, variant=variant, prepare=job.encode, body=job.run,
                             find_bad=job.marker)


class _Wire:
    """One wire allreduce: the wire bits ``enc``, the float32 accumulator ``own``, and the frame's seams."""

    def __init__(self, flat: np.ndarray, fmt: str, sched: RowsSchedule, opts: Options, segment_bytes: int,
                 hosts: Sequence[Hashable] | None, exact: bool) -> None:
        self.flat, self.fmt, self.schedule, self.opts = flat, fmt, sched, opts
        self.segment_bytes, self.hosts, self.exact = segment_bytes, hosts, exact
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
        divisor = coll.size if opts.op == "mean" else None
        reducer = WireRows(self.fmt, opts.op, divisor, opts.check_finite, opts.backend, opts.workspace, self.exact)
        self.schedule(coll, RowsCall(self.enc, reducer, opts.workspace, self.segment_bytes, self.hosts))
        if not self.encoded and self.flat.size:
            kernels.decode_wire(self.enc, self.flat, self.fmt, backend=opts.backend)  # own chunks were rounded too

    def marker(self, coll: Coll, _: np.ndarray) -> tuple[int, float] | None:
        """The result's marker, read in the wire bits (whose value the float32 side holds)."""
        mask = kernels.reference_wire().WIRES[self.fmt]
        return first_marker(coll, self.enc, self.own if self.encoded else self.flat, lambda bits: (bits & mask) == mask)



class WireRows:
    """The low-precision wire variant (``gradcoll.algorithms.rows.Rows``): ``n`` encoded rows widened and reduced
    in float32 (in rank order; or exactly, with ``exact``), the result encoded; an overflow, or a non-finite
    value carried in, is the wire's NaN at ``out[0]``."""

    __slots__ = ("fmt", "op", "divisor", "check", "backend", "ws", "exact")

    def __init__(self, fmt: str, op: str, divisor: int | None, check: bool, backend: str | None,
                 ws: Workspace | None, exact: bool) -> None:
        self.fmt, self.op, self.divisor, self.check, self.backend = fmt, op, divisor, check, backend
        self.ws, self.exact = ws, exact

    def reduce(self, rows: np.ndarray, out: np.ndarray) -> None:
        n, m = rows.shape
        if not m:
            return
        fmt, backend = self.fmt, self.backend
        acc = scratch(self.ws, "wire_sum", m, np.float32)
        try:
            if self.exact or self.op in ("max", "min"):
                wide = scratch(self.ws, "wire_wide", (n, m), np.float32)
                for k in range(n):
                    kernels.decode_wire(rows[k], wide[k], fmt, backend=backend)
                if self.op in ("max", "min"):
                    (np.maximum if self.op == "max" else np.minimum).reduce(wide, axis=0, out=acc)
                elif kernels.exact_reduce(wide[0], wide[1:], acc, float(self.divisor or 1), backend) >= 0 \
                        and self.check:
                    raise NonFiniteError("the exact sum overflowed")
            else:
                kernels.decode_wire(rows[0], acc, fmt, backend=backend)
                for k in range(1, n):
                    kernels.accumulate_wire(acc, rows[k], fmt, divide_by=self.divisor if k == n - 1 else None,
                                            check_finite=self.check, backend=backend)
                if n == 1 and self.divisor is not None:
                    acc /= np.float32(self.divisor)
            kernels.encode_wire(acc, out, fmt, check_finite=self.check, backend=backend)
        except NonFiniteError:
            plant(out, _NAN[fmt])

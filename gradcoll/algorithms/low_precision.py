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
  buffers (``gradcoll.algorithms._gather``, ``log2 p`` rounds), then every rank adds all
  ``n`` rows in rank order: every contribution rounded once, as in the ring
  and the star, so the error bound is theirs, and the same bits everywhere.

Inputs: float32 with ``wire``, float16 (wire ``fp16``), or uint16 bit
patterns (or ml_dtypes bfloat16) holding ``wire`` values: those are already
encoded, reduced in float32 and written back in their own format.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import NonFiniteError, UsageError
from ..transport.base import Transport
from ..transport.frame import LENIENT_TAG
from ._common import Coll, Workspace, chunk_bounds, scratch
from ._gather_raw import rd_allgather, rd_result, rd_steps, sits_out, star_gather, star_reply
from ._guard import ERRORS, begin, fail
from ._handshake import NONFINITE

__all__ = ["wire_allreduce", "wire_of"]

_RS, _AG, _UP, _DOWN, _FOLD, _ROUND, _UNFOLD = 1, 2, 3, 4, 5, 6, 7
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
    if algorithm not in ("ring", "star", "recursive_doubling"):
        raise UsageError(f"unknown allreduce algorithm {algorithm!r} for the wire path")
    encoded = buf.dtype != np.float32  # the buffer already holds wire bits
    flat = buf.reshape(-1)
    coll = Coll(transport, f"{algorithm} allreduce ({fmt} wire)", seq, flat.nbytes, timeout)
    begin(coll, "allreduce", algorithm, op, flat.view(np.uint16) if encoded else flat, False, backend)
    if coll.pending is not None:  # lenient tags: keep wire and plain calls (and check flags) apart
        coll.tag0 = LENIENT_TAG | (hash((coll.tag0, 0x57, _CODE[fmt], check_finite)) & 0x3FFFFF00)
    if coll.size == 1 or flat.size == 0:
        if coll.size > 1:
            _run(coll, algorithm, np.empty(0, np.float32), np.empty(0, np.uint16), fmt, op, check_finite,
                 workspace, backend)
        return buf
    enc = flat.view(np.uint16) if encoded else scratch(workspace, "wire_enc", flat.size, np.uint16)
    if encoded:
        own = scratch(workspace, "wire_acc", flat.size, np.float32)
        kernels.decode_wire(enc, own, fmt, backend=backend)
        ok = kernels.reference_wire().wire_finite(enc, fmt) if check_finite else True
    else:
        own = flat
        try:
            kernels.encode_wire(flat, enc, fmt, check_finite=check_finite, backend=backend)
            ok = True
        except NonFiniteError:
            ok = False
    if not ok:  # Jidoka: name this rank, plant a wire NaN, never send the overflowed value
        mask = kernels.reference_wire().WIRES[fmt]
        i = int(np.flatnonzero((enc & mask) == mask)[0])
        coll.status = (NONFINITE, i, float(own[i]))
        enc[0], own[0] = _NAN[fmt], np.nan
    try:
        _run(coll, algorithm, own, enc, fmt, op, check_finite, workspace, backend)
    except ERRORS as exc:
        fail(coll, exc)
    if not encoded:
        kernels.decode_wire(enc, flat, fmt, backend=backend)  # own chunks were rounded too: same bits everywhere
    if check_finite:
        starts = chunk_bounds(flat.size, coll.size)[:-1] if algorithm == "ring" else [0]
        for a in starts:
            if a < flat.size and (int(enc[a]) & kernels.reference_wire().WIRES[fmt]) == kernels.reference_wire().WIRES[fmt]:
                fail(coll, None, (a, float(own[a]) if encoded else float(flat[a])))
    return buf


def _run(coll: Coll, algorithm: str, own: np.ndarray, enc: np.ndarray, fmt: str, op: str, check: bool,
         ws: Workspace | None, backend: str | None) -> None:
    divide = coll.size if op == "mean" else None
    {"ring": _ring, "star": _star, "recursive_doubling": _rd}[algorithm](coll, own, enc, fmt, divide, check, ws, backend)


def _finish(acc: np.ndarray, enc: np.ndarray, x: np.ndarray | None, fmt: str, divide: int | None, check: bool,
            backend: str | None) -> None:
    """``acc += decode(x)`` (divided), then the rounded result into ``enc``; NaN planted on overflow."""
    try:
        if x is not None:
            kernels.accumulate_wire(acc, x, fmt, divide_by=divide, check_finite=check, backend=backend)
        elif divide is not None:
            acc /= np.float32(divide)
        kernels.encode_wire(acc, enc, fmt, check_finite=check, backend=backend)
    except NonFiniteError:
        if enc.size:
            enc[0] = _NAN[fmt]


def _accumulate(acc: np.ndarray, x: np.ndarray, fmt: str, divide: int | None, check: bool,
                backend: str | None) -> None:
    try:
        kernels.accumulate_wire(acc, x, fmt, divide_by=divide, check_finite=check, backend=backend)
    except NonFiniteError:
        acc[0] = np.nan  # carried on: the owner's encode plants the wire NaN


def _ring(coll: Coll, own: np.ndarray, enc: np.ndarray, fmt: str, divide: int | None, check: bool,
          ws: Workspace | None, backend: str | None) -> None:
    n, q = coll.size, coll.rank
    bounds = chunk_bounds(own.size, n)
    width = bounds[1] - bounds[0]
    rows = scratch(ws, "wire_rows", (n - 1, width), np.uint16)
    rs, ag = coll.tag0 + _RS, coll.tag0 + _AG
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
                _accumulate(acc, rows[s - 1, : hi - lo], fmt, None, check, backend)
            else:
                _finish(acc, enc[lo:hi], rows[s - 1, : hi - lo], fmt, divide, check, backend)
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


def _star(coll: Coll, own: np.ndarray, enc: np.ndarray, fmt: str, divide: int | None, check: bool,
          ws: Workspace | None, backend: str | None) -> None:
    n = coll.size
    got = star_gather(coll, enc, lambda: scratch(ws, "wire_rows", (n - 1, own.size), np.uint16), coll.tag0 + _UP,
                      coll.tag0 + _DOWN)
    if got is None:
        return
    rows, reqs = got
    for p in range(1, n):  # rank order: the same sum on every run
        coll.wait(reqs[p - 1], p)
        if own.size:
            if p < n - 1:
                _accumulate(own, rows[p - 1], fmt, None, check, backend)
            else:
                _finish(own, enc, rows[p - 1], fmt, divide, check, backend)
    star_reply(coll, enc, coll.tag0 + _DOWN)


def _rd(coll: Coll, own: np.ndarray, enc: np.ndarray, fmt: str, divide: int | None, check: bool,
        ws: Workspace | None, backend: str | None) -> None:
    """Recursive-doubling allgather of the encoded buffers, then every rank adds all rows in rank order."""
    n = coll.size
    coll.begin(rd_steps(n))
    rows = None if sits_out(n, coll.rank) else scratch(ws, "wire_all", (n, enc.size), np.uint16)
    if rd_allgather(coll, enc, rows, coll.tag0 + _FOLD, coll.tag0 + _ROUND) and own.size:
        assert rows is not None
        kernels.decode_wire(rows[0], own, fmt, backend=backend)  # its own input too: every rank adds the same rows
        for k in range(1, n - 1):
            _accumulate(own, rows[k], fmt, None, check, backend)
        _finish(own, enc, rows[n - 1], fmt, divide, check, backend)
    rd_result(coll, enc, coll.tag0 + _UNFOLD)

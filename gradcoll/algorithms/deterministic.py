"""Bitwise-reproducible allreduce: every element summed exactly where all its contributions meet.

Floating-point addition is not associative, so the bits of an ordinary
allreduce depend on the algorithm, the chunking and the order of arrival.
This one does not, and it moves the same bytes as the ordinary one:

* Raw contributions travel, never partial sums. Every element is reduced by
  exactly one kernel call that sees all ``n`` contributions of it at once
  (``exact_reduce``).
* That kernel puts the element's contributions on a fixed-point grid set by
  the largest of them (``2**(E-F)``, ``max |x| < 2**E``,
  ``F = min(51, 52 - ceil(log2 n))``), rounds each to an integer once, sums
  the integers exactly in float64 (all below ``2**52``) and rounds the sum
  once to the output dtype. A maximum and an exact sum do not depend on
  order, so the result is a function of the multiset of contributions alone:
  the same bits whatever the algorithm, the chunking, the transport, the
  thread count or the arrival order. The exact rules are in
  ``gradcoll.kernels.exact_reference``.
* Where an element's contributions lie within ``F - 24`` binades of its
  largest (27 at 2 ranks, 25 at 8, 19 at 1,024; almost always for the
  gradients of one parameter), nothing is rounded before the sum and the
  result equals ``float32(float64_sum / n)`` bit for bit.

Schedules (``algorithm``), each with the bytes of its ordinary counterpart:

* ``ring``: a direct reduce-scatter (rank ``q`` sends its raw chunk ``c`` to
  rank ``c``; ``n - 1`` chunks of ``S/n`` out, ``n - 1`` in, in
  ``segment_bytes`` pieces), the owner reduces each piece of its chunk with
  all ``n`` contributions as soon as they are in and sends the finished
  piece straight to every other rank (a direct allgather, overlapping the
  reductions still to come). ``n - 1`` pieces of ``S/n`` out and in per
  phase: the ring's bytes, in two steps of latency instead of ``2(n-1)``.
* ``star``: rank 0 receives every raw buffer, reduces, sends the result.
* ``recursive_doubling``: a recursive-doubling allgather of the raw buffers
  (``gradcoll.algorithms._gather``: ``log2 p`` rounds, doubling blocks; a
  non-power-of-two rank folds its buffer into a partner first and gets the
  result back last), then every rank reduces all ``n`` rows itself. ``n``
  times the buffer in scratch: a schedule for small buffers.

Non-finite inputs are found by the ordinary local check and travel as a
planted NaN (``gradcoll.algorithms._guard``); an ``op="sum"`` that overflows the output dtype
is planted at the start of the owner's chunk. See docs/algorithms/deterministic.md.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError
from ..kernels import exact_reduce, exact_reference
from ..transport.base import Transport
from ..transport.frame import LENIENT_TAG
from . import ALLREDUCE
from ._common import Coll, Workspace, chunk_bounds, scratch, segment_bounds
from ._gather_raw import rd_allgather, rd_result, rd_steps, sits_out, star_gather, star_reply
from ._guard import guarded_allreduce
from .ring import SEGMENT_BYTES

__all__ = ["deterministic_allreduce", "exact_reduce", "fraction_bits"]

fraction_bits = exact_reference.fraction_bits

_RS, _AG, _UP, _DOWN, _FOLD, _ROUND, _UNFOLD = 1, 2, 3, 4, 5, 6, 7


def deterministic_allreduce(transport: Transport, buf: np.ndarray, *, algorithm: str = "ring", op: str = "mean",
                            check_finite: bool = True, seq: int = 0, timeout: float | None = None,
                            workspace: Workspace | None = None, backend: str | None = None,
                            segment_bytes: int = SEGMENT_BYTES) -> np.ndarray:
    """Allreduce ``buf`` (float32/float64) in place with bit-identical results under any schedule; returns ``buf``.

    ``segment_bytes``: the ring's reduce-scatter travels and is reduced in
    pieces of this size (the star and recursive doubling ignore it).
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError("buf must be a writeable C-contiguous numpy array")
    if buf.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise UsageError(f"deterministic allreduce takes float32 or float64, got {buf.dtype}")
    if op not in ("mean", "sum"):
        raise UsageError(f"deterministic allreduce takes op 'mean' or 'sum', got {op!r}")
    if algorithm not in ALLREDUCE:
        raise UsageError(f"unknown allreduce algorithm {algorithm!r}; known: {', '.join(ALLREDUCE)}")
    divisor = float(transport.size) if op == "mean" else 1.0
    schedule = {"ring": _ring, "star": _star, "recursive_doubling": _rd}[algorithm]
    starts: list[int] = [0]

    def body(coll: Coll, flat: np.ndarray) -> None:
        if coll.pending is not None:  # lenient tags: keep deterministic and plain calls apart
            coll.tag0 = LENIENT_TAG | (hash((coll.tag0, 0x44)) & 0x3FFFFF00)
        if algorithm == "ring":
            starts[:] = chunk_bounds(flat.size, coll.size)[:-1]
        schedule(coll, flat, divisor, check_finite, workspace, backend, segment_bytes)

    def planted(coll: Coll, flat: np.ndarray) -> tuple[int, float] | None:
        for a in starts:
            if a < flat.size and not math.isfinite(flat[a]):
                return a, float(flat[a])
        return None

    return guarded_allreduce(transport, buf, name=f"deterministic {algorithm} allreduce", algo=algorithm, op=op,
                             check_finite=check_finite, seq=seq, timeout=timeout, backend=backend, body=body,
                             find_bad=planted)


def _reduce(own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float, check: bool,
            backend: str | None) -> None:
    """Reduce; with ``check``, plant a NaN at ``out[0]`` when some output overflowed (the error path names it)."""
    if exact_reduce(own, rows, out, divisor, backend) >= 0 and check and out.size:
        out[0] = np.nan


def _ring(coll: Coll, flat: np.ndarray, divisor: float, check: bool, ws: Workspace | None,
          backend: str | None, segment_bytes: int) -> None:
    n, q = coll.size, coll.rank
    bounds = chunk_bounds(flat.size, n)
    lo, hi = bounds[q], bounds[q + 1]
    seg = max(1, segment_bytes // flat.itemsize)
    # Segment g of this rank's chunk, from all n-1 peers, lands contiguously as (n-1, length) at (n-1) * its offset,
    # so it is reduced the moment its n-1 pieces are in while later segments are still on the wire.
    rows = scratch(ws, "det_rows", (n - 1) * (hi - lo), flat.dtype)
    mine = segment_bounds(lo, hi, seg)
    rs, ag = coll.tag0 + _RS, coll.tag0 + _AG
    coll.begin(n)
    coll.step = 1
    blocks = [rows[(n - 1) * (a - lo): (n - 1) * (b - lo)].reshape(n - 1, b - a) for a, b in mine]
    recvs = [[coll.irecv((q - s) % n, blk[s - 1], rs) for s in range(1, n)] for blk in blocks]
    sends = []
    for s in range(1, n):
        c = (q + s) % n
        sends += [(coll.isend(c, flat[a:b], rs), c) for a, b in segment_bounds(bounds[c], bounds[c + 1], seg)]
    shared = []
    for (a, b), blk, reqs in zip(mine, blocks, recvs, strict=True):
        for s in range(1, n):
            coll.step = s
            coll.wait(reqs[s - 1], (q - s) % n)
        _reduce(flat[a:b], blk, flat[a:b], divisor, check, backend)
        shared += [(coll.isend((q + s) % n, flat[a:b], ag), (q + s) % n) for s in range(1, n)]  # straight to everyone
    for req, c in sends:  # before anything lands in the regions those sends read
        coll.wait(req, c)
    gets = [(coll.irecv(c, flat[a:b], ag), c) for c in range(n) if c != q for a, b in segment_bounds(bounds[c], bounds[c + 1], seg)]
    coll.step = n
    for req, c in gets:
        coll.wait(req, c)
    for req, c in shared:
        coll.wait(req, c)


def _star(coll: Coll, flat: np.ndarray, divisor: float, check: bool, ws: Workspace | None,
          backend: str | None, segment_bytes: int) -> None:
    n = coll.size
    got = star_gather(coll, flat, lambda: scratch(ws, "det_rows", (n - 1, flat.size), flat.dtype), coll.tag0 + _UP,
                      coll.tag0 + _DOWN)
    if got is None:
        return
    rows, reqs = got
    for p in range(1, n):
        coll.wait(reqs[p - 1], p)
    _reduce(flat, rows, flat, divisor, check, backend)
    star_reply(coll, flat, coll.tag0 + _DOWN)


def _rd(coll: Coll, flat: np.ndarray, divisor: float, check: bool, ws: Workspace | None,
        backend: str | None, segment_bytes: int) -> None:
    """Recursive-doubling allgather of the raw buffers (``gradcoll.algorithms._gather``), then a local exact reduce."""
    n = coll.size
    coll.begin(rd_steps(n))
    rows = None if sits_out(n, coll.rank) else scratch(ws, "det_all", (n, flat.size), flat.dtype)
    if rd_allgather(coll, flat, rows, coll.tag0 + _FOLD, coll.tag0 + _ROUND):
        assert rows is not None
        _reduce(rows[0], rows[1:], flat, divisor, check, backend)
    rd_result(coll, flat, coll.tag0 + _UNFOLD)

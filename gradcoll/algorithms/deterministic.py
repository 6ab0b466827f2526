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
  (``gradcoll.algorithms._gather_raw``: ``log2 p`` rounds, doubling blocks; a
  non-power-of-two rank folds its buffer into a partner first and gets the
  result back last), then every rank reduces all ``n`` rows itself. ``n``
  times the buffer in scratch: a schedule for small buffers.

Non-finite inputs are found by the ordinary local check and travel as a
planted NaN (``gradcoll.algorithms._guard``); an ``op="sum"`` that overflows the output dtype
is planted at the start of the reduced piece (in the ring, each segment of the owner's chunk).
See docs/algorithms/deterministic.md.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import UsageError
from ..kernels import exact_reduce, exact_reference
from ..transport.base import Transport
from . import ALLREDUCE, tags
from ._common import Coll, Options, Workspace, chunk_bounds, plant, scratch, segment_bounds
from ._gather_raw import raw_recursive_doubling, raw_star
from ._guard import guarded_allreduce
from .ring import SEGMENT_BYTES

__all__ = ["deterministic_allreduce", "exact_reduce", "fraction_bits"]

fraction_bits = exact_reference.fraction_bits



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
    schedule = _SCHEDULES[algorithm]

    def body(coll: Coll, flat: np.ndarray, opts: Options) -> None:
        schedule(coll, flat, _reducer(divisor, opts), opts.workspace, segment_bytes)

    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name=f"deterministic {algorithm} allreduce", algo=algorithm, variant=tags.DETERMINISTIC,
                             body=body)


Reduce = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def _reducer(divisor: float, opts: Options) -> Reduce:
    """``reduce(own, rows, out)``; with check_finite, an output that overflowed marks ``out`` (the error path names it)."""
    check, backend = opts.check_finite, opts.backend

    def reduce(own: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        if exact_reduce(own, rows, out, divisor, backend) >= 0 and check:
            plant(out)
    return reduce


def _ring(coll: Coll, flat: np.ndarray, reduce: Reduce, ws: Workspace | None, segment_bytes: int) -> None:
    n, q = coll.size, coll.rank
    bounds = chunk_bounds(flat.size, n)
    lo, hi = bounds[q], bounds[q + 1]
    seg = max(1, segment_bytes // flat.itemsize)
    coll.marks = [a for c in range(n) for a, b in segment_bounds(bounds[c], bounds[c + 1], seg) if b > a]
    # Segment g of this rank's chunk, from all n-1 peers, lands contiguously as (n-1, length) at (n-1) * its offset,
    # so it is reduced the moment its n-1 pieces are in while later segments are still on the wire.
    rows = scratch(ws, "det_rows", (n - 1) * (hi - lo), flat.dtype)
    mine = segment_bounds(lo, hi, seg)
    rs, ag = coll.tag0 + tags.RAW_RS, coll.tag0 + tags.RAW_AG
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
        reduce(flat[a:b], blk, flat[a:b])  # marks the segment's start when it overflowed
        shared += [(coll.isend((q + s) % n, flat[a:b], ag), (q + s) % n) for s in range(1, n)]  # straight to everyone
    for req, c in sends:  # before anything lands in the regions those sends read
        coll.wait(req, c)
    gets = [(coll.irecv(c, flat[a:b], ag), c) for c in range(n) if c != q for a, b in segment_bounds(bounds[c], bounds[c + 1], seg)]
    coll.step = n
    for req, c in gets:
        coll.wait(req, c)
    for req, c in shared:
        coll.wait(req, c)


def _star(coll: Coll, flat: np.ndarray, reduce: Reduce, ws: Workspace | None, segment_bytes: int) -> None:
    n = coll.size

    def reduce_rows(rows: np.ndarray, wait: Callable[[int], object]) -> None:
        for p in range(1, n):
            wait(p)
        reduce(flat, rows, flat)

    raw_star(coll, flat, lambda: scratch(ws, "det_rows", (n - 1, flat.size), flat.dtype), reduce_rows)


def _rd(coll: Coll, flat: np.ndarray, reduce: Reduce, ws: Workspace | None, segment_bytes: int) -> None:
    """Recursive-doubling allgather of the raw buffers (``gradcoll.algorithms._gather_raw``), then a local exact reduce."""
    raw_recursive_doubling(coll, flat, lambda: scratch(ws, "det_all", (coll.size, flat.size), flat.dtype),
                           lambda rows: reduce(rows[0], rows[1:], flat))


_SCHEDULES = {"ring": _ring, "star": _star, "recursive_doubling": _rd}


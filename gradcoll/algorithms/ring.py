"""Ring allreduce: reduce-scatter then allgather around a ring, pipelined in segments.

The buffer of ``count`` elements is split into ``n`` near-equal chunks (see
``chunk_bounds``). Rank ``q`` sends to
``q + 1`` and receives from ``q - 1``. In reduce-scatter step ``s`` it sends
chunk ``q - s`` and adds the chunk ``q - s - 1`` it receives into its own
copy; after ``n - 1`` steps it holds the fully reduced chunk ``q + 1``, and
for ``mean`` it divides that chunk by ``n`` in the same fused kernel call as
the last addition. In allgather step ``t`` it sends chunk ``q + 1 - t`` and
overwrites chunk ``q - t`` with what arrives. Both phases have the same
shape: at global step ``g`` (0 .. 2n-3) a rank sends chunk ``q - g`` and
receives chunk ``q - g - 1`` (mod n), which is exactly what it sends at step
``g + 1``. So each received segment is forwarded the moment it is reduced,
and the reduction of one segment overlaps the transfer of the next.

Every rank sends ``2 (n - 1) / n * S`` bytes in ``2 (n - 1)`` steps for a
buffer of ``S`` bytes. Each chunk is finished by one rank and copied to the
others, so the result is bitwise identical on every rank. See
docs/algorithms/ring.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transport.base import Request, Transport
from ..transport.plan import CHECK, COPY, DIVIDE, make
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, combiner, scratch, segment_bounds
from ._guard import LEAN_DTYPES, guarded_allreduce
from ._handshake import local_status
from ._planned import Plan, Schedule, register, run_plan
from .rows import RowsCall

__all__ = ["ring_allreduce", "ring_pass", "ring_plan", "ring_rows", "SEGMENT_BYTES"]

#: Default pipeline segment (bytes): large enough that a segment's fixed cost is small, small enough to pipeline.
SEGMENT_BYTES = 1 << 20
NAME = "ring allreduce"


def ring_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True, seq: int = 0,
                   timeout: float | None = None, segment_bytes: int = SEGMENT_BYTES, workspace: Workspace | None = None,
                   backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place over every rank with the ring algorithm; returns ``buf``.

    Where the transport runs a plan of rounds in one compiled call (tcp's ``exchange_plan``), a float32 or
    float64 mean or sum with the default segments runs every step that way (``ring_plan``: a round per segment
    of a step), putting on the wire the frames the general path does, so that ranks on either path meet.
    """
    if segment_bytes == SEGMENT_BYTES and backend in (None, "cython") and type(buf) is np.ndarray \
            and op in ("mean", "sum") and buf.dtype in LEAN_DTYPES \
            and run_plan(transport, buf, op, check_finite, seq, timeout, workspace, _rest, SCHEDULE):
        return buf
    return _guarded(transport, buf, op, check_finite, seq, timeout, workspace, backend, segment_bytes)


def _guarded(transport: Transport, buf: np.ndarray, op: str, check_finite: bool, seq: int, timeout: float | None,
             workspace: Workspace | None, backend: str | None, segment_bytes: int = SEGMENT_BYTES) -> np.ndarray:
    def body(coll: Coll, flat: np.ndarray, opts: Options) -> None:
        ring_pass(coll, flat, opts, allgather=True, shift=0, segment_bytes=segment_bytes)

    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name=NAME, algo="ring", body=body)


def segments(count: int, n: int, seg: int) -> list[list[tuple[int, int]]]:
    """Each of the ``n`` chunks of ``count`` elements (``chunk_bounds``) as ``k`` near-equal segments of at most
    ``seg`` elements, ``k`` the same for every chunk (so that a step's send and receive pair up segment by
    segment; empty segments where a chunk is shorter than ``k``)."""
    bounds = chunk_bounds(count, n)
    k = max(1, -(-(bounds[1] - bounds[0]) // max(1, seg)))  # chunk 0 is the longest
    return [[(bounds[c] + a, bounds[c] + b) for a, b in zip(p, p[1:], strict=False)]
            for c in range(n) for p in [chunk_bounds(bounds[c + 1] - bounds[c], k)]]


def ring_plan(rank: int, n: int, count: int, mean: bool, seg_bytes: int = SEGMENT_BYTES, itemsize: int = 4) -> Plan:
    """The ring allreduce of rank ``rank`` of ``n`` on ``count`` elements as one plan (``gradcoll.transport.plan``)
    of ``2 (n - 1)`` steps of ``k`` rounds, the frames ``ring_pass`` sends: round ``s`` of step ``g`` sends
    segment ``s`` of chunk ``rank - g`` to the right and receives segment ``s`` of chunk ``rank - g - 1`` from the
    left, added into it in the reduce-scatter (the last such step divides a mean; each checks the segment it
    adds into, this rank's input so far), copied into it in the allgather. ``bounds``: every segment's start."""
    segs = segments(count, n, max(1, seg_bytes // itemsize))
    right, left = (rank + 1) % n, (rank - 1) % n
    rounds = [(0, *segs[(rank - g - 1) % n][i], *segs[(rank - g) % n][i],
               (CHECK | (DIVIDE if mean and g == n - 2 else 0)) if g < n - 1 else COPY)
              for g in range(2 * (n - 1)) for i in range(len(segs[0]))]
    starts = sorted({a for c in segs for a, b in c if b > a}) + [count]
    return Plan(starts, (right,) * len(rounds), (left,) * len(rounds), make(rounds), (tags.RING,) * len(rounds),
                max(b - a for c in segs for a, b in c))


def _plan(rank: int, n: int, count: int, mean: bool, itemsize: int) -> Plan:
    return ring_plan(rank, n, count, mean, itemsize=itemsize)


SCHEDULE = Schedule(NAME, "ring", True, _plan, "ring_rounds")


def _rest(coll: Coll, flat: np.ndarray, opts: Options, done: int) -> None:
    """The rounds of ``ring_plan``'s call from ``done`` on, through the engine. The segments the reduce-scatter
    rounds left add into still hold this rank's input: they are checked first, as those rounds would have."""
    n, q = coll.size, coll.rank
    segs = segments(flat.size, n, max(1, SEGMENT_BYTES // flat.itemsize))
    k = len(segs[0])
    if opts.check_finite and coll.status is None:
        for r in range(done, (n - 1) * k):
            a, b = segs[(q - r // k - 1) % n][r % k]
            status = local_status(flat[a:b], True)
            if status is not None:
                coll.status = (status[0], a + status[1], status[2])
                break
    ring_pass(coll, flat, opts, allgather=True, shift=0, done=done)


register(SCHEDULE, _rest, _guarded)


def ring_pass(coll: Coll, flat: np.ndarray, opts: Options, *, allgather: bool, shift: int,
              segment_bytes: int = SEGMENT_BYTES, divisor: int | None = None, done: int = 0) -> None:
    """Run the ring's reduce-scatter (and, with ``allgather``, its allgather) over ``flat``.

    ``shift`` rotates the schedule: after reduce-scatter rank ``q`` holds the
    reduced chunk ``q + shift + 1`` (``shift=-1`` gives every rank its own
    chunk, as reduce_scatter wants). Each chunk goes in ``segments``. A
    segment whose sum comes out non-finite is marked at its first element,
    so the start of every segment is a marker slot (``Coll.marks``).
    ``mean`` divides by ``divisor`` (default the ring's size; the two-level
    allreduce's ring of host leaders divides by the whole group's).
    ``done``: the rounds (a step's segment each) already done by
    ``ring_plan``'s compiled call; the schedule goes on after them.
    """
    n, q = coll.size, coll.rank
    right, left = (q + 1) % n, (q - 1) % n
    parts = segments(flat.size, n, max(1, segment_bytes // flat.itemsize))
    k = len(parts[0])
    tag = coll.tag0 + tags.RING
    total = 2 * (n - 1) if allgather else n - 1
    base = q + shift

    def segs(c: int) -> list[tuple[int, int]]:
        return parts[c % n]

    # Setup, done once: the receive schedule (step, lo, hi) in order from the
    # first round not done, two scratch rows for in-flight reduce-scatter
    # segments, the combine kernel, and the marker slots.
    units = [(g, a, b) for g in range(total) for a, b in segs(base - g - 1)][done:]
    tmp = scratch(opts.workspace, "ring", (2, max(1, max(b - a for a, b in parts[0]))), flat.dtype)
    combine = combiner(opts, n if divisor is None else divisor)
    coll.marks = [a for c in range(n) for a, b in segs(c) if b > a]
    sends: list[list[Request]] = [[] for _ in range(total)]
    reqs: dict[int, Request] = {}

    def post(u: int) -> None:
        g, a, b = units[u]
        if g < n - 1:
            target: Any = tmp[u % 2, : b - a]
        else:
            # Allgather overwrites chunk base-g-1, which this rank last sent at
            # step g+1-n; the transport may still be reading it.
            for r in sends[g + 1 - n]:
                coll.wait(r, right)
            sends[g + 1 - n].clear()
            target = flat[a:b]
        reqs[u] = coll.irecv(left, target, tag)

    coll.begin(total)
    coll.step = done // k + 1
    for i in range(done, min(done + k, total * k)):  # the rounds whose segment is here already: sent first
        a, b = segs(base - i // k)[i % k]
        sends[i // k].append(coll.isend(right, flat[a:b], tag))
    for u in range(min(2, len(units))):
        post(u)
    for u, (g, a, b) in enumerate(units):
        coll.step = g + 1
        coll.wait(reqs.pop(u), left)
        if g < n - 1 and b > a:
            # An overflow, a planted bad input or an upstream marker marks the segment's
            # first element, so the owner's copy and everyone's allgathered copy show it.
            combine(flat[a:b], tmp[u % 2, : b - a], g == n - 2)
        if g + 1 < total:  # forwarded in the next step as it comes (round done + u + k)
            sends[g + 1].append(coll.isend(right, flat[a:b], tag))
        if u + 2 < len(units):
            post(u + 2)
    for step_sends in sends:
        for r in step_sends:
            coll.wait(r, right)


def ring_rows(coll: Coll, call: RowsCall) -> None:
    """The ring's rows form (``gradcoll.algorithms.rows``): the ring's bytes in two steps of latency.

    A direct reduce-scatter: rank ``q`` sends its raw chunk ``c`` to rank
    ``c``, in ``segment_bytes`` pieces; the owner reduces each piece with
    all ``n`` rows as soon as they are in and sends the result straight to
    every other rank (a direct allgather that overlaps the reductions still
    to come). ``n - 1`` chunks of ``S/n`` out and in per phase.
    """
    data, n, q = call.data, coll.size, coll.rank
    bounds = chunk_bounds(data.size, n)
    lo, hi = bounds[q], bounds[q + 1]
    seg = max(1, call.segment_bytes // data.itemsize)
    coll.marks = [a for c in range(n) for a, b in segment_bounds(bounds[c], bounds[c + 1], seg) if b > a]
    # Piece g of this rank's chunk lands as an (n, length) block at n * its offset: its rows in rank order.
    space = call.scratch("ring", n * (hi - lo))
    mine = segment_bounds(lo, hi, seg)
    blocks = [space[n * (a - lo): n * (b - lo)].reshape(n, b - a) for a, b in mine]
    rs, ag = coll.tag0 + tags.RAW_RS, coll.tag0 + tags.RAW_AG
    coll.begin(n)
    coll.step = 1
    recvs = [[coll.irecv((q - s) % n, blk[(q - s) % n], rs) for s in range(1, n)] for blk in blocks]
    sends = []
    for s in range(1, n):
        c = (q + s) % n
        sends += [(coll.isend(c, data[a:b], rs), c) for a, b in segment_bounds(bounds[c], bounds[c + 1], seg)]
    shared = []
    for (a, b), blk, reqs in zip(mine, blocks, recvs, strict=True):
        blk[q] = data[a:b]
        for s in range(1, n):
            coll.step = s
            coll.wait(reqs[s - 1], (q - s) % n)
        call.rows.reduce(blk, data[a:b])
        shared += [(coll.isend((q + s) % n, data[a:b], ag), (q + s) % n) for s in range(1, n)]
    for req, c in sends:  # before anything lands in the regions those sends read
        coll.wait(req, c)
    gets = [(coll.irecv(c, data[a:b], ag), c) for c in range(n) if c != q
            for a, b in segment_bounds(bounds[c], bounds[c + 1], seg)]
    coll.step = n
    for req, c in gets:
        coll.wait(req, c)
    for req, c in shared:
        coll.wait(req, c)

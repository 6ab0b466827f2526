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
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, combiner, scratch, segment_bounds
from ._guard import guarded_allreduce

__all__ = ["ring_allreduce", "ring_pass", "SEGMENT_BYTES"]

#: Default pipeline segment (bytes); 1 MiB measured best over tcp for 1-4 MiB buffers on 4 ranks.
SEGMENT_BYTES = 1 << 20


def ring_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True, seq: int = 0,
                   timeout: float | None = None, segment_bytes: int = SEGMENT_BYTES, workspace: Workspace | None = None,
                   backend: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place over every rank with the ring algorithm; returns ``buf``."""

    def body(coll: Coll, flat: np.ndarray, opts: Options) -> None:
        ring_pass(coll, flat, opts, allgather=True, shift=0, segment_bytes=segment_bytes)

    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name="ring allreduce", algo="ring", body=body)


def ring_pass(coll: Coll, flat: np.ndarray, opts: Options, *, allgather: bool, shift: int,
              segment_bytes: int = SEGMENT_BYTES, divisor: int | None = None) -> None:
    """Run the ring's reduce-scatter (and, with ``allgather``, its allgather) over ``flat``.

    ``shift`` rotates the schedule: after reduce-scatter rank ``q`` holds the
    reduced chunk ``q + shift + 1`` (``shift=-1`` gives every rank its own
    chunk, as reduce_scatter wants). A segment whose sum comes out
    non-finite is marked at its first element, so the start of every
    segment is a marker slot (``Coll.marks``). ``mean`` divides by
    ``divisor`` (default the ring's size; the two-level allreduce's ring of
    host leaders divides by the whole group's).
    """
    n, q = coll.size, coll.rank
    right, left = (q + 1) % n, (q - 1) % n
    bounds = chunk_bounds(flat.size, n)
    seg = max(1, segment_bytes // flat.itemsize)
    tag = coll.tag0 + tags.RING
    total = 2 * (n - 1) if allgather else n - 1
    base = q + shift

    def segs(c: int) -> list[tuple[int, int]]:
        c %= n
        return segment_bounds(bounds[c], bounds[c + 1], seg)

    # Setup, done once: the receive schedule (step, lo, hi) in order, two
    # scratch rows for in-flight reduce-scatter segments, the combine kernel,
    # and the marker slots.
    units = [(g, a, b) for g in range(total) for a, b in segs(base - g - 1)]
    tmp = scratch(opts.workspace, "ring", (2, min(seg, bounds[1] - bounds[0])), flat.dtype)
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
    coll.step = 1
    for a, b in segs(base):
        sends[0].append(coll.isend(right, flat[a:b], tag))
    for u in range(min(2, len(units))):
        post(u)
    for u, (g, a, b) in enumerate(units):
        coll.step = g + 1
        coll.wait(reqs.pop(u), left)
        if g < n - 1 and b > a:
            # An overflow, a planted bad input or an upstream marker marks the segment's
            # first element, so the owner's copy and everyone's allgathered copy show it.
            combine(flat[a:b], tmp[u % 2, : b - a], g == n - 2)
        if g + 1 < total:
            sends[g + 1].append(coll.isend(right, flat[a:b], tag))
        if u + 2 < len(units):
            post(u + 2)
    for step_sends in sends:
        for r in step_sends:
            coll.wait(r, right)

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

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import kernels
from ..errors import NonFiniteError
from ..transport.base import Request, Transport
from ._common import Coll, Workspace, chunk_bounds, scratch, segment_bounds
from ._guard import guarded_allreduce

__all__ = ["ring_allreduce", "ring_pass", "SEGMENT_BYTES"]

#: Default pipeline segment (bytes); 1 MiB measured best over tcp for 1-4 MiB buffers on 4 ranks.
SEGMENT_BYTES = 1 << 20

_PHASE = 1


def ring_allreduce(
    transport: Transport,
    buf: np.ndarray,
    *,
    op: str = "mean",
    check_finite: bool = True,
    seq: int = 0,
    timeout: float | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    workspace: Workspace | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """Allreduce ``buf`` in place over every rank with the ring algorithm; returns ``buf``."""

    def body(coll: Coll, flat: np.ndarray) -> None:
        ring_pass(coll, flat, op, allgather=True, shift=0, check=check_finite,
                  segment_bytes=segment_bytes, workspace=workspace, backend=backend)

    return guarded_allreduce(transport, buf, name="ring allreduce", algo="ring", op=op, check_finite=check_finite,
                             seq=seq, timeout=timeout, backend=backend, body=body,
                             find_bad=lambda coll, flat: _first_sentinel(flat, coll.size, segment_bytes))


def _combiner(op: str, n: int, check: bool, backend: str | None) -> Callable[[np.ndarray, np.ndarray, bool], bool]:
    """``combine(acc, x, last) -> ok``: one received segment into this rank's copy."""
    if op in ("mean", "sum"):
        divide = n if op == "mean" else None

        def combine(acc: np.ndarray, x: np.ndarray, last: bool) -> bool:
            try:
                kernels.accumulate(acc, x, divide_by=divide if last else None, check_finite=check, backend=backend)
            except NonFiniteError:
                return False
            return True

        return combine
    ufunc = np.maximum if op == "max" else np.minimum

    def combine_minmax(acc: np.ndarray, x: np.ndarray, last: bool) -> bool:
        ufunc(acc, x, out=acc)  # NaN propagates: a bad input was planted as a NaN in element 0
        return True

    return combine_minmax


def ring_pass(coll: Coll, flat: np.ndarray, op: str, *, allgather: bool, shift: int, check: bool,
              segment_bytes: int = SEGMENT_BYTES, workspace: Workspace | None = None,
              backend: str | None = None) -> None:
    """Run the ring's reduce-scatter (and, with ``allgather``, its allgather) over ``flat``.

    ``shift`` rotates the schedule: after reduce-scatter rank ``q`` holds the
    reduced chunk ``q + shift + 1`` (``shift=-1`` gives every rank its own
    chunk, as reduce_scatter wants).
    """
    n, q = coll.size, coll.rank
    right, left = (q + 1) % n, (q - 1) % n
    bounds = chunk_bounds(flat.size, n)
    seg = max(1, segment_bytes // flat.itemsize)
    tag = coll.tag0 + _PHASE
    total = 2 * (n - 1) if allgather else n - 1
    base = q + shift

    def segs(c: int) -> list[tuple[int, int]]:
        c %= n
        return segment_bounds(bounds[c], bounds[c + 1], seg)

    # Setup, done once: the receive schedule (step, lo, hi) in order, two
    # scratch rows for in-flight reduce-scatter segments, the combine kernel.
    units = [(g, a, b) for g in range(total) for a, b in segs(base - g - 1)]
    tmp = scratch(workspace, "ring", (2, min(seg, bounds[1] - bounds[0])), flat.dtype)
    combine = _combiner(op, n, check, backend)
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
            if not combine(flat[a:b], tmp[u % 2, : b - a], g == n - 2):
                # An overflow, a planted bad input or an upstream sentinel: mark
                # the segment's first element so the owner's copy and everyone's
                # allgathered copy show it.
                flat[a] = np.nan
        if g + 1 < total:
            sends[g + 1].append(coll.isend(right, flat[a:b], tag))
        if u + 2 < len(units):
            post(u + 2)
    for step_sends in sends:
        for r in step_sends:
            coll.wait(r, right)


def _first_sentinel(flat: np.ndarray, n: int, segment_bytes: int) -> tuple[int, float] | None:
    """The first segment start that holds a NaN/Inf (a planted or overflowed segment), or None."""
    bounds = chunk_bounds(flat.size, n)
    seg = max(1, segment_bytes // flat.itemsize)
    for c in range(n):
        for a in range(bounds[c], bounds[c + 1], seg):
            if not math.isfinite(flat[a]):
                return a, float(flat[a])
    return None

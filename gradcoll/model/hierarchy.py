"""The cost model of a group spanning hosts: the two-level allreduce's terms, and where it beats the flat ones.

A *layout* is the number of ranks on each host (``(4, 4)``: two hosts of
four). The two-level allreduce (``gradcoll.algorithms.two_level``) is three
steps, and its time their sum:

* inside each host, up to the leader and back down: exactly the star
  allreduce's two steps on the ``L`` ranks of the largest host, so the
  star's terms (``costmodel.work``) under the *local* model (shared memory);
* between the ``H`` leaders: the better of the ring and recursive doubling
  on ``H`` ranks under the *network* model, while the other ranks wait.

So ``two_level(S) = star(L, S; local) + min(ring, rd)(H, S; net)``.
[`two_level_time`][gradcoll.model.hierarchy.two_level_time] computes it
with the closed forms of ``gradcoll.model.costmodel``; ``node_up`` and
``node_cross`` are the ``Node`` (ranks sharing cores) each step runs on.
The flat algorithms on such a group are the closed forms of
``costmodel.predict`` under the network model: every step of the ring (and
the star's root) waits for a link between hosts. `gradcoll.algorithms.simulate`
runs the real code over a simulated network with both models
(``hosts=``) and checks these sums (tests/model/test_hierarchy.py).

[`crossovers`][gradcoll.model.hierarchy.crossovers] lists where the fastest
of the flat algorithms and the two-level one changes: ``algorithm="auto"``
takes its thresholds from it for a group whose layout has more than one
host and more than one rank on some host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .costmodel import ALGORITHMS, AlphaBeta, Node, best, predict

__all__ = ["two_level_time", "step_times", "pick", "crossovers", "eligible", "CROSS"]

#: The algorithms the leaders may run between hosts.
CROSS = ("ring", "recursive_doubling")


def eligible(layout: Sequence[int]) -> bool:
    """True when the two-level allreduce differs from a flat one: several hosts, several ranks on one."""
    return len(layout) > 1 and max(layout) > 1


def step_times(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *,
               node_up: Node | None = None, node_cross: Node | None = None) -> tuple[float, float, str]:
    """(inside the hosts, between the leaders, the leaders' algorithm) of the two-level allreduce."""
    hosts, per_host = len(layout), max(layout)
    inside = predict("star", per_host, nbytes, local, node=node_up) if per_host > 1 else 0.0
    if hosts == 1:
        return inside, 0.0, "ring"
    cross = best(hosts, nbytes, net, CROSS, node=node_cross)
    return inside, predict(cross, hosts, nbytes, net, node=node_cross), cross


def two_level_time(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *,
                   node_up: Node | None = None, node_cross: Node | None = None) -> float:
    """Predicted seconds of one two-level allreduce of ``nbytes`` over ``layout`` (see the module doc)."""
    inside, cross, _ = step_times(layout, nbytes, local, net, node_up=node_up, node_cross=node_cross)
    return inside + cross


def pick(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *, node: Node | None = None,
         node_up: Node | None = None, node_cross: Node | None = None) -> str:
    """The fastest of the flat algorithms (under ``net``, on ``node``) and ``"two_level"`` for ``layout``."""
    n = sum(layout)
    flat = best(n, nbytes, net, ALGORITHMS, node=node)
    if not eligible(layout):
        return flat
    t2 = two_level_time(layout, nbytes, local, net, node_up=node_up, node_cross=node_cross)
    return "two_level" if t2 < predict(flat, n, nbytes, net, node=node) else flat


def crossovers(choose: Callable[[int], str], lo: int, hi: int) -> list[tuple[int, str, str]]:
    """``(nbytes, before, after)`` wherever ``choose(nbytes)`` changes in ``[lo, hi]`` (multiples of 4 bytes)."""
    steps = 64 * max(1, int(math.log2(hi / lo)))
    grid = sorted({int(round(lo * (hi / lo) ** (i / steps))) // 4 * 4 for i in range(steps + 1)})
    out: list[tuple[int, str, str]] = []
    prev = choose(grid[0])
    for a, b in zip(grid, grid[1:], strict=False):
        cur = choose(b)
        if cur == prev:
            continue
        left, right = a, b  # choose(left) == prev, choose(right) != prev
        while right - left > 4:
            mid = (left + right) // 8 * 4
            left, right = (mid, right) if choose(mid) == prev else (left, mid)
        out.append((right, prev, choose(right)))
        prev = cur
    return out

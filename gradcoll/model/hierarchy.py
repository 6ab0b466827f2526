"""The cost model of a group spanning hosts: the two-level allreduce's terms, and where it beats the flat ones.

A *layout* is the number of ranks on each host (``(4, 4)``: two hosts of
four). The two-level allreduce (``gradcoll.algorithms.two_level``) is three
steps, and its time their sum:

* inside each host, up to the leader and back down: exactly the star
  allreduce's two steps on the ``L`` ranks of the largest host, so the
  star's terms (``costmodel.work``) under the *local* model (shared memory);
* between the ``H`` leaders: the better of the ring and recursive doubling
  on ``H`` ranks under the *network* model, while the other ranks wait.

So ``two_level(S) = star(L, S; local) + min(ring, rd)(H, S; net)``. A tcp
group runs steps 1 and 3 through one shared window per host
(``intra="window_star"``, ``costmodel.work``'s terms: every rank checks its
input, the members copy their buffers into their slots, the leader adds its
buffer and the slots and copies the result into its own, the members copy it
out; two publish-and-wait latencies a piece) under the window's model (with
the network fit's last-level cache where a host's ranks share cores:
``host_model``), and its members sleep in the kernel while the leaders work
(``node_split(..., sleeping=True)``). ``frame_s`` adds the call's fixed cost
outside the transports (the guarded frame, the three steps' bookkeeping), a
rank's CPU, times the ranks sharing a core: ``benches/bench_two_level.py
--fit`` measures it and stores it (``stored_frame_s``).
[`two_level_time`][gradcoll.model.hierarchy.two_level_time] computes it
with the closed forms of ``gradcoll.model.costmodel``; ``node_up`` and
``node_cross`` are the ``Node`` (ranks sharing cores) each step runs on.
A flat algorithm on a group over one transport pays that transport on every
link: ``algorithm="auto"`` predicts it with ``costmodel.predict`` under the
transport's model, as on one host. On a cluster whose links inside a host
are faster than between hosts, [`flat_time`][gradcoll.model.hierarchy.flat_time]
gives the flat ring and recursive doubling with ranks placed host by host:

* recursive doubling: its first ``log2 L`` rounds pair ranks of one host,
  the other ``log2 H`` cross: ``rd(L, S; local) + rd(H, S; net)`` (``n`` a
  power of two);
* the ring: a value travels ``2 (n - 1)`` hops, about ``2 (n - 1) / n`` times
  round the ring, so its latency is that many times the sum over the links
  (``H`` between hosts, ``n - H`` inside), plus the reductions; unless a
  rank sending across, ``2 (n - 1)`` times ``beta S / n`` of network, is
  slower (then that, plus the reductions): the larger of the two. Within
  about 10% of the simulation (an upper bound for large buffers, where the
  simulated ring hides part of the reduction behind the link).

`gradcoll.algorithms.simulate` runs the real code over a simulated network
with both models (``hosts=``, ``local=``) and checks these closed forms
(tests/model/test_hierarchy.py).

[`crossovers`][gradcoll.model.hierarchy.crossovers] lists where the fastest
of the flat algorithms and the two-level one changes: ``algorithm="auto"``
takes its thresholds from it for a group whose layout has more than one
host and more than one rank on some host.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence

from ..errors import UsageError
from .costmodel import ALGORITHMS, FITTED_PATH, AlphaBeta, Node, best, predict

__all__ = ["two_level_time", "step_times", "host_model", "flat_time", "pick", "crossovers", "eligible", "node_split", "CROSS",
           "INTRA", "FRAME_KEY", "stored_frame_s", "frame_time"]

#: How steps 1 and 3 move the bytes (``costmodel.work``'s names): messages, or one shared window per host.
INTRA = ("star", "window_star")
#: Where ``fitted.json`` keeps the two-level allreduce's fixed cost per call (``{"frame_s": ..., ...}``).
FRAME_KEY = "two_level"

#: The algorithms the leaders may run between hosts.
CROSS = ("ring", "recursive_doubling")


def eligible(layout: Sequence[int]) -> bool:
    """True when the two-level allreduce differs from a flat one: several hosts, several ranks on one."""
    return len(layout) > 1 and max(layout) > 1


def node_split(layout: Sequence[int], node: Node | None, *, sleeping: bool = False) -> tuple[Node | None,
                                                                                           Node | None]:
    """The nodes of the two-level steps when every rank of ``layout`` shares ``node``'s cores (one machine).

    Inside the hosts, the ``H`` hosts' steps run at once, so each host's ``L``
    ranks get ``L / n`` of the cores. Between the hosts, the ``H`` leaders get
    ``H / n`` of them too where the other ranks, waiting for the result, keep
    polling their links (steps 1 and 3 by messages: the pollers take the
    leaders' cores, so the leaders' exchange runs several times slower than
    on their ranks alone); with ``sleeping`` (the window's steps, whose
    waiters sleep in the kernel) the leaders have the node's cores. ``None``
    (a core per rank) stays None.
    """
    if node is None:
        return None, None
    n = sum(layout)
    cross = node.cores if sleeping else node.cores * len(layout) / n
    return Node(max(layout), node.cores * max(layout) / n), Node(len(layout), cross)


def stored_frame_s(path: str = FITTED_PATH) -> float:
    """The two-level allreduce's fixed CPU per call and rank stored by ``benches/bench_two_level.py --fit`` (0: none)."""
    try:
        with open(path) as f:
            return float(json.load(f).get(FRAME_KEY, {}).get("frame_s", 0.0))
    except (OSError, ValueError, AttributeError):
        return 0.0


def frame_time(frame_s: float, n: int, node: Node | None) -> float:
    """``frame_s`` of every rank, on the cores the ``n`` ranks share (``node``; None: a core each)."""
    return frame_s * (max(1.0, min(node.ranks, n) / node.cores) if node is not None else 1.0)


def host_model(intra: str, local: AlphaBeta, net: AlphaBeta, node_up: Node | None) -> AlphaBeta:
    """The model of steps 1 and 3: ``local``, but where the window's steps run on a host whose ranks share
    cores (``node_up``), with the last-level cache of ``net``'s fit (``cache_bytes``, the cache a rank's own
    work sees). The window's fit is the direct allreduce's, whose every rank reads slots written on other
    cores; a host of ranks on the same cores writes and reads its slots through those cores' caches, so the
    last-level cache predicts such a host's large calls where the window's own cache figure predicts them too
    long (``benches/bench_two_level.py`` compares the two)."""
    if intra != "window_star" or node_up is None or node_up.ranks <= node_up.cores:
        return local
    return dataclasses.replace(local, cache_bytes=max(local.cache_bytes, net.cache_bytes))


def step_times(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *,
               node_up: Node | None = None, node_cross: Node | None = None,
               intra: str = "star") -> tuple[float, float, str]:
    """(inside the hosts, between the leaders, the leaders' algorithm) of the two-level allreduce."""
    if intra not in INTRA:
        raise UsageError(f"intra must be one of {', '.join(INTRA)}; got {intra!r}")
    hosts, per_host = len(layout), max(layout)
    inside = predict(intra, per_host, nbytes, host_model(intra, local, net, node_up), node=node_up) \
        if per_host > 1 else 0.0
    if hosts == 1:
        return inside, 0.0, "ring"
    cross = best(hosts, nbytes, net, CROSS, node=node_cross)
    return inside, predict(cross, hosts, nbytes, net, node=node_cross), cross


def two_level_time(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *,
                   node_up: Node | None = None, node_cross: Node | None = None, intra: str = "star",
                   frame_s: float = 0.0, node: Node | None = None) -> float:
    """Predicted seconds of one two-level allreduce of ``nbytes`` over ``layout`` (see the module doc).

    ``frame_s``: the fixed CPU per call and rank, on ``node``'s cores (``frame_time``)."""
    inside, cross, _ = step_times(layout, nbytes, local, net, node_up=node_up, node_cross=node_cross, intra=intra)
    return inside + cross + frame_time(frame_s, sum(layout), node)


def pick(layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *, node: Node | None = None,
         node_up: Node | None = None, node_cross: Node | None = None, intra: str = "star",
         frame_s: float = 0.0) -> str:
    """The fastest of the flat algorithms (under ``net``, on ``node``) and ``"two_level"`` for ``layout``."""
    n = sum(layout)
    flat = best(n, nbytes, net, ALGORITHMS, node=node)
    if not eligible(layout):
        return flat
    t2 = two_level_time(layout, nbytes, local, net, node_up=node_up, node_cross=node_cross, intra=intra,
                        frame_s=frame_s, node=node)
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


def flat_time(algorithm: str, layout: Sequence[int], nbytes: float, local: AlphaBeta, net: AlphaBeta, *,
              shared_nic: bool = False) -> float:
    """Predicted seconds of a flat ``ring`` or ``recursive_doubling`` on ``layout`` (equal hosts, see the module doc).

    Every rank has a core of its own; links inside a host follow ``local``,
    between hosts ``net``; the reductions cost ``net``'s ``gamma``. With
    ``shared_nic`` a host's ranks share one network port: recursive
    doubling's rounds between hosts, where all ``L`` of them send at once,
    take ``L`` times the link bytes (the ring sends across one rank per host
    at a time, the two-level allreduce only from the leader: neither
    changes). The simulation gives each rank its own port (``shared_nic=False``).
    """
    hosts, per_host = len(layout), max(layout)
    n = hosts * per_host
    if any(h != per_host for h in layout):
        raise UsageError(f"flat_time needs hosts of equal size, got {list(layout)}")
    if hosts == 1 or per_host == 1:
        return predict(algorithm, n, nbytes, local if hosts == 1 else net)
    if algorithm == "recursive_doubling":
        port = per_host if shared_nic else 1
        crossing = predict(algorithm, hosts, nbytes, net)
        return predict(algorithm, per_host, nbytes, local) + crossing + (port - 1) * nbytes * net.beta_s_per_byte * \
            math.log2(hosts)
    if algorithm != "ring":
        raise UsageError(f"flat_time covers ring and recursive_doubling, not {algorithm!r}")
    m, steps = nbytes / n, 2 * (n - 1)

    def hop(model: AlphaBeta) -> float:
        return model.alpha_s + (model.beta_s_per_byte + 2 * model.delta_s_per_byte) * m

    reduce = (n - 1) * m * net.gamma_s_per_byte
    chain = steps / n * (hosts * hop(net) + (n - hosts) * hop(local))
    return reduce + max(chain, steps * net.beta_s_per_byte * m)

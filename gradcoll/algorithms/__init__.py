"""Collective algorithms, written only against the Transport interface and the kernels.

Every function takes a transport and a NumPy buffer, works in place, and
starts with the handshake of :mod:`._handshake` (so every rank agrees on
what runs, who is here and whether the inputs are finite, and raises the
same error if not). :class:`~gradcoll.group.ProcessGroup` is the usual way
in; these functions are the layer below it.

Allreduce algorithms, chosen by :func:`select_allreduce` for ``"auto"``:

* ``recursive_doubling``: log2(n) rounds, latency-optimal for small buffers;
* ``star``: everything through rank 0, two steps, rank-order summation;
* ``ring``: bandwidth-optimal, pipelined, for large buffers.

Every function also takes ``backend=`` (a kernel backend name) where it
reduces, and ``workspace=`` to reuse scratch buffers across calls.
"""

from __future__ import annotations

from typing import Callable

from .allgather import allgather
from .barrier import barrier
from .broadcast import broadcast
from .recursive_doubling import recursive_doubling_allreduce
from .reduce_scatter import reduce_scatter
from .ring import ring_allreduce
from .star import star_allreduce

__all__ = [
    "ALLREDUCE",
    "select_allreduce",
    "ring_allreduce",
    "star_allreduce",
    "recursive_doubling_allreduce",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "barrier",
    "SMALL_BYTES",
    "RING_BYTES",
    "STAR_MAX_RANKS",
]

#: Allreduce algorithms by name.
ALLREDUCE: dict[str, Callable[..., object]] = {
    "ring": ring_allreduce,
    "star": star_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
}

#: From this many bytes on "auto" uses the ring on 3+ ranks.
RING_BYTES = 4 << 20
#: Up to this many ranks "auto" sends buffers below RING_BYTES through the star.
STAR_MAX_RANKS = 8
#: Beyond STAR_MAX_RANKS, up to this many bytes "auto" uses recursive doubling.
SMALL_BYTES = 64 << 10


def select_allreduce(nbytes: int, size: int) -> str:
    """The algorithm ``algorithm="auto"`` runs for a buffer of ``nbytes`` on ``size`` ranks.

    Measured on the 2-core development machine (docs/algorithms/collectives.md,
    "Choosing an algorithm"): on 2 ranks recursive doubling is one exchange
    and was fastest or tied at every size over tcp; on 3-8 ranks the star
    won up to 1 MiB (fewest sequential steps, which dominate when ranks
    share few cores) and the ring tied or won from 4 MiB. Beyond 8 ranks (not
    measurable here) the star's root becomes the bottleneck, so small
    buffers go to recursive doubling (log2 n rounds) and the rest to the ring.
    """
    if size <= 2:
        return "recursive_doubling"
    if nbytes >= RING_BYTES:
        return "ring"
    if size <= STAR_MAX_RANKS:
        return "star"
    return "recursive_doubling" if nbytes <= SMALL_BYTES else "ring"

"""Collective algorithms, written only against the Transport interface and the kernels.

Every function takes a transport and a NumPy buffer and works in place.
The allreduces send no agreement round before their data: their tags carry
the call's descriptor and a bad input travels as a planted NaN, and only when
something goes wrong do the ranks exchange records to agree on the error
(:mod:`._guard`). Broadcast, allgather, reduce_scatter and barrier still
start with the handshake round of :mod:`._handshake`. Either way every rank
agrees on what ran, who was there and whether the inputs were finite, and
raises the same error if not. :class:`~gradcoll.group.ProcessGroup` is the
usual way in; these functions are the layer below it.

Allreduce algorithms, chosen by :func:`select_allreduce` for ``"auto"``:

* ``recursive_doubling``: log2(n) rounds, latency-optimal for small buffers;
* ``star``: everything through rank 0, two steps, rank-order summation;
* ``ring``: bandwidth-optimal, pipelined, for large buffers.

Every function also takes ``backend=`` (a kernel backend name) where it
reduces, and ``workspace=`` to reuse scratch buffers across calls.
"""

from __future__ import annotations

from collections.abc import Callable

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
    "PAIR_RING_BYTES",
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
#: From this many bytes on "auto" uses the ring on 2 ranks.
PAIR_RING_BYTES = 1 << 20
#: Up to this many ranks "auto" sends buffers below RING_BYTES through the star
#: (or recursive doubling when the world size is a power of two).
STAR_MAX_RANKS = 8
#: Beyond STAR_MAX_RANKS, up to this many bytes "auto" uses recursive doubling.
SMALL_BYTES = 64 << 10


def select_allreduce(nbytes: int, size: int) -> str:
    """The algorithm ``algorithm="auto"`` runs for a buffer of ``nbytes`` on ``size`` ranks.

    Measured on the 2-core development machine over shm and tcp once the
    agreement round left the happy path (docs/algorithms/collectives.md,
    "Choosing an algorithm"): on 2 ranks recursive doubling (one exchange)
    wins below 1 MiB and the ring (half the bytes through each copy) from
    1 MiB; on 3-8 ranks recursive doubling wins below 4 MiB when the world
    size is a power of two (no fold), the star otherwise (two steps against
    four), and the ring from 4 MiB. Beyond 8 ranks (not measurable here) the
    star's root becomes the bottleneck, so small buffers go to recursive
    doubling (log2 n rounds) and the rest to the ring.
    """
    if size <= 2:
        return "recursive_doubling" if nbytes < PAIR_RING_BYTES else "ring"
    if nbytes >= RING_BYTES:
        return "ring"
    if size <= STAR_MAX_RANKS:
        return "recursive_doubling" if size & (size - 1) == 0 else "star"
    return "recursive_doubling" if nbytes <= SMALL_BYTES else "ring"

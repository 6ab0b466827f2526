"""Collective algorithms, written only against the Transport interface and the kernels.

Every function takes a transport and a NumPy buffer and works in place.
The allreduces send no agreement round before their data: their tags carry
the call's descriptor and a bad input travels as a planted NaN, and only when
something goes wrong do the ranks exchange records to agree on the error
(``gradcoll.algorithms._guard``). Broadcast, allgather, reduce_scatter and barrier still
start with the handshake round of ``gradcoll.algorithms._handshake``. Either way every rank
agrees on what ran, who was there and whether the inputs were finite, and
raises the same error if not: one verdict table decides it
(``gradcoll.algorithms._verdict``), and every tag comes from one registry
(``gradcoll.algorithms.tags``). [`ProcessGroup`][gradcoll.group.ProcessGroup] is the
usual way in; these functions are the layer below it.

Allreduce algorithms, chosen by [`select_allreduce`][gradcoll.algorithms.select_allreduce] for ``"auto"`` (the
one the cost model of ``gradcoll.costmodel``, fitted to measurements,
predicts fastest):

* ``recursive_doubling``: log2(n) rounds, latency-optimal for small buffers;
* ``star``: everything through rank 0, two steps, rank-order summation;
* ``ring``: bandwidth-optimal, pipelined, for large buffers;
* ``halving_doubling``: the ring's bytes in ``2 log2(n)`` rounds (a
  reduce-scatter by recursive halving, an allgather by recursive doubling);
* ``direct``: where the ranks share memory (one host), every rank reads
  every rank's slot of a shared window (``gradcoll.algorithms.direct``):
  ``auto`` runs it whenever the transport offers a window.
* ``two_level``: for groups spanning hosts, inside each host, between one
  leader per host, and back (picked when the group's host layout is given
  and the model of ``gradcoll.model.hierarchy`` predicts it fastest);
* ``tree``: a binomial reduce to rank 0 and a binomial broadcast (named
  only: ``auto`` prefers recursive doubling's fewer rounds).

Every schedule runs every variant (``gradcoll.algorithms.rows``): the
deterministic and low-precision wire allreduces take ``algorithm=`` as the
plain one does. ``gradcoll.algorithms.registry`` holds the one list.

Every function also takes ``backend=`` (a kernel backend name) where it
reduces, and ``workspace=`` to reuse scratch buffers across calls.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

from ..model import hierarchy
from ..model.costmodel import Node, best, crossovers, stored_models
from ._common import OPS, REDUCE_DTYPES, Workspace, check_op
from ._witness import announce_close
from ._witness import attach as attach_witnesses
from ._witness import wake as wake_collective
from .allgather import allgather
from .barrier import barrier
from .broadcast import broadcast
from .direct import direct_allreduce
from .halving_doubling import halving_doubling_allreduce
from .recursive_doubling import recursive_doubling_allreduce
from .reduce_scatter import reduce_scatter
from .registry import SCHEDULES, Schedule, schedule
from .ring import ring_allreduce
from .star import star_allreduce
from .tree import tree_allreduce
from .two_level import two_level_allreduce

__all__ = [
    "ALLREDUCE",
    "OPS",
    "REDUCE_DTYPES",
    "Workspace",
    "check_op",
    "SCHEDULES",
    "Schedule",
    "schedule",
    "select_allreduce",
    "tree_allreduce",
    "ring_allreduce",
    "star_allreduce",
    "two_level_allreduce",
    "recursive_doubling_allreduce",
    "halving_doubling_allreduce",
    "direct_allreduce",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "barrier",
    "auto_thresholds",
    "SEARCH_BYTES",
    "DEFAULT_TRANSPORT",
    "attach_witnesses",
    "announce_close",
    "wake_collective",
]

#: Allreduce algorithms by name: each schedule's plain form (``SCHEDULES`` has the whole entries).
ALLREDUCE: dict[str, Callable[..., object]] = {name: s.allreduce for name, s in SCHEDULES.items()}

#: Where "auto" looks for crossovers: below the first size the algorithm that wins there, above the last the one that wins there.
SEARCH_BYTES = (64, 1 << 30)
#: The stored model "auto" uses for a transport that has none of its own (``transport=None`` included).
DEFAULT_TRANSPORT = "shm"
#: The stored model of the links inside a host, for the two-level allreduce's first and last steps.
LOCAL_TRANSPORT = "shm"
#: The stored model of the shared window (``gradcoll.model.window_model.WINDOW_MODEL``): a tcp group's two-level
#: steps inside a host.
WINDOW_TRANSPORT = "window"


@functools.lru_cache(maxsize=1024)
def auto_thresholds(size: int, transport: str | None = None,
                    layout: tuple[int, ...] | None = None) -> tuple[tuple[int, str], ...]:
    """What ``algorithm="auto"`` runs on ``size`` ranks: ``((from_bytes, algorithm), ...)``, ascending from 0.

    Derived once per (world size, transport, layout) from the cost model
    fitted to this project's measurements (``gradcoll.costmodel.stored_models``,
    written by ``benches/fit_costmodel.py --write``) with
    ``gradcoll.costmodel.crossovers``. Up to the largest world measured,
    the ranks share a node with the measured number of cores, as they did
    when measured; beyond it every rank has a core of its own. ``layout``
    (ranks per host, see ``gradcoll.model.hierarchy``) adds the two-level
    allreduce where it spans several hosts with several ranks on one: its
    steps inside a host under the shm model (a tcp group's: through the
    shared window, under the window's model), between the leaders under the
    transport's, plus its fixed cost per call (``hierarchy.stored_frame_s``).
    """
    models = stored_models()
    model, cores, max_ranks = models.get(transport or DEFAULT_TRANSPORT) or models[DEFAULT_TRANSPORT]
    if size <= 1:
        return ((0, "recursive_doubling"),)
    node = Node(size, cores) if cores is not None and size <= max_ranks else None
    lo, hi = SEARCH_BYTES
    if layout is not None and sum(layout) == size and hierarchy.eligible(layout):
        # a tcp group's steps inside a host go through one shared window per host, others' by messages
        windowed = transport == "tcp" and WINDOW_TRANSPORT in models
        local = models[WINDOW_TRANSPORT if windowed else LOCAL_TRANSPORT if LOCAL_TRANSPORT in models
                       else DEFAULT_TRANSPORT][0]
        up, cross = hierarchy.node_split(layout, node, sleeping=windowed)
        intra, frame_s = ("window_star" if windowed else "star"), hierarchy.stored_frame_s()

        def choose(nbytes: int) -> str:
            return hierarchy.pick(layout, nbytes, local, model, node=node, node_up=up, node_cross=cross,
                                  intra=intra, frame_s=frame_s)

        return ((0, choose(lo)),) + tuple((at, after) for at, _, after in hierarchy.crossovers(choose, lo, hi))
    out = [(0, best(size, lo, model, node=node))]
    out.extend((at, after) for at, _, after in crossovers(model, size, lo=lo, hi=hi, node=node))
    return tuple(out)


def select_allreduce(nbytes: int, size: int, transport: str | None = None, shared_memory: bool = False,
                     layout: tuple[int, ...] | None = None) -> str:
    """The algorithm ``algorithm="auto"`` runs for a buffer of ``nbytes`` on ``size`` ranks over ``transport``.

    ``direct`` whenever the ranks share memory (``shared_memory``: the
    transport offers a window, ``Transport.shared_memory``) and there are
    two or more. Otherwise the one the cost model predicts fastest (docs/scaling.md, "Crossovers and
    ``algorithm="auto"``"): the thresholds come from [`auto_thresholds`][gradcoll.algorithms.auto_thresholds],
    computed once per world size, transport name (``"shm"``, ``"tcp"``;
    other names and None use the ``DEFAULT_TRANSPORT`` model) and host
    ``layout`` (ranks per host; None: not known, no two-level), so a call
    is a cached lookup and a bisection.
    """
    if shared_memory and size > 1:
        return "direct"
    table = auto_thresholds(size, transport, layout)
    return table[bisect.bisect_right(table, (nbytes, "~")) - 1][1]

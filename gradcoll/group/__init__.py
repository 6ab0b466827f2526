"""ProcessGroup: the collectives of one group of ranks, over one transport.

A [`ProcessGroup`][gradcoll.group.ProcessGroup] is an explicit object (there is no default group).
It numbers every collective (``seq``, the same on every rank when every rank
makes the same calls), picks an algorithm, runs it on the caller's buffer in
place, and returns the buffer.

``async_op=True`` returns a [`Work`][gradcoll.group.Work] at once; the collective runs on
the group's one background thread, in submission order, so communication
overlaps the caller's compute. A synchronous call made while asynchronous
work is queued waits its turn behind it, which keeps the order of
collectives the same on every rank. A group is meant to be driven by one
thread (like a CUDA stream); ``Work`` handles may be waited on from any.

Failure is sticky: a collective that raises poisons the group, and every
later call raises [`GroupPoisoned`][gradcoll.errors.GroupPoisoned] chained to the
original error. Misuse caught before anything is sent (a wrong dtype, an
unknown op) raises [`UsageError`][gradcoll.errors.UsageError] and does not.

``algorithm="auto"`` runs what the cost model fitted to this project's
measurements predicts fastest for the message size, the world size and the
transport ([`gradcoll.algorithms.select_allreduce`][gradcoll.algorithms.select_allreduce]; the thresholds and
how they are derived are in docs/scaling.md).

This package is the group layer: `ProcessGroup` (``process_group``), `Work`
and the in-order executor (``work``), `init_process_group` (``rendezvous``),
building a group from a store (``connect``), the survivors' agreement of
``shrink``, buffer conversion (``buffers``), and the host layout and
subgroups (``topology``, bootstrapped through the parent by ``subgroup``). The front ends build on it;
it builds on the algorithms, the transports, the bootstrap store and
`gradcoll.observe`. Inside it the imports point one way:
``rendezvous -> connect -> shrink, process_group -> topology -> subgroup``
and ``process_group -> work, buffers``; a group
reaches ``connect`` only through the membership object it is handed.
"""

from .process_group import ProcessGroup, Work
from .rendezvous import init_process_group
from .topology import NonMember, new_group

__all__ = ["ProcessGroup", "Work", "init_process_group", "new_group", "NonMember"]

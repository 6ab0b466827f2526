"""The variants' side of a schedule: raw contributions gathered, reduced once where all of them meet, shared.

An allreduce is a *schedule* (which rank sends what to whom, in which
rounds) run in a *variant* (what travels and how contributions combine).
The plain variant sends partial sums and adds them as they arrive: each
schedule's own ``*_allreduce``. The other variants cannot add as they go:

* ``deterministic=True`` must give bits that depend on the contributions
  alone, not on how partial sums were grouped, so every element is reduced
  by one exact kernel call that sees all ``n`` contributions at once
  (``gradcoll.kernels.exact_reduce``);
* ``wire_dtype="bf16"|"fp16"`` rounds every contribution once to the wire
  format and sums in float32 in rank order, so the error does not grow with
  the number of hops and every rank keeps the same rounded result.

Both are the same schedule shape: *gather* the raw rows of each piece of
the buffer at the rank that owns it (by the schedule's own pattern of
messages), *reduce* the ``n`` rows of the piece there, *share* the result by
the schedule's allgather. So every schedule has a rows form, with the
signature ``RowsSchedule``, and a variant is a ``Rows`` value: the element
type that travels and how ``n`` rows in rank order become one. Any schedule
runs any variant.

A schedule's rows form declares in ``coll.marks`` the first element of
every piece it reduces: ``Rows.reduce`` plants its marker there when a sum
overflows (``gradcoll.algorithms._guard``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ._common import Coll, Workspace, scratch

__all__ = ["Rows", "RowsCall", "RowsSchedule", "gather_into"]


class Rows(Protocol):
    """A variant: how the ``n`` raw rows of one piece, in rank order, become the result."""

    def reduce(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Reduce ``rows`` (``(n, m)``, row ``i`` from rank ``i``) into ``out`` (``m`` elements of the wire type).

        ``out`` never overlaps ``rows``. A result that is not finite is
        marked at ``out[0]`` (``_common.plant``), which the schedule
        declared in ``coll.marks``.
        """


@dataclass(slots=True)
class RowsCall:
    """One call of a rows schedule: this rank's contribution, the variant, and the schedule's options.

    ``data`` holds this rank's raw contribution in the wire type and ends
    with the result, the same bits on every rank. ``hosts`` labels every
    rank's host (the two-level schedule's layout; None: one host).
    """

    data: np.ndarray
    rows: Rows
    workspace: Workspace | None = None
    segment_bytes: int = 1 << 20
    hosts: Sequence[Hashable] | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def scratch(self, name: str, shape: int | tuple[int, ...]) -> np.ndarray:
        """A scratch array of the wire type (reused across calls through the workspace)."""
        return scratch(self.workspace, "rows_" + name, shape, self.data.dtype)


#: A schedule's rows form: ``fn(coll, call)`` leaves the reduced result in ``call.data`` on every rank.
RowsSchedule = Callable[[Coll, RowsCall], None]


def gather_into(rows: np.ndarray, at: Sequence[int], block: np.ndarray) -> None:
    """Put the rows of ``block`` (from the ranks ``at``, in that order) at those ranks' rows of ``rows``."""
    if len(at) and rows.shape[1]:
        if list(at) == list(range(at[0], at[0] + len(at))):
            rows[at[0]: at[0] + len(at)] = block
        else:
            rows[list(at)] = block

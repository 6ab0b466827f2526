"""The allreduce schedules by name: one entry each, the only list of them.

An entry names the schedule's plain form (partial sums added as they
arrive, ``*_allreduce``) and its rows form (``gradcoll.algorithms.rows``:
raw rows reduced once where they meet), which the deterministic and the
low-precision wire variants run, so every variant runs on every schedule.
``needs`` says what the schedule asks of a group: ``"window"``, ranks that
share memory (``Transport.shared_memory``). A schedule's cost-model terms
(for ``auto``) come with its module (``gradcoll.model.work.register_work``
where the model does not know it already).

Adding a schedule is one module with its two forms (and its cost-model
terms, where ``auto`` should weigh it) plus one line of ``SCHEDULES``; its
code in the records and descriptor tags comes from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..errors import UsageError
from ._handshake import register_algo
from .direct import direct_allreduce
from .halving_doubling import halving_doubling_allreduce, hd_rows
from .recursive_doubling import rd_rows, recursive_doubling_allreduce
from .ring import ring_allreduce, ring_rows
from .rows import RowsSchedule
from .star import star_allreduce, star_rows
from .tree import tree_allreduce, tree_rows
from .two_level import two_level_allreduce, two_level_rows

__all__ = ["Schedule", "SCHEDULES", "schedule"]


class Schedule(NamedTuple):
    """One allreduce schedule: its plain form, its rows form (None: the variants have forms of their own, as the
    shared window's do), and what it needs of a group."""

    name: str
    allreduce: Callable[..., object]
    rows: RowsSchedule | None
    needs: str | None = None


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("ring", ring_allreduce, ring_rows),
    Schedule("star", star_allreduce, star_rows),
    Schedule("recursive_doubling", recursive_doubling_allreduce, rd_rows),
    Schedule("halving_doubling", halving_doubling_allreduce, hd_rows),
    Schedule("direct", direct_allreduce, None, needs="window"),
    Schedule("two_level", two_level_allreduce, two_level_rows),
    Schedule("tree", tree_allreduce, tree_rows),
)}


for _name in SCHEDULES:
    register_algo(_name)  # its code in the records and descriptor tags


def schedule(name: str) -> Schedule:
    """The entry of ``name``, or UsageError naming the known ones."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown allreduce algorithm {name!r}; known: auto, {', '.join(SCHEDULES)}") from None

"""``gradcoll stragglers TRACE.json [...]``: which ranks made the others wait.

Reads Chrome traces written by [`ProcessGroup`][gradcoll.group.ProcessGroup]
(per-rank files or one merged file, see [`gradcoll.observe.trace`][gradcoll.observe.trace]) and matches
the events of one collective across ranks by sequence number (and world
size, so the groups before and after a ``shrink()`` stay apart). In every
collective the rank that arrived last held up every other: each other rank
``r`` waited ``arrival(last) - arrival(r)`` for it. [`rank_stragglers`][gradcoll.observe.stragglers.rank_stragglers]
charges that whole wait to the last arriver and ranks the ranks by it.
Arrival times are wall-clock, so ranks on different hosts compare only as
well as their clocks agree. The ``gradcoll stragglers`` command
(`gradcoll.cli.stragglers`) prints this table from trace files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Straggler", "rank_stragglers"]


@dataclass(frozen=True)
class Straggler:
    """One rank's share of the waiting, over ``collectives`` matched collectives."""

    rank: int
    collectives: int
    last: int  # how often it arrived last
    caused_wait_s: float  # the others' waiting charged to it
    mean_lateness_s: float  # mean of (its arrival - the earliest arrival)
    own_wait_s: float  # time it spent blocked on peers (from the trace)


def rank_stragglers(events: Iterable[dict[str, Any]]) -> tuple[list[Straggler], dict[str, float]]:
    """The ranks by the wait they caused (most first), and a summary (count, mean and max skew in s)."""
    colls: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for ev in events:
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or ev.get("cat") != "collective" or "seq" not in args:
            continue
        colls.setdefault((int(args.get("size", 0)), int(args["seq"])), {})[int(ev["pid"])] = ev
    stats: dict[int, list[float]] = {}  # rank -> [collectives, last, caused_us, lateness_us, wait_us]
    skews: list[float] = []
    for byrank in colls.values():
        if len(byrank) < 2:
            continue
        arrive = {r: float(ev["ts"]) for r, ev in byrank.items()}
        first, last = min(arrive.values()), max(arrive, key=lambda r: (arrive[r], r))
        skews.append(arrive[last] - first)
        for r, ev in byrank.items():
            s = stats.setdefault(r, [0, 0, 0.0, 0.0, 0.0])
            s[0] += 1
            s[3] += arrive[r] - first
            s[4] += float((ev.get("args") or {}).get("wait_us", 0.0))
        stats[last][1] += 1
        stats[last][2] += sum(arrive[last] - t for t in arrive.values())
    rows = [Straggler(r, int(c), int(n), cu / 1e6, lu / 1e6 / c, wu / 1e6) for r, (c, n, cu, lu, wu) in stats.items()]
    rows.sort(key=lambda s: (-s.caused_wait_s, s.rank))
    summary = {"collectives": float(len(skews)), "mean_skew_s": sum(skews) / len(skews) / 1e6 if skews else 0.0,
               "max_skew_s": max(skews) / 1e6 if skews else 0.0}
    return rows, summary

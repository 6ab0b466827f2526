"""The halving-doubling allreduce of a power-of-two group in one compiled call (``halving_doubling_allreduce``'s
fast path): its schedule, and the plan of its rounds for ``_planned.run_plan`` (every round of the
reduce-scatter and the allgather in one ``Rounds.exchange_plan`` call; a round that stopped early was
finished by the engine, and the rounds after it run as the guard's body runs them, ``hd_pass`` with the
compiled step).
"""

from __future__ import annotations

import array
from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from ..transport.plan import COPY, DIVIDE, make
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds
from ._planned import Plan, Schedule, run_plan

__all__ = ["planned", "plan_arrays", "hd_schedule"]

NAME = "halving-doubling allreduce"


def hd_schedule(v: int, p: int) -> list[tuple[int, int, int, int, int]]:
    """The reduce-scatter rounds of active rank ``v`` of ``p``: ``(partner, keep_lo, keep_hi, send_lo, send_hi)``.

    Bounds are chunk indices (of ``p`` chunks). The allgather runs the same
    rounds backwards: in round ``k`` it sends ``keep`` and receives ``send``.
    """
    lo, hi = 0, p
    out: list[tuple[int, int, int, int, int]] = []
    for k in range(p.bit_length() - 1):
        mid = (lo + hi) // 2
        if (v >> k) & 1:
            out.append((v ^ (1 << k), mid, hi, lo, mid))
            lo = mid
        else:
            out.append((v ^ (1 << k), lo, mid, mid, hi))
            hi = mid
    return out


def plan_arrays(plan: list[tuple[int, int, int, int, int]], bounds: list[int],
                mean: bool) -> tuple[tuple[int, ...], array.array[int]]:
    """``exchange_plan``'s peers and plan (``gradcoll.transport.plan``, the tags left to each call) for ``plan``
    (``hd_schedule``'s, a power-of-two group): the reduce-scatter rounds (send ``[c, d)``, add into ``[a, b)``;
    the last divides a mean), then the allgather's in reverse (send what the round kept, copy in what it
    sent)."""
    rounds = [(0, bounds[klo], bounds[khi], bounds[slo], bounds[shi], DIVIDE if mean and k == len(plan) - 1 else 0)
              for k, (_, klo, khi, slo, shi) in enumerate(plan)]
    rounds += [(0, bounds[slo], bounds[shi], bounds[klo], bounds[khi], COPY) for _, klo, khi, slo, shi in reversed(plan)]
    return tuple(p[0] for p in plan) + tuple(p[0] for p in reversed(plan)), make(rounds)


def _build(rank: int, n: int, count: int, mean: bool, itemsize: int) -> Plan:
    bounds = chunk_bounds(count, n)
    peers, spec = plan_arrays(hd_schedule(rank, n), bounds, mean)
    rounds = len(peers) // 2
    half = bounds[n // 2]
    return Plan(bounds, peers, None, spec, (tags.HD_RS,) * rounds + (tags.HD_AG,) * rounds, max(count - half, half))


SCHEDULE = Schedule(NAME, "halving_doubling", False, _build, "hd")


def planned(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None,
            ws: Workspace | None, rest: Callable[[Coll, np.ndarray, Options, int], None]) -> bool:
    """The allreduce of ``buf`` with every round in one compiled call (``_planned.run_plan``); False: declined,
    nothing moved (the guard's path runs it). ``rest(coll, flat, opts, done)`` runs the rounds from ``done`` on
    (``hd_pass``)."""
    return run_plan(t, buf, op, check, seq, timeout, ws, rest, SCHEDULE)

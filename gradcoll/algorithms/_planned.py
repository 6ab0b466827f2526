"""An allreduce whose every round runs in one compiled call, in the guard's frame without its happy-path costs.

``run_plan`` is the frame shared by halving-doubling's plan (``_hd_planned``) and the ring's
(``ring.ring_allreduce``), as ``recursive_doubling._stepped`` is recursive doubling's: the same descriptor tag
as the guard (so a rank on the general path meets the same frames), every round in one
``Transport.exchange_plan`` call (tcp's), the input's finite check inside its first round, and the guard's
marker check on the result (the first element of every chunk). A call the transport declines before a byte
moves (another thread's work queued, a secret on a link, an input not finite in its first piece) goes to the
guard. A round that stopped early was finished by the engine, and the rounds after it run as the guard's body
runs them (``rest``), in a ``Coll`` built as the guard would have built it; every error goes through the
guard's error path (``fail``).
"""

from __future__ import annotations

import array
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..transport.base import Transport
from ..transport.plan import set_tags
from ._common import TRANSLATED, Coll, Options, Workspace, scratch
from ._guard import ERRORS, fail, lean_frame
from ._verdict import NONFINITE

__all__ = ["Plan", "Schedule", "run_plan"]


@dataclass(frozen=True)
class Plan:
    """One rank's rounds for one buffer size: the chunk bounds (markers at their starts), each round's peer sent
    to and peer received from (None: the same), the plan (``gradcoll.transport.plan``), each round's tag phase
    (``tags``), and the elements of ``tmp`` the largest reduced receive needs."""

    bounds: list[int]
    peers: tuple[int, ...]
    sources: tuple[int, ...] | None
    spec: array.array[int]
    phases: tuple[int, ...]
    tmp: int


@dataclass(frozen=True)
class Schedule:
    """An algorithm's compiled form: its name (the guard's), its ``algo`` (the descriptor's), whether it runs on
    any group size (else powers of two), ``build(rank, size, count, mean, itemsize)`` giving
    its ``Plan``, and the
    workspace's name for ``tmp`` (its general path's)."""

    name: str
    algo: str
    any_size: bool
    build: Callable[[int, int, int, bool, int], Plan]
    tmp_name: str


def run_plan(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None,
             ws: Workspace | None, rest: Callable[[Coll, np.ndarray, Options, int], None], sched: Schedule) -> bool:
    """The allreduce of ``buf`` with every round of ``sched`` in one compiled call; False: declined, nothing moved
    (the guard's path runs it). ``rest(coll, flat, opts, done)`` runs the rounds from ``done`` on."""
    frame = lean_frame(t, buf, "exchange_plan", sched.algo, op, check, seq, timeout, sched.any_size)
    if frame is None:
        return False
    flat, desc, tag0, limit, started = frame
    run, n = t.exchange_plan, t.size  # type: ignore[attr-defined]
    key = (sched.algo, flat.size, op == "mean", flat.itemsize)
    cache: dict[Any, Plan] = t.__dict__.setdefault("_lean_plans", {})
    got = cache.get(key)
    if got is None:
        got = cache[key] = sched.build(t.rank, n, flat.size, op == "mean", flat.itemsize)
    rounds = len(got.peers)
    tmp = scratch(ws, sched.tmp_name, max(got.tmp, 1), flat.dtype)
    found: list[tuple[int, float]] = []
    at = [0]
    t0 = time.perf_counter()
    try:
        set_tags(got.spec, [tag0 + p for p in got.phases])
        done = int(run(got.peers, flat, tmp, got.spec, max(0.0, started + limit - time.monotonic()), n, check, found,
                       at, got.sources))
    except ERRORS as exc:
        failed = _coll(t, sched.name, flat, seq, limit, started, desc, tag0, rounds, at[0], found)
        peer = getattr(exc, "peer", None)  # (the engine's errors name the link's peer)
        if type(peer) is not int:
            peer = got.peers[min(at[0], rounds - 1)]
        fail(failed, failed.translate(exc, peer) if isinstance(exc, TRANSLATED) else exc)
    finally:
        t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
    if done == 0:
        return False
    coll = _coll(t, sched.name, flat, seq, limit, started, desc, tag0, rounds, done, found) \
        if found or done < rounds else None
    if coll is not None and done < rounds:
        try:
            rest(coll, flat, Options(op, check, seq, limit, ws, None), done)
        except ERRORS as exc:
            fail(coll, exc)
    if check and flat.size:
        _markers(t, sched.name, flat, got.bounds, coll, seq, limit, started, desc, tag0, rounds, found)
    return True


def _markers(t: Transport, name: str, flat: np.ndarray, bounds: Sequence[int], coll: Coll | None, seq: int,
             limit: float, started: float, desc: tuple[int, ...], tag0: int, rounds: int,
             found: list[tuple[int, float]]) -> None:
    """The guard's marker check: the first element of every chunk."""
    for c in range(len(bounds) - 1):
        a = bounds[c]
        if bounds[c + 1] > a and not math.isfinite(flat[a]):
            fail(coll or _coll(t, name, flat, seq, limit, started, desc, tag0, rounds, rounds - 1, found), None,
                 (a, float(flat[a])))


def _coll(t: Transport, name: str, flat: np.ndarray, seq: int, limit: float, started: float, desc: tuple[int, ...],
          tag0: int, rounds: int, k: int, found: list[tuple[int, float]]) -> Coll:
    """The ``Coll`` the guard would have run this call with, at round ``k`` (of ``rounds``): for the error path and
    the rounds after a stopped one. ``found``: this rank's non-finite input element, as the guard's local check
    reports it."""
    coll = Coll(t, name, seq, flat.nbytes, limit)
    if found:
        coll.status = (NONFINITE, int(found[0][0]), float(found[0][1]))
    coll.started, coll.desc, coll.tag0, coll.pending = started, desc, tag0, {}
    coll.begin(rounds)
    coll.deadline.at = started + limit  # the call's deadline, not a fresh one
    coll.step = min(k, rounds - 1) + 1
    return coll

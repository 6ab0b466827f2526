"""An allreduce whose every round runs in one compiled call, in the guard's frame without its happy-path costs.

``run_plan`` is the frame shared by the plans of halving-doubling (``_hd_planned``), the ring and recursive
doubling: the same descriptor tag as the guard (so a rank on the general path meets the same frames), every
round in one ``Rounds.exchange_plan`` call (the transport's declared capability, ``Transport.rounds``: tcp's),
the input's finite check inside its first round, and the guard's
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
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..transport.base import Transport
from ..transport.plan import FIELDS, TAG
from . import tags
from ._common import TRANSLATED, Coll, Options, Workspace, scratch
from ._guard import ERRORS, LEAN_DTYPES, fail
from ._handshake import descriptor
from ._verdict import NONFINITE

__all__ = ["PLANNED", "Plan", "Prepared", "Schedule", "compiled_ok", "prepared", "register", "run_plan"]

#: ``run_plan``'s ``rest``: runs the rounds from ``done`` on, in the ``Coll`` the guard would have built.
Rest = Callable[[Coll, np.ndarray, Options, int], None]


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


#: ``guarded(transport, buf, op, check_finite, seq, timeout, workspace, backend)``: the algorithm in the guard's
#: frame, which runs a call its compiled one declined before a byte moved.
Guarded = Callable[[Transport, np.ndarray, str, bool, int, "float | None", "Workspace | None", "str | None"], np.ndarray]

#: Each planned algorithm's schedule, the function that runs its rounds from ``done`` on (``run_plan``'s
#: ``rest``) and its guarded form, by ``Schedule.algo``: what a prepared allreduce's ``rounds`` route runs.
PLANNED: dict[str, tuple[Schedule, Rest, Guarded]] = {}

#: How many prepared calls a transport keeps (sizes, dtypes, ops); more clears them.
_KEEP = 64
#: ``prepared``'s calls, per transport (held here, not on the transport: it is the algorithms' state).
_PLANS: weakref.WeakKeyDictionary[Transport, dict[Any, Prepared]] = weakref.WeakKeyDictionary()


def register(sched: Schedule, rest: Rest, guarded: Guarded) -> None:
    """Add ``sched``, its ``rest`` and its guarded form to ``PLANNED``."""
    PLANNED[sched.algo] = (sched, rest, guarded)


def compiled_ok(t: Transport, buf: np.ndarray, any_size: bool) -> bool:
    """Whether ``run_plan`` can take ``buf`` on ``t``: compiled rounds, a group of two or more (a power of two
    unless ``any_size``), a float32 or float64 buffer it can work on in place."""
    n = t.size
    return t.rounds is not None and n >= 2 and (any_size or not n & (n - 1)) \
        and buf.dtype in LEAN_DTYPES and buf.flags.c_contiguous and buf.flags.writeable


class Prepared:
    """``run_plan``'s call of one schedule on one element count, dtype, op and check, prepared once for repeated
    calls: the plan, the descriptor but its seq, the rounds' tag slots, and the transport's prepared rounds
    (``plan_runner``, tcp's) where it has them. A call then computes the descriptor tag, writes the tags, runs
    the compiled call and reads the markers; anything but a clean finish goes on as ``run_plan`` always did.
    Kept per transport (``prepared``); the group's fast path calls it directly."""

    __slots__ = ("t", "sched", "rest", "got", "desc", "tail", "tag_at", "runner", "check", "op", "rounds", "tmpn")

    def __init__(self, t: Transport, sched: Schedule, rest: Rest, count: int, dtype: np.dtype, op: str,
                 check: bool) -> None:
        self.t, self.sched, self.rest, self.op, self.check = t, sched, rest, op, check
        got = self.got = sched.build(t.rank, t.size, count, op == "mean", dtype.itemsize)
        self.desc = descriptor("allreduce", sched.algo, op, dtype, count, 0)[:-1]
        self.tail = (check,) + tags.PLAIN
        self.tag_at = tuple((FIELDS * k + TAG, p) for k, p in enumerate(got.phases))
        self.rounds, self.tmpn = len(got.peers), max(got.tmp, 1)
        self.runner = None if t.rounds is None else t.rounds.plan_runner(got.peers, got.sources)
        if count * dtype.itemsize > t.stray_limit:
            t.stray_limit = count * dtype.itemsize  # as the guard does: frames of this call may arrive as strays

    def __call__(self, seq: int, buf: np.ndarray, limit: float, ws: Workspace | None) -> bool:
        """The allreduce of ``buf`` (of the prepared count and dtype) as collective ``seq``; False: declined,
        nothing moved (the guard's path runs it)."""
        t, got, check = self.t, self.got, self.check
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        desc = self.desc + (seq,)
        tag0 = tags.descriptor_tag(desc + self.tail)
        spec = got.spec
        for i, p in self.tag_at:
            spec[i] = tag0 + p
        tmp = scratch(ws, self.sched.tmp_name, self.tmpn, flat.dtype)
        found: list[tuple[int, float]] = []
        at = [0]
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            if self.runner is not None:
                done = self.runner(flat, tmp, spec, limit, t.size, check, found, at)
            else:
                assert t.rounds is not None  # (``compiled_ok``)
                done = int(t.rounds.exchange_plan(got.peers, flat, tmp, spec, limit, t.size, check, found, at,
                                                  got.sources))
        except ERRORS as exc:
            failed = _coll(t, self.sched.name, flat, seq, limit, started, desc, tag0, self.rounds, at[0], found)
            peer = getattr(exc, "peer", None)  # (the engine's errors name the link's peer)
            if type(peer) is not int:
                peer = got.peers[min(at[0], self.rounds - 1)]
            fail(failed, failed.translate(exc, peer) if isinstance(exc, TRANSLATED) else exc)
        finally:
            t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
        if done == 0:
            return False
        coll = None
        if found or done < self.rounds:
            coll = _coll(t, self.sched.name, flat, seq, limit, started, desc, tag0, self.rounds, done, found)
            if done < self.rounds:
                try:
                    self.rest(coll, flat, Options(self.op, check, seq, limit, ws, None), done)
                except ERRORS as exc:
                    fail(coll, exc)
        if check and flat.size:
            _markers(t, self.sched.name, flat, got.bounds, coll, seq, limit, started, desc, tag0, self.rounds, found)
        return True


def prepared(t: Transport, sched: Schedule, rest: Rest, count: int, dtype: np.dtype, op: str,
             check: bool) -> Prepared:
    """The transport's ``Prepared`` call of ``sched`` on ``count`` elements of ``dtype`` (kept per transport)."""
    key = (sched.algo, count, dtype, op, check)
    cache = _PLANS.get(t)
    if cache is None:
        cache = _PLANS[t] = {}
    got = cache.get(key)
    if got is None:
        if len(cache) >= _KEEP:
            cache.clear()
        got = cache[key] = Prepared(t, sched, rest, count, dtype, op, check)
    return got


def run_plan(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None,
             ws: Workspace | None, rest: Rest, sched: Schedule) -> bool:
    """The allreduce of ``buf`` with every round of ``sched`` in one compiled call; False: declined, nothing moved
    (the guard's path runs it). ``rest(coll, flat, opts, done)`` runs the rounds from ``done`` on."""
    if not compiled_ok(t, buf, sched.any_size):
        return False
    run = prepared(t, sched, rest, buf.size, buf.dtype, op, bool(check))
    return run(seq, buf, t.timeout if timeout is None else timeout, ws)


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

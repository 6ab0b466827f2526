"""The capability tiers of the conformance suite: a check per optional capability a transport declares.

``gradcoll.transport.base`` declares two optional capabilities beyond
send and receive: ``shared_memory`` (with ``group_window``) and ``rounds``
(compiled exchange-and-reduce rounds, ``gradcoll.transport.plan.Rounds``).
Each check here runs on every transport: where the capability is declared it
checks that it works (exact sums against NumPy, the declined outcomes move
nothing, the link stays in step); where it is not, that the transport says
so consistently. ``CHECKS`` is the whole suite, the core checks
(``gradcoll.testing.checks``) and these.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from ..transport.base import Transport
from ..transport.plan import COPY, DECLINED, MOVED, REDUCED, make
from .checks import CORE_CHECKS, Check, Ctx, _check

__all__ = ["CAPABILITY_CHECKS", "CHECKS"]

_USER = 0x777  # a user point-to-point tag (gradcoll.algorithms.tags: 0 .. 0x0FFFFFFF)


def _values(rank: int, count: int, dtype: type) -> np.ndarray:
    """Small integers (every order of their sum is exact), different on every rank."""
    return ((np.arange(count) * 7 + rank * 3) % 1000).astype(dtype)


@_check(2)
def _rounds_exchange_reduce(t: Transport, ctx: Ctx) -> None:
    """``rounds.exchange_reduce``: the peer's array added in (divided), or declined with nothing moved."""
    if t.rounds is None:
        return
    peer = 1 - t.rank
    for dtype, count in ((np.float32, 1000), (np.float64, 3), (np.float32, 0)):
        acc, tmp = _values(t.rank, count, dtype), np.empty(count, dtype)
        got = t.rounds.exchange_reduce(peer, acc, tmp, _USER, 10.0, 2.0, True, True, [])
        assert got in (DECLINED, MOVED, REDUCED), f"exchange_reduce returned {got!r}"
        if got == DECLINED:  # nothing moved: the general path's exchange, which must still be in step
            t.sendrecv(peer, acc, peer, tmp, _USER, 10.0)
        if got != REDUCED:
            acc = (acc + tmp) / dtype(2)
        want = (_values(0, count, np.float64) + _values(1, count, np.float64)) / 2
        assert np.array_equal(acc, want.astype(dtype)), f"exchange_reduce of {count} {dtype.__name__}: wrong sum"
        ctx.barrier()


@_check(2)
def _rounds_plan(t: Transport, ctx: Ctx) -> None:
    """``rounds.exchange_plan`` and ``plan_runner``: a two-round plan (reduce-scatter, then allgather) leaves the
    sum on both ranks; a plan declined (0 rounds done) moved nothing."""
    if t.rounds is None:
        assert t.rounds is None  # (a transport without the capability says so: nothing else to check)
        return
    peer, count, half = 1 - t.rank, 1001, 500
    keep, give = ((0, half), (half, count)) if t.rank == 0 else ((half, count), (0, half))
    spec = make([(_USER, *keep, *give, 0), (_USER + 1, *give, *keep, COPY)])
    want = (_values(0, count, np.float64) + _values(1, count, np.float64)).astype(np.float32)
    runner = t.rounds.plan_runner((peer, peer))
    for k in range(3):
        flat, tmp = _values(t.rank, count, np.float32), np.empty(count, np.float32)
        if k < 2 or runner is None:
            done = t.rounds.exchange_plan((peer, peer), flat, tmp, spec, 10.0, 1.0, True, [], [0])
        else:
            done = int(runner(flat, tmp, spec, 10.0, 1.0, True, [], [0]))
        assert done in (0, 2), f"a plan on a quiet link stopped after {done} of 2 rounds"
        if done == 0:  # declined: nothing moved, the link is in step for the same exchange by messages
            t.sendrecv(peer, flat[give[0]:give[1]], peer, tmp[: keep[1] - keep[0]], _USER, 10.0)
            flat[keep[0]:keep[1]] += tmp[: keep[1] - keep[0]]
            t.sendrecv(peer, flat[keep[0]:keep[1]], peer, flat[give[0]:give[1]], _USER + 1, 10.0)
        assert np.array_equal(flat, want), f"exchange_plan (call {k}): wrong result"
        ctx.barrier()


@_check(0)
def _window_declared(t: Transport, ctx: Ctx) -> None:
    """``shared_memory``: the group window maps, every rank reads what another published in its slot; without
    it, no window at all."""
    win = t.group_window(30.0)
    if not t.shared_memory:
        assert win is None and t.shared_window is None, f"{t.name}: a window although shared_memory is False"
        return
    assert win is not None and t.shared_window is win, f"{t.name}: shared_memory is True but no group window"
    slot = win.slot(t.rank)
    slot[:16] = t.rank + 1
    win.publish(0, 7)
    win.wait(list(range(t.size)), 0, 7, 30.0)
    for r in range(t.size):
        assert (win.slot(r)[:16] == r + 1).all(), f"rank {t.rank} read rank {r}'s slot wrong"
    ctx.barrier()  # nobody writes again before everyone has read


#: The capability tiers by name.
CAPABILITY_CHECKS: Mapping[str, Check] = MappingProxyType({c.name: c for c in (
    _rounds_exchange_reduce, _rounds_plan, _window_declared,
)})

#: Every thread-mode check by name, in the order ``check_transport`` runs them: the core, then the capabilities.
CHECKS: Mapping[str, Check] = MappingProxyType({**CORE_CHECKS, **CAPABILITY_CHECKS})

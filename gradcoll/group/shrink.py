"""``ProcessGroup.shrink()``: survivors of a failure agree on who is left and continue, without a restart.

After a rank dies (its peers' collectives fail and poison the group), every
survivor calls ``group.shrink()``. The old transport is closed at once, so a
survivor still waiting on this rank fails fast and joins too. Then, over the
group's control channel (``gradcoll.observe.diagnosis``, UDP, addresses learned
at bootstrap; the bootstrap store is gone by now):

1. **Join.** Every survivor sends ``JOIN`` to every old peer every 100 ms and
   ``PING``s those it has not heard join. A peer's monitor thread answers a
   ping even while its owner is still stuck in the failing collective, so
   "alive but not joined yet" (wait for it) is told apart from "dead" (no
   answer for ``dead_after``, 2 s at most).
2. **Decide.** The lowest rank that joined is the leader. Once every old rank
   has joined or is dead (or the timeout has passed) it fixes the members
   (the joined ranks, in old rank order), starts a fresh
   [`TCPStore`][gradcoll.store.TCPStore] on its control host, and sends
   ``DECIDE`` (members, store address) to each member until it is
   acknowledged. A rank takes the first decision it receives; a rank left
   out of it (it joined too late) raises [`ShrinkFailed`][gradcoll.errors.ShrinkFailed].
3. **Rebuild.** Members renumber in old rank order, connect a new transport
   of the same backend and options through the leader's store, open a new
   control channel, and return a new [`ProcessGroup`][gradcoll.group.ProcessGroup]
   with the old group's settings and sequence numbers from 0.

This module is the agreement ([`agree`][gradcoll.group.shrink.agree], over a
control channel only); the group's membership (`gradcoll.group.connect`,
handed to every group `init_process_group` builds) closes the old group
around it and connects the new one.

Limits: backends ``tcp``, ``shm`` and ``inproc`` (not ``mpi``); every
survivor must call ``shrink()`` within ``timeout``; the new store listens on
the control host (the tcp ``host`` option, default 127.0.0.1), so ranks on
several hosts must pass a reachable ``host``; a failure *during* shrink
(of the leader, say) makes it raise ShrinkFailed or CollectiveTimeout on the
others, whose old group is closed by then (shrinking it again raises
UsageError). State in the caller's buffers (a half-reduced
gradient) is the caller's to redo: the step that failed is repeated on the
new group.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import ShrinkFailed, UsageError
from ..observe.diagnosis import DECIDE, JOIN, PING, ControlChannel
from ..store import HashStore, Store, TCPStore

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = ["shrink", "agree", "check_shrinkable", "BACKENDS"]

#: The transport backends a group can shrink over (an MPI world is fixed by its launcher).
BACKENDS = ("tcp", "shm", "inproc")

_RESEND_S = 0.1
_LEADER_GRACE_S = 2.0


def shrink(group: ProcessGroup, timeout: float | None = None) -> ProcessGroup:
    """Agree with the other survivors on the members left and return their new ProcessGroup (see module doc).

    The same as [`group.shrink(timeout)`][gradcoll.group.ProcessGroup.shrink].
    """
    return group.shrink(timeout)


def check_shrinkable(ctl: ControlChannel) -> None:
    """Raise UsageError, before anything is closed, when the group's backend cannot be shrunk."""
    if ctl.backend not in BACKENDS:
        raise UsageError(f"rank {ctl.rank}: shrink() supports the {', '.join(BACKENDS[:-1])} and {BACKENDS[-1]} "
                         f"backends, not {ctl.backend!r}")


def agree(ctl: ControlChannel, limit: float) -> tuple[int, int, Store]:
    """Join and decide over ``ctl``: this rank's number in the new group, its size, and the store to connect it by.

    The caller closes the store (the leader hosts it: it waits for the
    others to disconnect). Raises ShrinkFailed when this rank was left out
    or no decision came within ``limit`` seconds (and a grace period for
    the leader to send it).
    """
    leader, members, host, port, store = _agree(ctl, limit)
    if ctl.rank not in members:
        raise ShrinkFailed(f"rank {ctl.rank}: left out of the shrunk group by leader rank {leader} "
                           f"(members {members}); it joined too late")
    if store is None:
        store = HashStore(limit) if len(members) == 1 else TCPStore(host, port, timeout=limit)
    return members.index(ctl.rank), len(members), store


def _agree(ctl: ControlChannel, limit: float) -> tuple[int, list[int], str, int, Store | None]:
    """Run join and decide; returns (leader, members, store host, store port, the store if this rank hosts it)."""
    me, n = ctl.rank, ctl.size
    start = time.monotonic()
    deadline = start + limit
    dead_after = min(2.0, max(0.5, limit / 4))
    peers = [p for p in range(n) if p != me]
    next_send = start
    while True:
        now = time.monotonic()
        if now >= next_send:
            with ctl.cv:
                joined = set(ctl.joined)
            for p in peers:
                ctl.send(p, JOIN)
                if p not in joined:
                    ctl.send(p, PING)
            next_send = now + _RESEND_S
        with ctl.cv:
            if ctl.decision is not None:
                leader, members, host, port = ctl.decision
                return leader, members, host, port, None
            joined = ctl.joined | {me}
            waiting = [p for p in peers if p not in joined and now - max(ctl.heard.get(p, start), start) < dead_after]
        leader = min(joined)
        if leader == me and (not waiting or now >= deadline):
            return _decide(ctl, sorted(joined), waiting, deadline)
        if now >= deadline + _LEADER_GRACE_S:  # the leader decides at the deadline at the latest: give it time
            raise ShrinkFailed(
                f"rank {me}: no membership decision within {limit}s (joined: {sorted(joined)}; leader would be "
                f"rank {leader}; still alive but not joined: {waiting})"
            )
        ctl.poll(max(0.0, min(0.05, next_send - now)))


def _decide(ctl: ControlChannel, members: list[int], outsiders: list[int],
            deadline: float) -> tuple[int, list[int], str, int, Store | None]:
    """As leader: host the new store; tell every member, and every live rank left out, until each acknowledged.

    A live rank left out (it had not joined by the deadline) keeps the decision
    and raises ShrinkFailed when it calls shrink(), instead of going on alone.
    """
    me = ctl.rank
    store = TCPStore(ctl.host, 0, is_master=True, timeout=max(5.0, deadline - time.monotonic())) if len(members) > 1 else None
    port = store.port if store is not None else 0
    with ctl.cv:
        if ctl.decision is not None and ctl.decision[0] != me:  # another leader was faster (a late lower rank)
            if store is not None:
                store.close(0.0)
            leader, got, host, p = ctl.decision
            return leader, got, host, p, None
        ctl.decision = (me, members, ctl.host, port)
    text = f"{ctl.host} {port} {','.join(map(str, members))}"
    others = [m for m in members if m != me] + outsiders
    until = time.monotonic() + 5.0  # (even past the deadline) a lost ACK costs little: the member still comes
    while time.monotonic() < until:
        with ctl.cv:
            missing = [m for m in others if m not in ctl.acks]
        if not missing:
            break
        for m in missing:
            ctl.send(m, DECIDE, text=text)
        ctl.poll(0.05)
    return me, members, ctl.host, port, store

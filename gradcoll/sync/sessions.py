"""The session registry: who has committed what to which sync session.

One registry lives in each ``GradientSyncService``.
A member is a peer id and the manifest cid of its committed gradient.
Waiting for peers is event-driven, never polled: a waiter parks on an
``asyncio.Event`` of its own loop and every join wakes the waiters of
that session through ``loop.call_soon_threadsafe``. State is guarded by one
``threading.Lock``, so callers on different threads and event loops (a gRPC
server thread, a test's ``asyncio.run``) can share one service.

Sessions idle for longer than ``ttl`` seconds (no join, no waiter) are
forgotten at the next join; forgetting a session never cancels a call that
is still running on it, since that call holds its own reference.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CollectiveMismatch, UsageError

__all__ = ["Member", "SessionRegistry"]


@dataclass(frozen=True)
class Member:
    """One peer's contribution to a session."""

    peer_id: str
    cid: str  # of the gradient's manifest
    elements: int
    chunks: tuple[str, ...] = ()  # the chunk blocks' cids, in order
    crcs: tuple[int, ...] = ()  # each chunk's CRC32, computed once at commit

    @property
    def blocks(self) -> tuple[str, ...]:
        """Every block of the gradient: the chunks and the manifest."""
        return self.chunks + (self.cid,)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # its loop has closed: nobody is waiting any more
            pass


@dataclass(eq=False)
class _Session:
    session_id: str
    touched: float
    members: dict[str, Member] = field(default_factory=dict)  # join order
    waiters: set[_Waiter] = field(default_factory=set)


class SessionRegistry:
    """Thread-safe map of session id to members, with waiting for peers."""

    def __init__(self, ttl: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}

    def check_join(self, session_id: str, peer_id: str, elements: int) -> None:
        """Raise now if ``join`` would refuse this peer (so nothing is stored in vain)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                self._refuse(s, peer_id, elements)

    def join(self, session_id: str, member: Member) -> list[Member]:
        """Add ``member`` to the session (created on first join); return sessions forgotten as idle."""
        with self._lock:
            now = self._clock()
            expired = self._prune(now)
            s = self._sessions.get(session_id)
            if s is None:
                s = self._sessions[session_id] = _Session(session_id, now)
            self._refuse(s, member.peer_id, member.elements)
            s.members[member.peer_id] = member
            s.touched = now
            waiters = list(s.waiters)
        for w in waiters:
            w.wake()
        return expired

    @staticmethod
    def _refuse(s: _Session, peer_id: str, elements: int) -> None:
        if peer_id in s.members:
            raise UsageError(f"session {s.session_id!r}: peer {peer_id!r} has already contributed")
        if s.members:
            first = next(iter(s.members.values()))
            if first.elements != elements:
                raise CollectiveMismatch(
                    f"session {s.session_id!r}: peer {peer_id!r} contributed {elements} elements, "
                    f"peer {first.peer_id!r} contributed {first.elements}"
                )

    async def wait_for_peers(
        self, session_id: str, peer_id: str, min_peers: int, timeout: float
    ) -> tuple[list[Member], bool]:
        """Wait until ``min_peers`` others joined or ``timeout`` passed; return (others, timed_out)."""
        loop = asyncio.get_running_loop()
        deadline = self._clock() + timeout
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or peer_id not in s.members:
            raise UsageError(f"session {session_id!r}: peer {peer_id!r} must join before it waits")
        while True:
            waiter = _Waiter(loop, asyncio.Event())
            with self._lock:
                others = [m for m in s.members.values() if m.peer_id != peer_id]
                left = deadline - self._clock()
                if len(others) >= min_peers or left <= 0:
                    s.touched = self._clock()
                    return others, len(others) < min_peers
                # Registered under the lock that join() takes: no wake-up is lost
                # between counting the members and parking.
                s.waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter.event.wait(), left)
            except asyncio.TimeoutError:
                pass  # the loop above re-counts and returns
            finally:
                with self._lock:
                    s.waiters.discard(waiter)

    def members(self, session_id: str) -> tuple[Member, ...]:
        """The session's members in join order (empty for an unknown session)."""
        with self._lock:
            s = self._sessions.get(session_id)
            return tuple(s.members.values()) if s is not None else ()

    def sessions(self) -> tuple[str, ...]:
        """Ids of the sessions the registry knows."""
        with self._lock:
            return tuple(self._sessions)

    def forget(self, session_id: str) -> list[Member]:
        """Forget a session (new joins start afresh); return its members."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
            return list(s.members.values()) if s is not None else []

    def referenced_blocks(self) -> set[str]:
        """Every block of every member of every known session."""
        with self._lock:
            return {b for s in self._sessions.values() for m in s.members.values() for b in m.blocks}

    def _prune(self, now: float) -> list[Member]:
        dead = [k for k, s in self._sessions.items() if not s.waiters and now - s.touched > self.ttl]
        gone: list[Member] = []
        for k in dead:
            gone.extend(self._sessions.pop(k).members.values())
        return gone

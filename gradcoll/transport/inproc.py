"""In-process transport: the ranks are threads of one process.

Every ordered pair of ranks (src, dst) has one ``_Pair``: a FIFO of
messages sent but not yet matched and a FIFO of receives posted but not yet
matched. A send that finds a posted receive copies straight into the
receiver's buffer (one copy); otherwise it copies the payload into a private
``bytes`` object that the next ``irecv`` copies out (two copies). Either way
``isend`` has copied the payload before it returns, so its request is
complete at once and the caller may reuse the buffer immediately.

Matching is strictly in order per pair, like MPI with one communicator: the
n-th receive posted for a pair gets the n-th message sent on it. The message
header (per-pair sequence number, tag, length) is checked on delivery; a
different tag or length fails that receive with
[`CollectiveMismatch`][gradcoll.errors.CollectiveMismatch] naming both sides (a
``FrameMismatch`` carrying the message when
both tags are lenient, as in the framed transports).

``close()`` on one rank makes every receive from it that cannot be served
from messages it already sent, and every later send to it, raise
[`TransportClosed`][gradcoll.errors.TransportClosed] on the peer; the closing rank's own
pending receives fail the same way. Nothing ever blocks past its timeout.

``window(nbytes)`` is collective, as on every transport: the k-th call of
each rank maps the k-th window of the world, an anonymous mapping rank 0
makes (``gradcoll.transport.window``; threads never die alone, so nobody is
probed for liveness).

Worlds are created directly with ``create_world``, or by ``size`` threads
calling ``create`` with one shared store. ``create`` needs to hand the
world object from rank 0's thread to the others; the store can only carry
bytes, so rank 0 registers the world under a random id in ``_WORLDS``, a
module-level weak registry (the one piece of module state here: an entry
lives exactly as long as some transport of that world does), and publishes
the id through the store.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from .._util import Deadline
from ..errors import TransportClosed, UsageError
from ..store import Store
from . import frame as fr
from .base import Request, Transport, Window, as_bytes_view, as_writable_view
from .window import LAYOUT, MappedWindow, init_header, plan

__all__ = ["InprocTransport", "InprocWorld", "create_world", "create"]

#: world id -> InprocWorld, for ``create`` (weak: see the module docstring).
_WORLDS: "weakref.WeakValueDictionary[str, InprocWorld]" = weakref.WeakValueDictionary()
_WORLDS_LOCK = threading.Lock()

# Below this many bytes a memoryview slice copy beats numpy's call overhead.
_NUMPY_COPY_BYTES = 1 << 16


def _copy_into(dst: memoryview, src: Any) -> None:
    if len(dst) >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))  # releases the GIL
    else:
        dst[:] = src


class _Done(Request):
    """A request that finished when it was created (every inproc send)."""

    __slots__ = ("_n",)

    def __init__(self, n: int) -> None:
        self._n = n

    def wait(self, timeout: float | None = None) -> int:
        return self._n

    def test(self) -> bool:
        return True


class _Recv(Request):
    """A posted receive; completed by whichever thread delivers the matching message."""

    __slots__ = ("_owner", "_pair", "_peer", "out", "tag", "_event", "_error", "_n")

    def __init__(self, owner: "InprocTransport", pair: "_Pair", peer: int, out: memoryview, tag: int) -> None:
        self._owner = owner
        self._pair = pair
        self._peer = peer
        self.out = out
        self.tag = tag
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._n = 0

    def _finish(self, error: BaseException | None = None, n: int = 0) -> None:
        self._error, self._n = error, n
        self._event.set()

    def wait(self, timeout: float | None = None) -> int:
        limit = self._owner._timeout(timeout)
        if not self._event.wait(limit):
            with self._pair.lock:  # cancel, unless a sender completes us right now
                if not self._event.is_set():
                    self._pair.posted.remove(self)
                    self._finish(self._owner._timeout_error("recv", self._peer, limit, len(self.out)))
        if self._error is not None:
            raise self._error
        return self._n

    def test(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> bool:
        """Withdraw the receive unless a message already completed it; always True (nothing is half done)."""
        with self._pair.lock:
            if not self._event.is_set():
                self._pair.posted.remove(self)
                self._finish(None, 0)
        return True


class _Pair:
    """One direction src -> dst of a world: unmatched messages and unmatched receives."""

    __slots__ = ("lock", "messages", "posted", "send_seq", "recv_seq")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.posted: collections.deque[_Recv] = collections.deque()
        self.send_seq = 0
        self.recv_seq = 0


class InprocWorld:
    """The shared state of ``size`` in-process ranks: one ``_Pair`` per ordered pair."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise UsageError(f"world size must be >= 1, got {size}")
        self.size = size
        self.pairs = {(s, d): _Pair() for s in range(size) for d in range(size) if s != d}
        self.closed = [False] * size
        self.windows: dict[int, mmap.mmap] = {}  # the k-th window of the world, until every rank has taken it
        self.window_cv = threading.Condition()

    def close_rank(self, rank: int) -> None:
        """Mark ``rank`` closed and fail every receive that can no longer be served."""
        self.closed[rank] = True
        for peer in range(self.size):
            if peer == rank:
                continue
            out_pair = self.pairs[(rank, peer)]  # receives posted by peer, waiting on us
            with out_pair.lock:
                while out_pair.posted:
                    out_pair.posted.popleft()._finish(
                        TransportClosed(f"rank {peer}: peer {rank} closed the link", rank=peer, peer=rank)
                    )
            in_pair = self.pairs[(peer, rank)]  # our own receives and undelivered mail
            with in_pair.lock:
                in_pair.messages.clear()
                while in_pair.posted:
                    in_pair.posted.popleft()._finish(
                        TransportClosed(f"rank {rank}: transport closed locally", rank=rank, peer=peer)
                    )


class InprocTransport(Transport):
    """One rank's endpoint in an ``InprocWorld``."""

    name = "inproc"
    #: Receives with tags >= LENIENT_TAG report a mismatch with the message attached.
    lenient_tags = True
    shared_memory = True

    def __init__(self, world: InprocWorld, rank: int, timeout: float = 300.0) -> None:
        super().__init__(rank, world.size, timeout)
        self.world = world
        self._nwin = 0

    def window(self, nbytes: int, timeout: float | None = None) -> Window:
        """Collective: the next window of the world, with ``nbytes`` a slot (rank 0 maps it)."""
        world, k = self.world, self._nwin
        self._nwin += 1
        total, headers, _, _ = plan(self.size, nbytes)
        with world.window_cv:
            if self.rank == 0:
                mm = mmap.mmap(-1, total)
                init_header(mm, self.size, nbytes)
                world.windows[k] = mm
                world.window_cv.notify_all()
            elif not world.window_cv.wait_for(lambda: k in world.windows or world.closed[0],
                                              self._timeout(timeout)):
                raise self._timeout_error(f"window setup {k}", 0, self._timeout(timeout))
            mm = world.windows.get(k)  # type: ignore[assignment]
            if mm is None:
                raise TransportClosed(f"rank {self.rank}: peer 0 closed before window {k} was made", rank=self.rank,
                                      peer=0)
        struct.pack_into("<Q", mm, headers + self.rank * 1024 + LAYOUT["pid"], os.getpid())
        return self._keep_window(MappedWindow(mm, self.rank, self.size, probe=0))

    def _closed_error(self, peer: int) -> TransportClosed:
        if self.closed:
            return TransportClosed(f"rank {self.rank}: transport is closed", rank=self.rank, peer=peer)
        return TransportClosed(f"rank {self.rank}: peer {peer} closed the link", rank=self.rank, peer=peer)

    def _deliver(self, req: _Recv, seq: int, tag: int, data: Any, src: int) -> None:
        """Complete ``req`` with one message (called with the pair lock held)."""
        pair = req._pair
        expect_seq = pair.recv_seq
        pair.recv_seq += 1
        n, length = len(data), len(req.out)
        got = fr.Header(fr.DATA, tag, seq, n)
        verdict = fr.classify(got, seq=expect_seq, tag=req.tag, length=length)
        if verdict is fr.EXPECTED:
            if n:
                _copy_into(req.out, data)
            req._finish(None, n)
        elif verdict is fr.STRAY:
            req._finish(fr.lenient_mismatch(self.rank, src, seq, req.tag, length, tag, bytes(data), self.name))
        else:
            req._finish(fr.mismatch_error(got, seq=expect_seq, tag=req.tag, length=length, rank=self.rank, peer=src,
                                          transport=self.name))

    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Copy ``buf`` towards ``peer``; the returned request is already complete."""
        self._check_peer(peer)
        view = as_bytes_view(buf)
        pair = self.world.pairs[(self.rank, peer)]
        with pair.lock:
            if self.closed or self.world.closed[peer]:
                raise self._closed_error(peer)
            seq = pair.send_seq
            pair.send_seq += 1
            if pair.posted:
                req = pair.posted.popleft()
                req._owner._deliver(req, seq, tag, view, self.rank)
            else:
                pair.messages.append((seq, tag, view.tobytes()))
        return _Done(len(view))

    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Post a receive of exactly ``len(out)`` bytes with ``tag`` from ``peer``."""
        self._check_peer(peer)
        view = as_writable_view(out)
        pair = self.world.pairs[(peer, self.rank)]
        req = _Recv(self, pair, peer, view, tag)
        with pair.lock:
            if self.closed:
                raise self._closed_error(peer)
            if pair.messages:
                seq, mtag, data = pair.messages.popleft()
                self._deliver(req, seq, mtag, data, peer)
            elif self.world.closed[peer]:
                req._finish(self._closed_error(peer))
            else:
                pair.posted.append(req)
        return req

    def close(self) -> None:
        """Close this rank's links and windows; peers waiting on it get TransportClosed. Idempotent."""
        if not self.closed:
            self.closed = True
            self.world.close_rank(self.rank)
            self._close_windows()
            with self.world.window_cv:
                self.world.window_cv.notify_all()


def create_world(size: int, timeout: float = 300.0) -> list[InprocTransport]:
    """Return ``size`` connected transports, one per rank (hand one to each thread)."""
    world = InprocWorld(size)
    return [InprocTransport(world, r, timeout) for r in range(size)]


def create(store: Store, rank: int, size: int, *, timeout: float = 300.0, **options: Any) -> InprocTransport:
    """Join the in-process world of ``size`` ranks that share ``store`` (threads of one process)."""
    if options:
        raise UsageError(f"inproc transport takes no options, got {sorted(options)}")
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} out of range for world size {size}")
    # The k-th create() on one rank meets the k-th on every other rank, so a
    # store reused for several worlds never hands out a stale world id.
    k = store.add(f"inproc/calls/{rank}", 1)
    key = f"inproc/world/{k}"
    deadline = Deadline(timeout)
    if rank == 0:
        world = InprocWorld(size)
        wid = uuid.uuid4().hex
        with _WORLDS_LOCK:
            _WORLDS[wid] = world
        transport = InprocTransport(world, 0, timeout)  # holds the world alive
        store.set(key, wid.encode())
        return transport
    wid = store.get(key, deadline.remaining()).decode()
    with _WORLDS_LOCK:
        world = _WORLDS.get(wid)  # type: ignore[assignment]
    if world is None:
        raise UsageError(
            f"rank {rank}: inproc world {wid} is not in this process; the inproc backend "
            "needs every rank to be a thread of one process (use tcp or shm across processes)"
        )
    if world.size != size:
        raise UsageError(f"rank {rank}: world size {size} differs from rank 0's {world.size}")
    return InprocTransport(world, rank, timeout)

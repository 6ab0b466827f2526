"""The transport interface every gradcoll backend implements.

A transport connects ``size`` ranks and moves raw bytes between pairs of
them. It knows nothing of reductions: algorithms (``gradcoll.algorithms``)
are written only against this interface.

Contract (checked by ``gradcoll.testing.check_transport``):

* Messages between one ordered pair (src, dst) are delivered in the order
  they were sent. Each message carries a small header: a per-pair sequence
  number, the ``tag`` and the byte length. ``recv`` must find exactly the
  tag and length it expects; anything else raises
  [`CollectiveMismatch`][gradcoll.errors.CollectiveMismatch] naming both sides (mixed-up
  collectives are detected, never silently mixed).
* Buffers are anything exposing the buffer protocol (NumPy arrays,
  ``bytearray``, ``memoryview``); ``recv`` writes into the caller's
  preallocated buffer. Nothing is pickled on the data path.
* Every blocking call takes ``timeout`` in seconds (``None`` means the
  transport's ``timeout``). Running out of time raises
  [`CollectiveTimeout`][gradcoll.errors.CollectiveTimeout] naming the rank and the peer.
* A peer that closed its end raises [`TransportClosed`][gradcoll.errors.TransportClosed];
  a peer that died or a link that broke raises
  [`TransportBroken`][gradcoll.errors.TransportBroken]. Neither ever hangs.
* ``isend``/``irecv`` start an operation and return a ``Request``;
  the buffer must not be touched until ``Request.wait`` returns.
  ``sendrecv`` is full-duplex (a ring sends right while it receives from the
  left) and never deadlocks when both peers call it at once.
* ``send`` returns once the buffer may be reused (the bytes may still be in
  flight). Zero-length messages are legal.
* ``Request.cancel`` withdraws an operation no byte of which has moved yet
  (True), or reports that it is already done (True) or under way (False).
  A withdrawn request is done: ``test()`` is True and ``wait()`` returns 0
  at once. A withdrawn receive takes no message: the next message from that
  peer goes to the next receive. The collectives' error path cancels the
  receives it no longer needs.
* ``lenient_tags``: a transport that sets it True guarantees that a receive
  posted with a tag ``>= LENIENT_TAG`` (:mod:`gradcoll.transport.frame`) that
  meets a frame with another lenient tag or length consumes that frame whole,
  fails with ``FrameMismatch`` carrying it (``peer``, ``tag``, ``payload``),
  and leaves the link in step. The collectives then run without an agreement
  round before their data (``gradcoll.algorithms._guard``); transports
  without it get one.
* ``blocked_s`` counts the seconds collectives spent waiting on this
  transport; callers add to it through ``note_wait`` (ProcessGroup.stats()
  reports it as wait time).
* Errors carry what the collectives' error path reads: ``TransportClosed``
  and ``TransportBroken`` their ``peer``, ``CollectiveTimeout`` the peers it
  waited for in ``missing``. ``closed`` is True once this rank's own
  ``close()`` ran (a collective then says "this rank's transport was
  closed", not "the peer closed the link").
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Protocol

from .._util import Deadline
from ..errors import CollectiveTimeout, UsageError

__all__ = ["Transport", "Request", "QueuedRequest", "Deadline", "as_bytes_view", "as_writable_view"]


def as_bytes_view(buf: Any) -> memoryview:
    """A flat, read-only byte view of ``buf`` (no copy)."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise UsageError("transport buffers must be C-contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def as_writable_view(buf: Any) -> memoryview:
    """A flat, writable byte view of ``buf`` (no copy)."""
    mv = memoryview(buf)
    if mv.readonly:
        raise UsageError("receive buffer is read-only")
    if not mv.c_contiguous:
        raise UsageError("transport buffers must be C-contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


class Request(abc.ABC):
    """Handle of a started ``isend``/``irecv``."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Block until done; returns the number of bytes moved. Raises what the operation raised."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once the operation has finished (successfully or not)."""

    def cancel(self) -> bool:
        """Withdraw the operation if none of its bytes has moved; True if withdrawn or already done.

        A transport that cannot withdraw operations keeps this default: True
        only once the operation is done.
        """
        return self.test()


class _Queues(Protocol):
    """What a ``QueuedRequest``'s transport provides."""

    def _wait(self, ops: tuple[Any, ...], timeout: float | None) -> int: ...

    def _test(self, op: Any) -> bool: ...

    def _cancel(self, op: Any) -> bool: ...


class QueuedRequest(Request):
    """For implementations: a request that is a handle on its transport's queues (``tcp``, ``shm``, ``mpi``).

    ``wait``, ``test`` and ``cancel`` are the transport's own
    ``_wait((op,), timeout)``, ``_test(op)`` and ``_cancel(op)``, which drive
    every queued operation of the transport, not only this one.
    """

    __slots__ = ()
    _t: _Queues

    def wait(self, timeout: float | None = None) -> int:
        return self._t._wait((self,), timeout)

    def test(self) -> bool:
        return self._t._test(self)

    def cancel(self) -> bool:
        return self._t._cancel(self)


class Transport(abc.ABC):
    """Point-to-point byte transport between ``size`` ranks."""

    #: Registered name (``"inproc"``, ``"tcp"``, ``"shm"``, ``"mpi"``).
    name: str = "abstract"
    #: Seconds the collectives spent blocked waiting on this transport (``ProcessGroup.stats``).
    blocked_s: float = 0.0
    #: True when receives with lenient tags survive a mismatch (see the module docstring).
    lenient_tags: bool = False
    #: This rank and the world size.
    rank: int
    size: int
    #: Default timeout in seconds of every blocking call (``timeout=None``).
    timeout: float
    #: True once ``close()`` was called on this transport.
    closed: bool
    #: The longest frame (bytes) a lenient receive takes in whole when another frame than its own arrives
    #: (or what the receive itself expects, if more); a longer one is refused unread with a ProtocolError
    #: naming the peer. The collectives raise it to the size of the call they run.
    stray_limit: int = 64 << 20

    def __init__(self, rank: int, size: int, timeout: float = 300.0) -> None:
        if size < 1:
            raise UsageError(f"world size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} out of range for world size {size}")
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.closed = False

    # -- helpers for implementations -------------------------------------
    def _check_peer(self, peer: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            raise UsageError(f"rank {self.rank}: invalid peer {peer!r} (world size {self.size})")

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def note_wait(self, seconds: float) -> None:
        """Add ``seconds`` spent blocked on this transport to ``blocked_s``."""
        self.blocked_s += seconds

    def _timeout_error(self, op: str, peer: int, timeout: float | None, nbytes: int | None = None) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.rank}: {op} with peer {peer} timed out after {timeout}s ({self.name} transport)",
            rank=self.rank,
            missing=[peer],
            op=op,
            nbytes=nbytes,
        )

    # -- the interface -----------------------------------------------------
    @abc.abstractmethod
    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``peer``."""

    @abc.abstractmethod
    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Start receiving exactly ``len(out)`` bytes with ``tag`` from ``peer`` into ``out``."""

    def send(self, peer: int, buf: Any, tag: int = 0, timeout: float | None = None) -> None:
        """Blocking send; returns when ``buf`` may be reused."""
        self.isend(peer, buf, tag).wait(self._timeout(timeout))

    def recv(self, peer: int, out: Any, tag: int = 0, timeout: float | None = None) -> int:
        """Blocking receive into ``out``; returns the number of bytes received."""
        return self.irecv(peer, out, tag).wait(self._timeout(timeout))

    def sendrecv(
        self,
        dst: int,
        sendbuf: Any,
        src: int,
        recvbuf: Any,
        tag: int = 0,
        timeout: float | None = None,
    ) -> int:
        """Full-duplex: send ``sendbuf`` to ``dst`` while receiving into ``recvbuf`` from ``src``."""
        deadline = Deadline(self._timeout(timeout))
        rreq = self.irecv(src, recvbuf, tag)
        sreq = self.isend(dst, sendbuf, tag)
        n = rreq.wait(deadline.remaining())
        sreq.wait(deadline.remaining())
        return n

    def interrupt(self, error: Callable[[int], BaseException]) -> int:
        """Fail every pending send and receive with ``error(peer)``; return how many.

        For a waiter that learned out of band that its collective cannot
        finish (a peer published an error record): its wait returns at once
        instead of at its timeout. An operation no byte of which has moved
        is withdrawn (its link stays in step); one half way through a frame
        goes on, and the wait for it raises the error instead. Transports
        that cannot do it return 0 and wait as before.
        """
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Close every link; idempotent. Peers then see TransportClosed."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} size={self.size}{' closed' if self.closed else ''}>"

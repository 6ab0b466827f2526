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
  (True), or reports that it is done (True) or under way (False). A withdrawn
  request is done (``wait()`` returns 0) and a withdrawn receive takes no
  message. The collectives' error path cancels receives it no longer needs.
* ``lenient_tags``: a transport that sets it True guarantees that a receive
  posted with a tag ``>= LENIENT_TAG`` (:mod:`gradcoll.transport.frame`) that
  meets a frame with another lenient tag or length consumes that frame whole,
  fails with ``FrameMismatch`` carrying it (``peer``, ``tag``, ``payload``),
  and leaves the link in step. The collectives then run without an agreement
  round before their data (``gradcoll.algorithms._guard``); transports
  without it get one.
* ``blocked_s`` counts the seconds collectives waited on this transport
  (``note_wait``; ProcessGroup.stats() reports it as wait time).
* Errors carry what the collectives' error path reads: ``TransportClosed``
  and ``TransportBroken`` their ``peer``, ``CollectiveTimeout`` the peers it
  waited for in ``missing``. ``closed`` is True once this rank's own
  ``close()`` ran ("this rank's transport was closed", not "the peer closed").
* ``shared_memory`` and ``window(nbytes)``: a transport whose ranks all share
  one host's memory (``shm``, ``inproc``, ``mpi`` on one node) sets
  ``shared_memory`` True, the same on every rank, and its ``window`` maps a
  [`Window`][gradcoll.transport.base.Window]: one segment, a slot and a header
  per rank (MPI-3's ``MPI_Win_allocate_shared``). Collective: every rank calls
  it in the same order with the same ``nbytes``; other transports return None.
  ``group_window()`` is the window the collectives share (made at its first
  call; ``shared_window`` once it is), ``close()`` closes every window.
* ``rounds``: the optional compiled-rounds capability
  ([`Rounds`][gradcoll.transport.plan.Rounds]), or None.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from .._util import Deadline
from ..errors import CollectiveTimeout, TransportError, UsageError
from .plan import Rounds

__all__ = ["Transport", "Request", "QueuedRequest", "Deadline", "as_bytes_view", "as_writable_view", "Window",
           "WindowLayout", "WindowAlarm", "GROUP_WINDOW_BYTES"]

#: Bytes of each rank's slot in the window the collectives share (``Transport.group_window``).
GROUP_WINDOW_BYTES = 4 << 20


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


class WindowAlarm(TransportError):
    """A rank raised an alarm on the window (``peer``; its 64-byte ``record``): its collective failed."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None,
                 record: bytes = b"") -> None:
        super().__init__(message, rank=rank, peer=peer)
        self.record = record


class WindowLayout(NamedTuple):
    """Where a window lives, for compiled code that reads it directly (``gradcoll.transport.window`` has the layout).

    ``address`` is the mapping's first byte in this process; rank ``r``'s
    header is at ``address + headers + r * header_bytes``, its slot at
    ``address + slots + r * stride``. ``probe`` says how a waiting rank
    learns that a peer died: 0 never (the ranks are threads of one process),
    1 the peer's ``lockf`` byte ``r`` of file ``fd``, 2 its ``pid`` (below
    ``mpirun``).
    """

    address: int
    size: int
    rank: int
    headers: int
    header_bytes: int
    slots: int
    stride: int
    slot_bytes: int
    probe: int
    fd: int


class Window(abc.ABC):
    """Memory every rank of one host maps: a slot and a small header per rank (see ``gradcoll.transport.window``).

    Every rank reads every slot and header; a rank writes only its own: its
    slot, its ``COUNTERS`` progress counters, its ring of ``DESCRIPTORS``
    64-byte descriptors, its state and its 64-byte alarm record. Counters
    only grow. The promises, checked by ``gradcoll.testing.check_window``:

    * ``publish(i, v)`` makes every store this rank made before it (into its
      slot, its descriptors) visible before counter ``i`` reads ``v``, and
      wakes the ranks waiting for it;
    * ``wait(ranks, i, v, timeout)`` returns once counter ``i`` of every rank
      in ``ranks`` is at least ``v``. It spins briefly, then sleeps in the
      kernel (a futex on the counter's word), so a waiting rank never takes
      the core of the rank it waits for. It raises ``CollectiveTimeout``
      whose ``missing`` are exactly the ranks still below ``v``,
      ``TransportBroken`` naming a rank that died (detected within
      ``PROBE_S``), ``TransportClosed`` naming a rank that closed its window
      before it got there (or this rank, when its own window was closed), and
      ``WindowAlarm`` naming a rank that raised an alarm;
    * ``alarm(record)`` is sticky: the window is failed for good (its group
      is poisoned), every waiter of every rank wakes;
    * ``close()`` is idempotent; the segment's name never outlives the
      window's creation (nothing is left behind in ``/dev/shm``, even when a
      rank is killed).
    """

    #: Progress counters per rank, descriptors in each rank's ring.
    COUNTERS = 7
    DESCRIPTORS = 8
    rank: int
    size: int
    #: Bytes of each slot (64-byte aligned).
    slot_bytes: int
    closed: bool
    #: Per-window state of the algorithms that use it (lives as long as the window).
    cache: dict[str, Any]

    @abc.abstractmethod
    def slot(self, rank: int) -> Any:
        """Rank ``rank``'s slot: a writable ``uint8`` NumPy array of ``slot_bytes``."""

    @abc.abstractmethod
    def counter(self, rank: int, index: int) -> int:
        """Counter ``index`` of rank ``rank``."""

    @abc.abstractmethod
    def publish(self, index: int, value: int) -> None:
        """Set this rank's counter ``index`` to ``value`` (after everything stored before) and wake its waiters."""

    @abc.abstractmethod
    def wait(self, ranks: Sequence[int], index: int, value: int, timeout: float | None = None) -> None:
        """Return once counter ``index`` of every rank in ``ranks`` is ``>= value`` (see the class docstring)."""

    @abc.abstractmethod
    def describe(self, k: int, desc: bytes) -> None:
        """Store this rank's descriptor ``k`` (mod ``DESCRIPTORS``), 64 bytes."""

    @abc.abstractmethod
    def descriptor(self, rank: int, k: int) -> bytes:
        """Rank ``rank``'s descriptor ``k`` (mod ``DESCRIPTORS``)."""

    @abc.abstractmethod
    def report(self, rank: int) -> Any:
        """Rank ``rank``'s 64-byte report (a ``uint8`` array; this rank writes its own): the algorithms' to use."""

    @abc.abstractmethod
    def alarm(self, record: bytes) -> None:
        """Fail the window for good with this rank's 64-byte ``record``; wake every waiter of every rank."""

    @abc.abstractmethod
    def wait_alarms(self, ranks: Sequence[int], timeout: float | None) -> None:
        """Return once every rank in ``ranks`` raised an alarm, closed its window or died, or ``timeout`` passed."""

    @abc.abstractmethod
    def alarm_record(self, rank: int) -> bytes | None:
        """The record of rank ``rank``'s alarm, or None while it raised none."""

    @abc.abstractmethod
    def state(self, rank: int) -> str:
        """``"open"``, ``"closed"``, ``"alarm"`` or, for a process that died, ``"dead"``."""

    @abc.abstractmethod
    def layout(self) -> WindowLayout:
        """The addresses compiled code reads the window at (valid until ``close``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Mark this rank's part closed, wake waiters, unmap once no view is left. Idempotent."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} size={self.size} slot={self.slot_bytes}{' closed' if self.closed else ''}>"


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
    shared_memory: bool = False  # every rank shares this host's memory: ``window`` then maps a ``Window``
    #: The longest frame (bytes) a lenient receive takes in whole when another frame than its own arrives
    #: (or what the receive itself expects, if more); a longer one is refused unread with a ProtocolError
    #: naming the peer. The collectives raise it to the size of the call they run.
    stray_limit: int = 64 << 20
    #: Compiled exchange-and-reduce rounds (``gradcoll.transport.plan.Rounds``), where the transport has them.
    rounds: Rounds | None = None

    def __init__(self, rank: int, size: int, timeout: float = 300.0) -> None:
        if size < 1:
            raise UsageError(f"world size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} out of range for world size {size}")
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.closed = False
        self._windows: list[Window] = []
        #: ``group_window()`` once it was made (None before, and where memory is not shared).
        self.shared_window: Window | None = None

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

    def sendrecv(self, dst: int, sendbuf: Any, src: int, recvbuf: Any, tag: int = 0,
                 timeout: float | None = None) -> int:
        """Full-duplex: send ``sendbuf`` to ``dst`` while receiving into ``recvbuf`` from ``src``."""
        deadline = Deadline(self._timeout(timeout))
        rreq = self.irecv(src, recvbuf, tag)
        sreq = self.isend(dst, sendbuf, tag)
        n = rreq.wait(deadline.remaining())
        sreq.wait(deadline.remaining())
        return n

    def window(self, nbytes: int, timeout: float | None = None) -> Window | None:
        """Collective: map a new window with a slot of ``nbytes`` per rank, or None where memory is not shared."""
        return None

    def group_window(self, timeout: float | None = None) -> Window | None:
        """The window the collectives share (collective at its first call), or None where memory is not shared."""
        if self.shared_window is None and self.shared_memory:
            self.shared_window = self.window(GROUP_WINDOW_BYTES, timeout)
        return self.shared_window

    def _keep_window(self, win: Window) -> Window:
        """For implementations: remember ``win`` so that ``close`` closes it."""
        self._windows.append(win)
        return win

    def _close_windows(self) -> None:
        """For implementations: close every window (part of ``close``)."""
        for win in self._windows:
            win.close()

    def interrupt(self, error: Callable[[int], BaseException]) -> int:
        """Fail every pending send and receive with ``error(peer)``; return how many.

        For a waiter that learned out of band that its collective cannot
        finish (a peer published an error record): its wait returns at once
        instead of at its timeout. An operation no byte of which has moved
        is withdrawn (its link stays in step); one half way through a frame
        goes on (a send from a copy of its buffer), and the wait for it
        raises the error; transports that cannot, return 0.
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

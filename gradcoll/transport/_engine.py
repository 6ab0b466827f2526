"""The queue engine of the byte-stream transports (``tcp``, ``shm``); private.

``FramedTransport`` is the part both transports share and that still touches
no socket or segment: per-peer send/receive queues, sequence numbers, the
one-driver-at-a-time wait loop, timeouts, withdrawal and sticky link
failures. Subclasses supply ``_push``/``_pull`` (move bytes without
blocking) and ``_idle`` (wait until bytes may move). What a frame means is
the codec's business (``gradcoll.transport.frame``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from .._util import Deadline
from ..errors import CollectiveTimeout, ProtocolError, TransportAborted, TransportClosed
from . import frame as fr
from ._ops import Link, Op, all_done, detach, withdraw
from .base import Request, Transport, as_bytes_view, as_writable_view

__all__ = ["Op", "Link", "FramedTransport"]


class FramedTransport(Transport):
    """Queues, ordering, waiting, timeouts and failures shared by ``tcp`` and ``shm``."""

    def __init__(self, rank: int, size: int, links: dict[int, Link], timeout: float) -> None:
        super().__init__(rank, size, timeout)
        self._links: list[Link | None] = [None] * size
        for peer, link in links.items():
            self._links[peer] = link
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._driving = False
        self._sleepers = 0  # threads waiting on the condition while another drives
        self._woken: Callable[[int], BaseException] | None = None  # set by interrupt(), raised by the next wait
        self._busy: dict[Link, None] = {}  # links with queued work, in insertion order
        # The link whose socket a compiled step (gradcoll.transport.tcp_fast) moves bytes on, outside the lock,
        # while this thread drives (a tuple: the links of a call of several rounds): no other thread writes to
        # them meanwhile; it wakes the step instead.
        self._stepping: Link | tuple[Link, ...] | None = None

    #: Try to read at ``irecv`` time (cheap for memory rings, a wasted syscall for sockets).
    _eager_pull = False
    #: Receives with tags >= LENIENT_TAG survive a mismatch (see FrameMismatch).
    lenient_tags = True

    # -- hooks ---------------------------------------------------------
    def _push(self, link: Any) -> bool:  # pragma: no cover - abstract
        """Move queued send bytes without blocking; True if an op finished (lock held)."""
        raise NotImplementedError

    def _pull(self, link: Any) -> bool:  # pragma: no cover - abstract
        """Move received bytes without blocking; True if an op finished (lock held)."""
        raise NotImplementedError

    def _idle(self, rounds: int, deadline: Deadline) -> None:  # pragma: no cover - abstract
        """Wait (lock not held) until bytes may move or the deadline passes; ``rounds`` without progress so far."""
        raise NotImplementedError

    def _before_idle(self) -> None:
        """Prepare the next ``_idle`` (lock held)."""

    def _wake_driver(self) -> None:
        """Another thread queued work while a driver may be idling."""

    def _on_fail(self, link: Any, abort: int | None) -> None:
        """The link just failed: tell the peer (``ABORT_*`` code) and stop the medium."""

    # -- starting operations -------------------------------------------
    def _start(self, peer: int, view: memoryview, tag: int, is_send: bool) -> Op:
        if type(peer) is not int or not 0 <= peer < self.size or peer == self.rank:
            self._check_peer(peer)  # raises the UsageError (or accepts an int subclass)
        if type(tag) is not int or not 0 <= tag <= fr.MAX_TAG:
            fr.check_tag(tag)
        link = self._links[peer]
        assert link is not None
        op = Op(self, link, is_send, view, tag)
        with self._mu:
            if link.failure is not None:
                cls, reason = link.failure
                raise cls(f"rank {self.rank}: {op.describe()}: {reason}", rank=self.rank, peer=peer)
            (link.sendq if is_send else link.recvq).append(op)
            self._busy[link] = None
            if is_send:
                stepping = self._stepping
                if len(link.sendq) == 1 and (stepping is None or (
                        link is not stepping and (type(stepping) is not tuple or link not in stepping))):
                    self._push(link)  # inline: a small message completes right here
            elif self._eager_pull and len(link.recvq) == 1:
                self._pull(link)
            if not op.done and self._driving:
                self._wake_driver()
        return op

    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``peer`` (written inline when there is room)."""
        return self._start(peer, as_bytes_view(buf), tag, True)

    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Start receiving exactly ``len(out)`` bytes with ``tag`` from ``peer`` into ``out``."""
        return self._start(peer, as_writable_view(out), tag, False)

    def send(self, peer: int, buf: Any, tag: int = 0, timeout: float | None = None) -> None:
        """Blocking send; returns when ``buf`` may be reused."""
        self._wait((self._start(peer, as_bytes_view(buf), tag, True),), timeout)

    def recv(self, peer: int, out: Any, tag: int = 0, timeout: float | None = None) -> int:
        """Blocking receive into ``out``; returns the number of bytes received."""
        return self._wait((self._start(peer, as_writable_view(out), tag, False),), timeout)

    def sendrecv(self, dst: int, sendbuf: Any, src: int, recvbuf: Any, tag: int = 0, timeout: float | None = None) -> int:
        """Full-duplex exchange; one loop drives both directions."""
        rop = self._start(src, as_writable_view(recvbuf), tag, False)
        try:
            sop = self._start(dst, as_bytes_view(sendbuf), tag, True)
        except BaseException:
            self._cancel(rop)
            raise
        self._wait((rop, sop), timeout)
        return rop.total

    # -- waiting ---------------------------------------------------------
    def _wait(self, ops: Iterable[Op], timeout: float | None) -> int:
        """Wait for ``ops``: drive I/O if no other thread does, else sleep until the driver finishes them."""
        ops = tuple(ops)
        if all_done(ops):  # finished inline; ``done`` is only set under the lock
            return self._result(ops)
        deadline = Deadline(self._timeout(timeout))
        mu = self._mu
        with mu:
            while self._driving and not all_done(ops):
                if self._woken is not None:
                    raise self._woken_error(ops)
                if deadline.expired():
                    self._expire(ops, deadline.timeout)
                self._sleepers += 1
                try:
                    self._cv.wait(deadline.remaining())
                finally:
                    self._sleepers -= 1
            if all_done(ops):
                return self._result(ops)
            self._driving, idle = True, 0  # idle: consecutive rounds without progress
            try:
                while True:
                    if self._progress():
                        idle = 0
                        if self._sleepers:
                            self._cv.notify_all()
                    else:
                        idle += 1
                    if all_done(ops):
                        break
                    if self._woken is not None:
                        raise self._woken_error(ops)
                    if deadline.expired():
                        self._expire(ops, deadline.timeout)
                    self._before_idle()
                    mu.release()
                    try:
                        self._idle(idle, deadline)
                    finally:
                        mu.acquire()
            finally:
                self._driving = False
                if self._sleepers:
                    self._cv.notify_all()
        return self._result(ops)

    @staticmethod
    def _result(ops: tuple[Op, ...]) -> int:
        for op in ops:
            if op.error is not None:
                raise op.error
        return ops[0].total

    def _test(self, op: Op) -> bool:
        with self._mu:
            if not op.done and not self._driving and self._progress() and self._sleepers:
                self._cv.notify_all()
            return op.done

    def _queued(self) -> bool:
        """True when a link has queued work (lock held); forgets the busy links whose queues have emptied."""
        for link in list(self._busy):
            if link.sendq or link.recvq:
                return True
            del self._busy[link]
        return False

    def _progress(self) -> bool:
        """Move bytes on every busy link without blocking; True if an op finished."""
        done = False
        for link in list(self._busy):
            if link.sendq:
                done |= self._push(link)
            if link.recvq:
                done |= self._pull(link)
            if not link.sendq and not link.recvq:
                self._busy.pop(link, None)
        return done

    # -- headers, failures, timeouts -----------------------------------
    def _accept_header(self, link: Link, op: Op, got: fr.Header) -> bool:
        """Act on the header ``op`` just read; on CLOSE/ABORT/mismatch fail the link and return False."""
        verdict = fr.classify(got, seq=op.seq, tag=op.tag, length=op.total)
        if verdict is fr.EXPECTED:
            return True
        if verdict is fr.STRAY:
            # A lenient receive met another collective's frame (or an alarm): take
            # the frame in whole, so the stream stays in step, and fail the op with
            # it when it completes (see _finish_recv). Its length is the peer's word:
            # it sizes an allocation only up to what this receive or the running
            # collective expects (``stray_limit``); anything longer is refused unread.
            limit = max(op.total, self.stray_limit)
            if got.length > limit:
                self.refuse(link, op, ProtocolError(
                    f"rank {self.rank}: peer {link.peer} sent a frame of {got.length} bytes (seq {got.seq}, tag "
                    f"{got.tag}) where this rank's {op.describe(with_peer=False)} takes at most {limit} bytes; "
                    f"refused unread ({self.name} transport)", rank=self.rank, peer=link.peer))
                return False
            op.stray = (op.tag, op.total, op.view)
            op.tag, op.total, op.view = got.tag, got.length, memoryview(bytearray(got.length))
            return True
        if verdict is fr.CLOSED:
            self._fail(link, TransportClosed, f"peer {link.peer} closed the link")
        elif verdict is fr.ABORTED:
            why = fr.abort_reason(got.tag)
            self._fail(link, TransportAborted, f"peer {link.peer} dropped the link after {why} on its side")
        else:
            # The stream is out of step: the op learns exactly why, then the link
            # is dropped with an ABORT so the peer fails fast instead of hanging.
            e = fr.mismatch_error(got, seq=op.seq, tag=op.tag, length=op.total, rank=self.rank, peer=link.peer,
                                  transport=self.name)
            link.recvq.remove(op)
            op.error, op.done = e, True
            self._fail(link, TransportAborted, f"link dropped after a mismatch ({e})", e, fr.ABORT_MISMATCH)
        return False

    def refuse(self, link: Link, op: Op, exc: ProtocolError) -> None:
        """``op`` met bytes that break the protocol: it fails with ``exc``, the link is dropped with an ABORT."""
        if op in link.recvq:
            link.recvq.remove(op)
        op.error, op.done = exc, True
        self._fail(link, TransportAborted, f"link dropped after a protocol error ({exc})", exc, fr.ABORT_PROTOCOL)

    def _finish_recv(self, link: Link, op: Op) -> None:
        """A receive has all its bytes (lock held; ``op`` already left the queue)."""
        link.recv_seq += 1
        op.done = True
        if op.stray is not None:
            tag, total, _ = op.stray
            op.error = fr.lenient_mismatch(self.rank, link.peer, op.seq, tag, total, op.tag, bytes(op.view), self.name)

    def _fail(self, link: Link, cls: type, reason: str, cause: BaseException | None = None, abort: int | None = None) -> None:
        """Make a link unusable: every pending and future op on it raises ``cls``."""
        if link.failure is not None:
            return
        link.failure = (cls, reason)
        self._on_fail(link, abort)
        for op in (*link.sendq, *link.recvq):
            err = cls(f"rank {self.rank}: {op.describe()}: {reason}", rank=self.rank, peer=link.peer)
            err.__cause__ = cause
            op.error, op.done = err, True
        link.sendq.clear()
        link.recvq.clear()
        self._busy.pop(link, None)

    def interrupt(self, error: Callable[[int], BaseException]) -> int:
        """Fail every pending operation with ``error(peer)`` (see ``Transport``); returns how many.

        One no byte of which has moved is withdrawn (its link stays in step).
        One half way through a frame goes on in the background, like any op
        a failed collective leaves behind (a send from a copy of its buffer,
        ``detach``), and the wait that waits for it raises ``error`` instead
        (once: the next wait of this transport). A receive goes on into its
        own buffer: a later wait for it may still complete it and use the
        data (an alarm that turns out not to concern this call).
        """
        n = 0
        with self._mu:
            for link in self._links:
                for op in (*link.sendq, *link.recvq) if link is not None else ():
                    if op.off == 0:
                        withdraw(op)
                        op.error, op.done = error(link.peer), True  # type: ignore[union-attr]
                        n += 1
                    elif op.is_send and not op.done:
                        detach(op)
            self._woken = error
            self._wake_driver()
            self._cv.notify_all()
        return n

    def _woken_error(self, ops: tuple[Op, ...]) -> BaseException:
        """The error ``interrupt`` left for the next wait (lock held); it is used once."""
        error, self._woken = self._woken, None
        assert error is not None
        for op in ops:  # queued after the interrupt (a compiled step handing over): they go on from a copy too
            if op.is_send and op.off and not op.done:
                detach(op)
        return error(next(op for op in ops if not op.done).link.peer)

    def _cancel(self, op: Op) -> bool:
        """``Request.cancel``: withdraw ``op`` if no byte of it has moved (its ``wait`` then returns 0)."""
        with self._mu:
            if not op.done and op.off == 0:
                withdraw(op)
                op.total, op.done = 0, True  # it moved nothing
            return op.done

    def _expire(self, ops: tuple[Op, ...], timeout: float | None) -> None:
        """With the lock held after the deadline: cancel what is unfinished and raise."""
        first: CollectiveTimeout | None = None
        for op in ops:
            if op.done:
                continue
            err = self._timeout_error(op.describe(with_peer=False), op.link.peer, timeout, op.total)
            if op.off and op.is_send:
                # Part of the frame is out: the rest goes on in the background (the queue keeps it, later waits
                # drive it), so the link stays in step. A peer that was itself stuck waiting for a third rank
                # reads it as a stray frame of the failed call, then this rank's error record: dropping the link
                # instead would look to it like this rank's death. It goes from a copy: the caller has its
                # buffer back, and what it writes there must not reach a peer as part of this frame.
                detach(op)
            elif op.off:  # bytes of a frame already read: the stream can no longer be trusted
                reason = f"link abandoned mid-message after a timeout in {op.describe()}"
                self._fail(op.link, TransportAborted, reason, err, fr.ABORT_TIMEOUT)
            else:
                withdraw(op)
            op.error, op.done = err, True
            first = first or err
        if first is not None:
            raise first

    def _close_links(self, goodbye: Any) -> None:
        """Common part of ``close``: ``goodbye(link)`` for healthy links, then fail them all."""
        with self._mu:
            if self.closed:
                return
            if self._stepping is not None:  # a compiled step owns a socket: wake it, let it hand over first
                self._wake_driver()
                self._sleepers += 1  # (the hand-over notifies sleepers only)
                try:
                    self._cv.wait_for(lambda: self._stepping is None, timeout=5.0)
                finally:
                    self._sleepers -= 1
            self.closed = True
            for link in self._links:
                if link is not None:
                    if link.failure is None:
                        goodbye(link)
                    self._fail(link, TransportClosed, "the transport was closed locally")
            self._wake_driver()
            self._cv.notify_all()
            self._sleepers += 1  # let a driver in another thread finish before the medium goes away
            try:
                self._cv.wait_for(lambda: not self._driving, timeout=5.0)
            finally:
                self._sleepers -= 1

"""`Work` and the `Executor` that runs a group's collectives in submission order (see `gradcoll.group`).

A synchronous call with nothing queued runs inline on the caller's thread
(no hand-off, no wake-up); anything else is queued for the group's one
background thread, started at the first asynchronous call. Either way the
collectives run one at a time in the order they were submitted, so the
sequence numbers, and the order of collectives, are the same on every rank.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveTimeout, GroupPoisoned, TransportClosed, UsageError
from ..observe.trace import Recorder
from ..transport.base import Transport

__all__ = ["Work", "Executor"]


class Work:
    """Handle of one asynchronous collective (``async_op=True``)."""

    def __init__(self, name: str, seq: int) -> None:
        self.name = name
        self.seq = seq
        self._done = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        self._result, self._exc = result, exc
        self._done.set()

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` s); re-raise its error; return its result.

        Running out of ``timeout`` raises CollectiveTimeout but does not cancel
        the collective, which is bounded by its own timeout.
        """
        if not self._done.wait(timeout):
            raise CollectiveTimeout(
                f"{self.name} (seq {self.seq}) did not complete within {timeout}s (it is still running)",
                op=self.name, seq=self.seq,
            )
        if self._exc is not None:
            raise self._exc
        return self._result

    def result(self, timeout: float | None = None) -> Any:
        """The collective's result (the caller's buffer), waiting as [`wait`][gradcoll.group.Work.wait] does."""
        return self.wait(timeout)

    def exception(self) -> BaseException | None:
        """The error the collective raised, or None (also None while it is still running)."""
        return self._exc if self._done.is_set() else None

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self.is_completed() else "pending"
        return f"<Work {self.name} seq={self.seq} {state}>"


#: A collective to run: called with its sequence number, returns the collective's result.
Job = Callable[[int], Any]


class Executor:
    """Numbers a group's collectives, runs them in order, records each, and poisons the group on a failure.

    ``seq``, ``closed`` and ``poison`` (``(name, seq, error)`` of the
    collective that failed, or None) are what the group's monitor reports
    to peers (`gradcoll.observe.diagnosis`).
    """

    def __init__(self, transport: Transport, rec: Recorder) -> None:
        self.transport, self.rec = transport, rec
        self.rank, self.size = transport.rank, transport.size
        self.seq = 0
        self.closed = False
        self.poison: tuple[str, int, BaseException] | None = None
        self._lock = threading.Condition()
        self._queue: collections.deque[tuple[Work, Callable[[], Any]]] = collections.deque()
        self._busy = False
        self._worker: threading.Thread | None = None
        self._caller = 0  # the thread whose collectives are queued or running (0: none)

    def check(self) -> None:
        """Raise TransportClosed once closed, GroupPoisoned (chained to the failure) once poisoned."""
        if self.closed:
            raise TransportClosed(f"rank {self.rank}: process group is closed", rank=self.rank)
        if self.poison is not None:
            name, seq, exc = self.poison
            raise GroupPoisoned(
                f"rank {self.rank}: process group is poisoned: {name} (seq {seq}) failed with "
                f"{type(exc).__name__}: {exc}; build a new group"
            ) from exc

    def submit(self, name: str, job: Job, async_op: bool, nseq: int = 1, nbytes: int = 0) -> Any:
        """Run ``job`` with the next sequence number (``nseq`` numbers reserved); its result, or a Work."""
        lock = self._lock  # acquire/release are the lock's own (C) methods: the fast path's small calls see them
        lock.acquire()
        try:
            self.check()
            me = threading.get_ident()
            if (self._queue or self._busy) and self._caller not in (0, me):
                # Serialising two threads' calls here would not fix the order on the other ranks: their
                # calls would pair up differently there and swap results. So a second driver is refused.
                raise UsageError(
                    f"rank {self.rank}: {name} called from a second thread while another thread's collective "
                    f"(seq {self.seq - 1}) is still running; a process group is driven by one thread at a time "
                    "(use one group per thread, or wait for the other thread's call)")
            self._caller = me
            seq = self.seq
            self.seq += nseq
            inline = not async_op and not self._queue and not self._busy
            if inline:
                self._busy = True
            else:
                work = Work(name, seq)
                self._queue.append((work, lambda: self._run(name, seq, job, nbytes)))
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, name=f"gradcoll-rank{self.rank}", daemon=True)
                    self._worker.start()
                lock.notify_all()
        finally:
            lock.release()
        if not inline:
            return work if async_op else work.wait()
        try:
            return self._call(name, seq, job, nbytes)  # usability was checked under the lock above
        finally:
            lock.acquire()
            self._busy = False
            if self._worker is not None:  # the only thread that waits on the lock
                lock.notify_all()
            lock.release()

    def inline(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], nbytes: int) -> Any:
        """``submit(name, lambda seq: fn(seq, *args), False)``, in fewer steps: the one-host fast path's call.

        When a queued or running collective, a close or a poison is in the way, it is ``submit``'s call.
        """
        lock = self._lock
        lock.acquire()
        if self._busy or self._queue or self.closed or self.poison is not None:
            lock.release()
            return self.submit(name, lambda seq: fn(seq, *args), False, nbytes=nbytes)
        self._caller = threading.get_ident()
        seq = self.seq
        self.seq = seq + 1
        self._busy = True
        lock.release()
        rec, t, ok = self.rec, self.transport, False
        rec.begin(name, seq, nbytes, t.blocked_s)
        try:
            result = fn(seq, *args)
            ok = True
            return result
        except BaseException as exc:
            with lock:
                if self.poison is None:
                    self.poison = (name, seq, exc)
            raise
        finally:
            rec.end(t.blocked_s, ok)
            lock.acquire()
            self._busy = False
            if self._worker is not None:
                lock.notify_all()
            lock.release()

    def _run(self, name: str, seq: int, job: Job, nbytes: int) -> Any:
        with self._lock:
            self.check()
        return self._call(name, seq, job, nbytes)

    def _call(self, name: str, seq: int, job: Job, nbytes: int) -> Any:
        rec, ok = self.rec, False
        rec.begin(name, seq, nbytes, self.transport.blocked_s)
        try:
            result = job(seq)
            ok = True
            return result
        except BaseException as exc:
            with self._lock:
                if self.poison is None:
                    self.poison = (name, seq, exc)
            raise
        finally:
            rec.end(self.transport.blocked_s, ok)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self.closed:
                    self._lock.wait()
                if not self._queue:
                    return
                while self._busy:  # an inline call that started before our job was queued
                    self._lock.wait()
                work, call = self._queue.popleft()
                self._busy = True
            try:
                work._finish(call(), None)
            except BaseException as exc:
                work._finish(None, exc)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def close(self) -> bool:
        """Refuse new work and fail what is queued (TransportClosed); False if it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for work, _ in pending:
            work._finish(None, TransportClosed(
                f"rank {self.rank}: process group closed before {work.name} (seq {work.seq}) ran", rank=self.rank))
        return True

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the background thread to stop (after ``close``); not from that thread itself."""
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=timeout)

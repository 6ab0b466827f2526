"""torch ``Work`` and futures for gradcoll collectives, run in order on one thread per group.

The torch front end never drives a gradcoll group from torch's threads
(DDP calls ``allreduce`` from inside ``backward``): a
[`Driver`][gradcoll.torch._work.Driver] owns one thread that runs every
collective of its group in submission order, which is the order every rank
submitted them in, and completes the [`TorchWork`][gradcoll.torch._work.TorchWork]
returned for it.

torch's C++ consumers of a future (DDP's reducer, comm hooks) cannot see an
exception set on a Python future: ``Future.set_exception`` stores the
exception as the value. So a work's future is ``then``-chained on an inner
one, and a failure is raised from that callback, which torch records as an
error on the future: DDP's ``backward`` then raises a ``RuntimeError``
carrying the message. ``TorchWork.wait`` raises the error itself, with its
gradcoll class (also a ``RuntimeError``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, TransportClosed, seconds
from ._tensors import as_runtime_error

__all__ = ["TorchWork", "Driver"]


def _unwrap(fut: Any) -> Any:
    result, exc = fut.value()
    if exc is not None:
        raise exc
    return result


class TorchWork(dist.Work):  # type: ignore[misc]
    """A ``torch.distributed.Work`` for one gradcoll collective: ``wait``, ``get_future``, ``is_completed``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._result: Any = None
        self._inner: Any = torch.futures.Future()
        self._future: Any = self._inner.then(_unwrap)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        self._result, self._exc = result, exc
        self._done.set()
        self._inner.set_result((result, exc))

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done (``timeout`` of zero or None: no limit of its own); raise its error; True."""
        limit = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        if not self._done.wait(limit):
            raise as_runtime_error(CollectiveTimeout(
                f"{self.name} did not complete within the {seconds(limit)}s given to Work.wait (it keeps running, "
                "bounded by the group's timeout)", op=self.name))
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with the collective's output tensors (or its error)."""
        return self._future

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the collective finished without an error."""
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        """The collective's error, or None (also while it runs)."""
        return self._exc

    def result(self) -> Any:
        """The output tensors, waiting for them."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self.is_completed() else "pending"
        return f"<gradcoll TorchWork {self.name} {state}>"


#: A queued collective: the work to complete, what to run, and a note for its error message.
_Job = tuple[TorchWork, Callable[[], Any], str]


class Driver:
    """One thread that runs a group's collectives in submission order and completes their works."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, name: str, fn: Callable[[], Any], note: str = "") -> TorchWork:
        """Queue ``fn`` (a call on the gradcoll group); its result or error completes the returned work."""
        work = TorchWork(name)
        with self._lock:
            if self._closed:
                work._finish(None, as_runtime_error(TransportClosed(f"{name}: {self.name} was shut down")))
                return work
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"gradcoll-torch-{self.name}", daemon=True)
                self._thread.start()
            self._queue.put((work, fn, note))
        return work

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            work, fn, note = job
            try:
                result = fn()
            except BaseException as exc:  # every failure goes to the waiter, none kills the thread
                work._finish(None, as_runtime_error(exc, note))
            else:
                work._finish(result, None)

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

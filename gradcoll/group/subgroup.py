"""Bootstrapping a subgroup's transport through its parent group: the store whose keys travel by allgather.

A subgroup (``ProcessGroup.split``, ``gradcoll.new_group``) gets a transport
of its own: its own connections among its members, built by the backend's
ordinary ``create(store, rank, size, ...)``. There is no bootstrap store by
then (``init_process_group`` closed it), so the store is made of the parent
group itself:

* every rank of the parent runs its member's ``create`` (nothing, for a rank
  outside every part) on a thread, against an [`ExchangeStore`][gradcoll.group.subgroup.ExchangeStore]:
  a local dictionary that records what the thread sets;
* meanwhile the calling thread runs *rounds* on the parent: one
  ``allgather`` of ``(bytes, done, failed, digest)`` per rank, then one of
  the keys each rank set since the last round. Every rank adds the others'
  keys to its store, which wakes a thread waiting for one of them (a tcp
  rank dialling a lower one waits for its address).

A round starts as soon as the thread has set a key, waits for one, or has
finished, and at least every ``PACE_S`` otherwise. The rounds stop when every
rank's thread has finished, which every rank learns in the same round, so
all ranks run the same number of parent collectives. A failure on one rank
(its ``create`` raised) travels as its last key: every rank then closes what
it built and raises the same error. The digest is the parts and the
backend: ranks that called ``split`` differently raise UsageError at the
first round.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from .._util import Deadline
from ..errors import GradcollError, UsageError
from ..store.hash import HashStore

__all__ = ["ExchangeStore", "exchange", "PACE_S"]

#: The longest a rank waits between two rounds while its bootstrap thread is busy (seconds).
PACE_S = 0.005
_ERROR_KEY = "!error"
_LEN = struct.Struct("<I")


class _Parent(Protocol):
    rank: int
    size: int

    def allgather(self, buf: np.ndarray, out: np.ndarray | None = None, async_op: bool = False,
                  timeout: float | None = None) -> Any: ...


class ExchangeStore(HashStore):
    """A bootstrap store whose keys reach the other ranks in the rounds of ``exchange`` (see the module doc)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self._outbox: list[tuple[str, bytes]] = []
        self._waiting = 0

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            super().set(key, value)
            self._outbox.append((key, bytes(value)))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            try:
                return super().get(key, timeout)
            finally:
                self._waiting -= 1

    def absorb(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Keys another rank set (not sent on again)."""
        with self._cond:
            for key, value in items:
                self._data[key] = value
            self._cond.notify_all()

    def take(self) -> bytes:
        """The keys set since the last call, encoded for a round."""
        with self._cond:
            items, self._outbox = self._outbox, []
        return encode(items)

    def settle(self, finished: Callable[[], bool], pace: float) -> None:
        """Wait until the thread set a key, waits for one or finished, or ``pace`` seconds passed."""
        end = time.monotonic() + pace
        with self._cond:
            while not (self._outbox or self._waiting or finished()):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)


def encode(items: Iterable[tuple[str, bytes]]) -> bytes:
    """``(key, value)`` pairs as length-prefixed bytes."""
    out = bytearray()
    for key, value in items:
        k = key.encode()
        out += _LEN.pack(len(k)) + k + _LEN.pack(len(value)) + value
    return bytes(out)


def decode(data: bytes) -> list[tuple[str, bytes]]:
    """The pairs of ``encode`` (the peers are the parent's own ranks; a malformed round is a GradcollError)."""
    out, i = [], 0
    try:
        while i < len(data):
            (kn,), i = _LEN.unpack_from(data, i), i + 4
            key, i = data[i : i + kn].decode(), i + kn
            (vn,), i = _LEN.unpack_from(data, i), i + 4
            if i + vn > len(data):
                raise ValueError("value past the end")
            out.append((key, data[i : i + vn]))
            i += vn
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise GradcollError(f"malformed subgroup bootstrap round: {exc}") from None
    return out


def exchange(parent: _Parent, build: Callable[[ExchangeStore], Any] | None, digest: str, timeout: float,
             close: Callable[[Any], None]) -> tuple[Any, dict[int, str]]:
    """Run ``build(store)`` on a thread while the parent's ranks exchange what it sets.

    Every rank of ``parent`` calls it (``build`` None on a rank that builds
    nothing); ``digest`` must be the same on every rank. Returns what it
    built and ``{}``, or, after a failure on any rank, None and the
    errors by rank (the same on every rank; what was built is passed to
    ``close``).
    """
    deadline = Deadline(timeout + 5.0)  # the build is bounded by ``timeout``; the rounds allow for the slowest
    check = zlib.crc32(digest.encode())
    sums = parent.allgather(np.array([check], np.int64), timeout=deadline.remaining())
    odd = [r for r in range(parent.size) if sums[r][0] != sums[0][0]]
    if odd:
        raise UsageError(f"rank {parent.rank}: rank(s) {odd} called split with other ranks or another backend "
                         "than rank 0; every rank of the group must call it with the same arguments")
    store = ExchangeStore(timeout)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = build(store)  # type: ignore[misc]
        except BaseException as exc:  # reported to every rank in the next round
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"gradcoll-split-rank{parent.rank}", daemon=True) if build else None
    if thread is not None:
        thread.start()
    try:
        errors = _rounds(parent, store, thread, out, deadline)
    except BaseException:
        if thread is not None:
            thread.join(timeout)  # bounded by the build's own timeout: close what it built, not leak it
        _close(out, close)
        raise
    if errors:
        _close(out, close)
        return None, errors
    return out.get("value"), {}


def _rounds(parent: _Parent, store: ExchangeStore, thread: threading.Thread | None, out: dict[str, Any],
            deadline: Deadline) -> dict[int, str]:
    """Exchange rounds until every rank's thread finished; the errors reported, by rank."""
    errors: dict[int, str] = {}
    reported = False
    while True:
        if thread is not None and thread.is_alive():
            store.settle(lambda: not thread.is_alive(), PACE_S)
        finished = thread is None or not thread.is_alive()
        payload = store.take()
        if finished and "error" in out and not reported:
            exc, reported = out["error"], True
            payload += encode([(_ERROR_KEY, f"{type(exc).__name__}: {exc}".encode())])
        metas = parent.allgather(np.array([len(payload), finished], np.int64), timeout=deadline.remaining())
        width = int(metas[:, 0].max())
        if width:
            row = np.zeros(width, np.uint8)
            row[: len(payload)] = np.frombuffer(payload, np.uint8)
            rows = parent.allgather(row, timeout=deadline.remaining())
            for r in range(parent.size):
                items = decode(rows[r, : int(metas[r][0])].tobytes())
                for k, v in items:
                    if k == _ERROR_KEY:
                        errors[r] = v.decode(errors="replace")
                if r != parent.rank:
                    store.absorb((k, v) for k, v in items if k != _ERROR_KEY)
        if all(int(m[1]) for m in metas):
            return errors


def _close(out: dict[str, Any], close: Callable[[Any], None]) -> None:
    if out.get("value") is not None:
        close(out["value"])

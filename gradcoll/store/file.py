"""``FileStore``: a store in one file shared by processes on one file system.

The file is an append-only log of records ``u8 op (1 set, 2 delete) | u32
key length | u32 value length | key | value`` (little-endian), every access
under ``flock``; each process replays the records appended since its last
read.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator

from ..errors import CollectiveTimeout, UsageError, seconds
from .base import Store

__all__ = ["FileStore"]

_REC = struct.Struct("<BII")  # op (1 set, 2 delete), key length, value length
_REFS = "__gradcoll_filestore_refs"


class FileStore(Store):
    """Store in one file shared by processes on one file system (an append-only, ``flock``-ed log).

    Waiting for a key polls the file with a growing pause (up to 50 ms).
    Every instance counts itself in the file; the last one to close deletes
    it, so a path can be reused by the next job.
    """

    def __init__(self, path: str, timeout: float = 300.0) -> None:
        self.path, self.timeout = path, timeout
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self.add(_REFS, 1)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Hold the thread lock and the file lock (shared or exclusive); yields the fd."""
        with self._lock:
            if self._fd is None:
                raise UsageError("store is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield self._fd
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _refresh(self, fd: int) -> None:
        """Apply the records other processes appended since the last read (locks held)."""
        size = os.fstat(fd).st_size
        if size <= self._offset:
            return
        raw = os.pread(fd, size - self._offset, self._offset)
        pos = 0
        while pos + _REC.size <= len(raw):
            op, klen, vlen = _REC.unpack_from(raw, pos)
            end = pos + _REC.size + klen + vlen
            if end > len(raw):
                break  # a record being written right now: read it next time
            key = raw[pos + _REC.size : pos + _REC.size + klen].decode("utf-8")
            if op == 1:
                self._data[key] = raw[end - vlen : end]
            else:
                self._data.pop(key, None)
            pos = end
        self._offset += pos

    @staticmethod
    def _append(fd: int, op: int, key: str, value: bytes = b"") -> None:
        k = key.encode("utf-8")
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, _REC.pack(op, len(k), len(value)) + k + value)

    def set(self, key: str, value: bytes) -> None:
        with self._locked(True) as fd:
            self._append(fd, 1, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        end = time.monotonic() + limit
        pause = 0.001
        while True:
            with self._locked(False) as fd:
                self._refresh(fd)
                if key in self._data:
                    return self._data[key]
            if time.monotonic() >= end:
                raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get")
            time.sleep(min(pause, max(0.0, end - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def add(self, key: str, amount: int) -> int:
        with self._locked(True) as fd:
            self._refresh(fd)
            value = int(self._data.get(key, b"0")) + amount
            self._append(fd, 1, key, str(value).encode())
            return value

    def check(self, keys: Iterable[str]) -> bool:
        with self._locked(False) as fd:
            self._refresh(fd)
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._locked(True) as fd:
            self._refresh(fd)
            existed = key in self._data
            self._append(fd, 2, key)
            return existed

    def close(self) -> None:
        """Drop this instance's reference; the last one deletes the file. Idempotent."""
        if self._fd is None:
            return
        with self._locked(True) as fd:
            self._refresh(fd)
            refs = int(self._data.get(_REFS, b"1")) - 1
            self._append(fd, 1, _REFS, str(refs).encode())
            if refs <= 0:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        os.close(self._fd)
        self._fd = None

"""``HashStore``: a store for ranks that are threads of one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from ..errors import CollectiveTimeout, seconds
from .base import Store

__all__ = ["HashStore"]


class HashStore(Store):
    """In-process store for ranks that are threads of one process."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        end = time.monotonic() + limit
        with self._cond:
            while key not in self._data:
                left = end - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get")
                self._cond.wait(left)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            v = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(v).encode()
            self._cond.notify_all()
            return v

    def check(self, keys: Iterable[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

"""Key-value stores used only to bootstrap a group (never on the data path).

Like torch.distributed's ``Store``: ``set``/``get``/``add``/``wait``/
``delete``. Transports exchange addresses, segment names and the like
through a store before any collective runs. Every blocking call takes a
timeout in seconds and raises :class:`~gradcoll.errors.CollectiveTimeout`.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Iterable

from .errors import CollectiveTimeout

__all__ = ["Store", "HashStore", "PrefixStore"]


class Store(abc.ABC):
    """Bootstrap key-value store interface."""

    timeout: float = 300.0

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it to be set."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); return the new value."""

    @abc.abstractmethod
    def check(self, keys: Iterable[str]) -> bool:
        """True when every key is set (no waiting)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key is set."""
        for k in list(keys):
            self.get(k, timeout)

    def close(self) -> None:
        """Release resources (sockets, server threads)."""


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
                    raise CollectiveTimeout(f"store: key {key!r} was not set within {limit}s", op="store.get")
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


class PrefixStore(Store):
    """A view of another store with every key prefixed (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def check(self, keys: Iterable[str]) -> bool:
        return self.store.check([self._k(k) for k in keys])

    def delete(self, key: str) -> bool:
        return self.store.delete(self._k(key))

"""The bootstrap store interface, and ``PrefixStore`` (one key namespace per group)."""

from __future__ import annotations

import abc
from collections.abc import Iterable

__all__ = ["Store", "PrefixStore"]


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

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for stores that hold nothing
        """Release resources (sockets, server threads)."""


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

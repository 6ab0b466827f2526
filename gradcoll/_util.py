"""Small helpers shared by every layer: deadlines and exact socket reads.

This is the bottom of the package (it imports nothing of gradcoll's but the
errors), so the store, the transports and the front ends can all use it.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Deadline", "recv_exact", "recv_upto"]


class Receiver(Protocol):
    """What the socket helpers need of a socket (``socket.socket`` has it); typed here so that
    this module does not import ``socket``: the layers that must not touch one import this module."""

    def recv(self, bufsize: int, /) -> bytes: ...


class Deadline:
    """A point in time derived from a timeout in seconds; ``remaining()`` never negative."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left, or None for no limit."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return self.at is not None and time.monotonic() >= self.at


def recv_upto(sock: Receiver, n: int) -> bytes:
    """Read ``n`` bytes from a blocking socket; fewer only when the peer closed the connection first.

    Timeouts and errors of the socket propagate as they are (``TimeoutError``,
    ``OSError``).
    """
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def recv_exact(sock: Receiver, n: int, what: str = "message") -> bytes:
    """Read exactly ``n`` bytes; ``ConnectionError`` naming ``what`` if the peer closes first."""
    out = recv_upto(sock, n)
    if len(out) < n:
        raise ConnectionError(f"connection closed during the {what} after {len(out)} of {n} bytes")
    return out

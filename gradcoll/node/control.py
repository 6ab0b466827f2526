"""NodeControl: how long a serving loop runs (a step budget and a stop flag).

The flag is a ``threading.Event`` raised through a
``NodeStopHandle`` from any thread (a shell's UI thread, a signal
handler's helper). A serving loop checks it between activations and, while
idle, every ``poll`` seconds: it waits for the next message in slices of
``poll`` seconds, so a stop takes effect within one such receive timeout
even when no traffic arrives.
"""

from __future__ import annotations

import math
import threading

from ..errors import UsageError

__all__ = ["NodeControl", "NodeStopHandle", "DEFAULT_POLL"]

#: Seconds a serving loop waits for a message before it looks at the stop flag again.
DEFAULT_POLL = 0.2


class NodeStopHandle:
    """Raises the stop flag of one ``NodeControl`` from another thread."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def stop(self) -> None:
        """Ask the loop to stop (idempotent); it returns within one receive timeout."""
        self._event.set()

    @property
    def stopped(self) -> bool:
        """True once ``stop`` was called."""
        return self._event.is_set()

    def is_stopped(self) -> bool:
        """True once ``stop`` was called (the original's name for ``stopped``)."""
        return self._event.is_set()


class NodeControl:
    """Bounds a serving loop: at most ``max_steps`` activations (None: no bound) and a stop flag."""

    def __init__(self, max_steps: int | None = None, *, poll: float = DEFAULT_POLL) -> None:
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
            raise UsageError(f"max_steps must be an int >= 0 or None, got {max_steps!r}")
        if not isinstance(poll, (int, float)) or not math.isfinite(poll) or poll <= 0:
            raise UsageError(f"poll must be a positive number of seconds, got {poll!r}")
        self.max_steps = max_steps
        self.poll = float(poll)
        self._event = threading.Event()

    @classmethod
    def steps(cls, n: int, *, poll: float = DEFAULT_POLL) -> "NodeControl":
        """Serve at most ``n`` activations."""
        return cls(n, poll=poll)

    @classmethod
    def unbounded(cls, *, poll: float = DEFAULT_POLL) -> "NodeControl":
        """Serve until stopped or the link closes."""
        return cls(None, poll=poll)

    def stop_handle(self) -> NodeStopHandle:
        """A handle another thread can use to stop the loop."""
        return NodeStopHandle(self._event)

    @property
    def stopped(self) -> bool:
        """True once the stop flag is raised."""
        return self._event.is_set()

    def allows(self, done: int) -> bool:
        """True if a loop that has served ``done`` activations may serve another."""
        return not self._event.is_set() and (self.max_steps is None or done < self.max_steps)

    #: The original's name for ``allows``.
    should_continue = allows

    def __repr__(self) -> str:
        bound = "unbounded" if self.max_steps is None else f"steps={self.max_steps}"
        return f"<NodeControl {bound} poll={self.poll}s{' stopped' if self.stopped else ''}>"

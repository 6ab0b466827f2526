"""The gradcoll exception taxonomy.

One base, [`GradcollError`][gradcoll.errors.GradcollError]. Misuse by the caller is also a
``ValueError`` (or ``TypeError``); everything a peer or the
environment does to us has its own class, so a handler can tell "I called it
wrong" from "a peer broke the protocol" from "a peer went away".
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GradcollError",
    "UsageError",
    "NonFiniteError",
    "ProtocolError",
    "TransportError",
    "TransportClosed",
    "TransportBroken",
    "TransportAborted",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "GroupPoisoned",
    "ShrinkFailed",
    "BackendUnavailable",
]


def seconds(t: float | None) -> str:
    """A duration for a message: ``0.3``, ``5``, ``300`` (not ``299.9830491540001``)."""
    if t is None:
        return "unbounded"
    return f"{t:.3g}" if t < 100 else f"{t:.0f}"


class GradcollError(Exception):
    """Base class of every error gradcoll raises on purpose."""


class UsageError(GradcollError, ValueError):
    """The caller misused an API (wrong length, dtype, rank, argument)."""


class BackendUnavailable(GradcollError, RuntimeError):
    """A requested kernel or transport backend cannot be loaded here."""


class NonFiniteError(GradcollError, FloatingPointError):
    """A NaN or +/-Inf was found in a gradient.

    ``contributor`` is the index of the offending input (for a collective:
    the rank that contributed it), ``index`` the flat element index and
    ``value`` the offending value. ``seq`` and ``step`` are filled in by the
    collective layer when known.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        contributor: int | None = None,
        index: int | None = None,
        value: float | None = None,
        rank: int | None = None,
        seq: int | None = None,
        step: int | None = None,
    ) -> None:
        self.contributor = contributor
        self.index = index
        self.value = value
        self.rank = rank
        self.seq = seq
        self.step = step
        if message is None:
            message = f"non-finite value {value!r} in input {contributor} at element {index}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # keep attributes across pickling
        return (
            _rebuild_nonfinite,
            (str(self), self.contributor, self.index, self.value, self.rank, self.seq, self.step),
        )


def _rebuild_nonfinite(msg: str, contributor: Any, index: Any, value: Any, rank: Any, seq: Any, step: Any) -> NonFiniteError:
    return NonFiniteError(msg, contributor=contributor, index=index, value=value, rank=rank, seq=seq, step=step)


class ProtocolError(GradcollError):
    """A peer sent bytes that break the protocol (remote fault).

    ``peer`` is the rank (or address) that sent them, and ``rank`` the one
    that read them, when known.
    """

    def __init__(self, message: str = "", *, rank: int | None = None, peer: Any = None) -> None:
        self.rank = rank
        self.peer = peer
        super().__init__(message)


class TransportError(GradcollError, ConnectionError):
    """A link to a peer failed."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None) -> None:
        self.rank = rank
        self.peer = peer
        super().__init__(message)


class TransportClosed(TransportError):
    """The link was closed in an orderly way (by us or by the peer)."""


class TransportBroken(TransportError):
    """The link broke from outside (reset, dead process, lost segment)."""


class TransportAborted(TransportBroken):
    """The link was dropped after an error elsewhere: a consequence, never the cause.

    The peer dropped it after an error on its side (it sent ABORT), or this
    rank dropped it after a timeout, a mismatch or a protocol error on
    another operation of the same link. A collective never reports one of
    these as the reason it failed when the group knows the first failure.
    """


class CollectiveTimeout(GradcollError, TimeoutError):
    """A blocking call did not complete in time.

    ``missing`` lists the peers that did not arrive, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        missing: list[int] | None = None,
        op: str | None = None,
        seq: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        self.rank = rank
        self.missing = list(missing or [])
        self.op = op
        self.seq = seq
        self.nbytes = nbytes
        super().__init__(message)


class CollectiveMismatch(GradcollError):
    """Ranks called different collectives, shapes, dtypes or ops."""


class GroupPoisoned(GradcollError, RuntimeError):
    """A previous collective failed; the group must be rebuilt before reuse."""


class ShrinkFailed(GradcollError, RuntimeError):
    """``ProcessGroup.shrink()`` could not agree on a smaller group (excluded, no decision, second failure)."""

"""The compiled-rounds capability (``Transport.rounds``) and the plan of a multi-round call it runs.

``Rounds`` is an optional capability a transport declares (``Transport.rounds``:
None where it has none; tcp's is itself): exchange-and-reduce steps and
whole sequences of them in compiled calls, with the frames the transport's
``sendrecv`` sends. Every method declines before a byte moves where it
cannot run the call (``exchange_reduce``: ``DECLINED``; the others: 0 or
None), and the caller then runs its general path. ``gradcoll.testing.check_transport``
checks the capability where a transport declares it.

``FIELDS`` 64-bit integers per round, in the order of the names below: the
send link's file descriptor, the frames' tag, the send and receive sequence
numbers (the transport fills these three), the part ``[a, b)`` of the buffer
the peer's frame goes into and the part ``[c, d)`` sent, and the round's
flags (``COPY``: receive into ``[a, b)`` and reduce nothing, an allgather
round; ``DIVIDE``: divide the round's sum by the call's divisor; ``CHECK``:
check the part added into as this rank's input, which no round before
touched, as a ring's reduce-scatter rounds do), and the
receive link's file descriptor (the transport fills it: the send link's
but in a ring's rounds). The caller
(an algorithm) writes the tag, the bounds and the flags; it never sees a
socket.
"""

from __future__ import annotations

import abc
import array
from collections.abc import Callable, Iterable

import numpy as np

__all__ = ["Rounds", "PlanRunner", "DECLINED", "MOVED", "REDUCED", "FD", "TAG", "SSEQ", "RSEQ", "A", "B", "C", "D",
           "FLAGS", "RFD", "FIELDS", "COPY", "DIVIDE", "CHECK", "make", "set_tags"]

FD, TAG, SSEQ, RSEQ, A, B, C, D, FLAGS, RFD = range(10)
FIELDS = 10
COPY, DIVIDE, CHECK = 1, 2, 4

#: ``Rounds.exchange_reduce``'s outcomes.
DECLINED = -1  # nothing moved: the caller runs its general path
MOVED = 0  # both frames moved, nothing reduced (a copy: the caller reduces nothing)
REDUCED = 1  # moved and reduced; the result is finite (or was not checked)

#: A prepared ``exchange_plan`` of one sequence of rounds: ``run(flat, tmp, plan, timeout, divisor, check, found,
#: at)``, the rounds done (0: declined, nothing moved).
PlanRunner = Callable[..., int]


class Rounds(abc.ABC):
    """The compiled-rounds capability (see the module docstring)."""

    @abc.abstractmethod
    def exchange_reduce(self, peer: int, acc: np.ndarray, tmp: np.ndarray, tag: int, timeout: float | None,
                        divisor: float, check_input: bool, check: bool,
                        found: list[tuple[int, float]] | None = None, send: np.ndarray | None = None,
                        at: tuple[int, int] = (0, 0), copy: bool = False) -> int:
        """``sendrecv(peer, send or acc, peer, tmp)``, then ``acc += tmp`` (the sum divided by ``divisor``), in one
        step; with ``copy``, receive into ``acc`` and reduce nothing. ``check_input``: check ``acc`` as this
        rank's input (a bad element's ``(index, value)`` into ``found``); ``check``: check the sum. Returns
        ``DECLINED``, ``MOVED`` or ``REDUCED`` (a sum found not finite is marked at its first element)."""

    @abc.abstractmethod
    def exchange_rounds(self, peers: tuple[int, ...], acc: np.ndarray, tmp: np.ndarray, tag: int,
                        timeout: float | None, divisor: float, check: bool, found: list[tuple[int, float]],
                        at: list[int]) -> int:
        """A recursive doubling's rounds: ``exchange_reduce`` of all of ``acc`` with each of ``peers`` in turn (the
        last divides); the rounds done (fewer: one stopped early, finished by the transport; 0: declined)."""

    @abc.abstractmethod
    def exchange_plan(self, peers: tuple[int, ...], flat: np.ndarray, tmp: np.ndarray, spec: array.array[int],
                      timeout: float | None, divisor: float, check: bool, found: list[tuple[int, float]],
                      at: list[int], sources: tuple[int, ...] | None = None) -> int:
        """The rounds of ``spec`` (this module's layout) on parts of ``flat``, round ``k`` with ``peers[k]``
        (receiving from ``sources[k]``); the rounds done, as ``exchange_rounds``."""

    @abc.abstractmethod
    def plan_runner(self, peers: tuple[int, ...], sources: tuple[int, ...] | None = None) -> PlanRunner | None:
        """``exchange_plan`` of these rounds prepared once for repeated calls, or None."""




def make(rounds: Iterable[tuple[int, int, int, int, int, int]]) -> array.array[int]:
    """A plan from ``(tag, a, b, c, d, flags)`` per round (the link and the seqs left to the transport)."""
    out = array.array("q")
    for tag, a, b, c, d, flags in rounds:
        out.extend((0, tag, 0, 0, a, b, c, d, flags, 0))
    return out


def set_tags(plan: array.array[int], tags: Iterable[int]) -> None:
    """Write each round's tag (a new call's, from its descriptor)."""
    for k, tag in enumerate(tags):
        plan[FIELDS * k + TAG] = tag

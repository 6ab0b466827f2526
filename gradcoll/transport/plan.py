"""The plan of a multi-round compiled allreduce call (``Transport.exchange_plan``).

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

import array
from collections.abc import Iterable

__all__ = ["FD", "TAG", "SSEQ", "RSEQ", "A", "B", "C", "D", "FLAGS", "RFD", "FIELDS", "COPY", "DIVIDE", "CHECK", "make", "set_tags"]

FD, TAG, SSEQ, RSEQ, A, B, C, D, FLAGS, RFD = range(10)
FIELDS = 10
COPY, DIVIDE, CHECK = 1, 2, 4


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

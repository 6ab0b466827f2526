"""What one allreduce does on its critical path, per algorithm: the counts the cost model prices.

``work(algorithm, n, S)`` gives the messages, link bytes, reduced bytes and
copied bytes on the critical path of one allreduce of ``S`` bytes on ``n``
ranks, and the mean copied and reduced bytes of the other ranks; the
closed forms per algorithm are in ``gradcoll.model.costmodel``'s docstring.
``out_of_l2`` is the per-core cache term's fraction of a message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from ..errors import UsageError

__all__ = ["ALGORITHMS", "DIRECT_MODES", "HOST_STEPS", "WINDOW_PIECE_BYTES", "L2_COPIES", "Work", "work", "terms",
           "out_of_l2", "halving_out_of_l2", "register_work"]

#: The algorithms over links the model covers (``algorithm="auto"`` chooses among them where memory is not shared).
ALGORITHMS = ("ring", "star", "recursive_doubling", "halving_doubling")
#: The two schedules of the direct allreduce over a shared window (``gradcoll.algorithms.direct``).
DIRECT_MODES = ("direct_one_shot", "direct_two_shot")

#: The two-level allreduce's steps inside a host (up to the leader and back), by how they move the bytes: ``star``
#: by messages, ``window_star`` through one shared window per host (``gradcoll.algorithms._two_level_window``).
HOST_STEPS = ("star", "window_star")
#: The pieces ``window_star`` moves a buffer in (``_two_level_window.PIECE_BYTES``).
WINDOW_PIECE_BYTES = 1 << 20

#: A rank's per-core working set per message: the message in its user buffer and in the transport's buffer
#: (socket buffer, shm segment), for the message it sends and the one it receives.
L2_COPIES = 4

class Work(NamedTuple):
    """Critical-path terms of one allreduce (see ``work``)."""

    messages: float
    link_bytes: float
    reduced: float
    copied: float
    other_reduced: float  # mean over the other ranks
    other_copied: float
    streamed: float = 0.0  # copied by an idle peer alongside the critical path: its core time hidden, not its memory traffic
    message: float = 0.0  # bytes of one message (and of one reduction's incoming contribution)


def out_of_l2(message: float, l2_bytes: float, ranks_per_core: float = 1.0) -> float:
    """The fraction of a copy or reduction of ``message`` bytes that misses a per-core cache of ``l2_bytes``.

    The core's working set is ``L2_COPIES`` times the message (times the
    ranks that time-share the core).
    """
    ws = L2_COPIES * message * max(1.0, ranks_per_core)
    return max(0.0, 1.0 - l2_bytes / ws) if ws > 0 and l2_bytes > 0 else 0.0


def halving_out_of_l2(n: int, s: float, l2_bytes: float, ranks_per_core: float, piece: float = 0.0) -> float:
    """The halving-doubling rounds' ``out_of_l2``, weighted by the bytes each copies and reduces on the critical path.

    Its messages halve from ``S/2`` to ``S/p`` and double back (the fold and
    unfold of a group that is not a power of two move ``S``). ``piece`` > 0:
    the transport's compiled rounds move and reduce a message in pieces of at
    most that many bytes, so a round's working set is the smaller of the two.
    """
    def seen(m: float) -> float:
        return min(m, piece) if piece > 0 else m

    p = 1 << (n.bit_length() - 1)
    parts = [(seen(s), 2.0 * s)] if n != p else []  # the fold: S reduced and copied once; the unfold: S copied once
    m = s
    for _ in range(p.bit_length() - 1):
        m /= 2
        parts += [(seen(m), 3.0 * m), (seen(m), 2.0 * m)]  # a reduce-scatter round (reduced, copied in and out),
        # an allgather one
    total = sum(b for _, b in parts)
    return sum(out_of_l2(m, l2_bytes, ranks_per_core) * b for m, b in parts) / total if total > 0 else 0.0


def work(algorithm: str, n: int, nbytes: float) -> Work:
    """Messages, link bytes, reduced bytes, copied bytes on the critical path; the other ranks' mean reduced/copied."""
    if n < 1:
        raise UsageError(f"world size must be >= 1, got {n}")
    if n == 1:
        return Work(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    s = float(nbytes)
    if algorithm == "ring":
        c = s / n
        return Work(2.0 * (n - 1), 2.0 * (n - 1) * c, (n - 1) * c, 4.0 * (n - 1) * c, (n - 1) * c, 4.0 * (n - 1) * c,
                    0.0, c)
    if algorithm == "star":
        return Work(2.0, 2.0 * (n - 1) * s, (n - 1) * s, (2.0 * n - 1) * s, 0.0, 2.0 * s, 2.0 * s, s)
    if algorithm == "recursive_doubling":
        p = 1 << (n.bit_length() - 1)
        rounds = p.bit_length() - 1
        if n == p:
            return Work(float(rounds), rounds * s, rounds * s, 2.0 * rounds * s, rounds * s, 2.0 * rounds * s, 0.0, s)
        r = n - p  # r ranks fold in and sit out, r fold and unfold, p - r only exchange
        other_red = ((r - 1) * (rounds + 1) * s + (p - r) * rounds * s) / (n - 1)
        other_cp = (r * 2 * s + (r - 1) * (2 * rounds + 2) * s + (p - r) * 2 * rounds * s) / (n - 1)
        return Work(rounds + 2.0, (rounds + 2) * s, (rounds + 1) * s, (2.0 * rounds + 2) * s, other_red, other_cp,
                    2.0 * s, s)
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        rounds = p.bit_length() - 1
        red, cp = (p - 1) / p * s, 4.0 * (p - 1) / p * s  # an active rank's: the ring's bytes over p ranks
        if n == p:
            return Work(2.0 * rounds, 2.0 * (p - 1) / p * s, red, cp, red, cp, 0.0, s / 2)
        r = n - p  # as recursive doubling's fold and unfold
        other_red = ((r - 1) * (s + red) + (p - r) * red) / (n - 1)
        other_cp = (r * 2 * s + (r - 1) * (2 * s + cp) + (p - r) * cp) / (n - 1)
        return Work(2.0 * rounds + 2, 2.0 * (p - 1) / p * s + 2 * s, s + red, cp + 2 * s, other_red, other_cp,
                    2.0 * s, s)
    if algorithm == "direct_one_shot":  # copy in, one sync, every rank adds all n slots into its own buffer
        return Work(1.0, 0.0, (n - 1) * s, s, (n - 1) * s, s, 0.0, s)
    if algorithm == "direct_two_shot":  # copy the others' shares in, sync, reduce a 1/n share, sync, copy all out
        c = s / n
        return Work(2.0, 0.0, (n - 1) * c, (2.0 * n - 1) * c, (n - 1) * c, (2.0 * n - 1) * c, 0.0, c)
    if algorithm == "window_star":  # every rank checks its input (the guard's pass, a read of S, priced as S
        # reduced), the members copy in, one sync, the leader adds its buffer and the L - 1 slots into its buffer
        # and copies the result out, one sync, the members copy it out. The critical path: a check, a member's
        # copy in, the leader's sum and copy out, a member's copy out (3 S). The other ranks' mean is what the
        # path leaves out, so that the node's total is the path's plus theirs (``costmodel._columns``): L - 1
        # checks, the other L - 2 members' 2 S of copies each, over L - 1 ranks; their copies in stream beside
        # the first one's. Both syncs come once per piece of WINDOW_PIECE_BYTES: where ranks share a core, each
        # hands the core over.
        rest, pieces = 2.0 * (n - 2) * s / (n - 1), max(1, math.ceil(s / WINDOW_PIECE_BYTES))
        return Work(2.0 * pieces, 0.0, n * s, 3.0 * s, s, rest, (n - 2) * s, min(s, WINDOW_PIECE_BYTES))
    registered = _REGISTERED.get(algorithm)
    if registered is not None:
        return registered(n, s)
    raise UsageError(f"unknown algorithm {algorithm!r}; the model covers "
                     f"{', '.join(ALGORITHMS + DIRECT_MODES + HOST_STEPS[1:] + tuple(_REGISTERED))}")


#: Terms of schedules that bring their own (``register_work``), by name.
_REGISTERED: dict[str, Callable[[int, float], Work]] = {}


def register_work(name: str, fn: Callable[[int, float], Work]) -> None:
    """Give the model ``fn(n, S)``, the critical-path terms of schedule ``name`` (its registry entry's)."""
    _REGISTERED[name] = fn


def terms(algorithm: str, n: int, nbytes: float) -> tuple[float, float, float]:
    """(messages, link bytes, reduced bytes) on the critical path of one allreduce."""
    w = work(algorithm, n, nbytes)
    return w.messages, w.link_bytes, w.reduced

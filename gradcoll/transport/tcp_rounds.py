"""tcp's recursive-doubling rounds in one compiled call (``_tcp_io.exchange_rounds``).

A recursive doubling over ``p`` ranks runs ``log2 p`` exchange-and-reduce
steps (``gradcoll.transport.tcp_fast``), one per round, each with the same
Python around it: the checks of the link, the transport's lock, the seqs,
the hand-over. Here that is done once for all the rounds, and one ``nogil``
call runs them back to back: round ``k`` sends the buffer to its partner and
adds the partner's frame into it, as the step does, and the next round starts
as soon as it is done. On 4 ranks at 4 KiB this took the calls' Python from
14.5 to 9.5 us of CPU time per call (docs/performance.md, "Rounds in one
call").

It takes what the step takes, below ``STAGE_MIN`` (the frames are never
staged), and declines before a byte moves where the step would decline on
any of the rounds' links. A round that stops early (a header not due, an
error, the end of a stream, the deadline, another thread's work) is handed
to the engine as the step hands its one round (``tcp_fast._adopt``), the
rounds before it done, the ones after it not started: the caller runs those.
"""

from __future__ import annotations

import array
import time
from types import ModuleType
from typing import Any

import numpy as np

from . import frame as fr
from .tcp_fast import PIECE_BYTES, STAGE_MIN, STEP_SPIN_S, _adopt, _ring

__all__ = ["exchange_rounds"]


def exchange_rounds(t: Any, io: ModuleType, peers: tuple[int, ...], acc: np.ndarray, tmp: np.ndarray, tag: int,
                    timeout: float | None, divisor: float, check: bool, found: list[tuple[int, float]],
                    at: list[int]) -> int:
    """The rounds of a recursive doubling, ``exchange_reduce`` with each of ``peers`` in turn (``acc`` sent, the
    peer's frame added into it; the last round's sum divided by ``divisor``; ``acc`` checked as the first round
    sends it when ``check``), in one compiled call (``_tcp_io.exchange_rounds``): the Python around a round
    (the checks, the locking, the seqs) is done once for all of them.

    Returns how many rounds are done, each reduced (a result that is not finite is marked, as a round marks
    it): ``len(peers)``, or fewer where a round stopped early (the engine then finished that round, as
    ``exchange_reduce`` does, and the caller runs the others), or 0 with nothing moved: the rounds are the
    caller's (it declines what ``exchange_reduce`` would decline, buffers from ``STAGE_MIN``, and an input
    that is not finite in its first piece). ``found`` as ``exchange_reduce``'s; ``at[0]`` is the round the
    engine is finishing when that raises.
    """
    n = len(peers)
    if n < 2 or acc.nbytes >= STAGE_MIN:
        return 0
    entry = t.__dict__.get("_rounds", {}).get(peers)
    if entry is None:
        entry = _rounds_of(t, peers)
        if entry is None:
            return 0
    links, fds, sseqs, rseqs = entry
    if type(tag) is not int or not 0 <= tag <= fr.MAX_TAG:
        fr.check_tag(tag)
    with t._mu:
        if t._driving or t._queued() or t._woken is not None or t.closed:
            return 0
        i = 0
        for link in links:
            if link.stash or link.failure is not None:
                return 0
            sseqs[i], rseqs[i] = link.send_seq, link.recv_seq
            i += 1
        for link in links:
            link.send_seq += 1
        t._driving, t._stepping = True, links
    limit = t._timeout(timeout)
    started = time.monotonic()
    try:
        k, out, sent, got, serr, rerr, eof, hdr, red, fin, bad = io.exchange_rounds(
            fds, t._wake_fd, acc, tmp, tag, sseqs, rseqs, max(t._spin, STEP_SPIN_S),
            -1.0 if limit is None else limit, divisor, check, check, PIECE_BYTES, _ring(t))
    except BaseException:  # refused its arrays: nothing moved
        _release_rounds(t, links, sseqs, rseqs, 0, False)
        raise
    if out == io.BAD_INPUT:
        _release_rounds(t, links, sseqs, rseqs, 0, False)
        return 0
    if bad is not None:
        found.append((bad[0], bad[1]))
    if out != io.STOPPED:
        _release_rounds(t, links, sseqs, rseqs, n, False)
        return n
    at[0] = k
    _release_rounds(t, links, sseqs, rseqs, k, True)  # round k's link: _adopt's
    ops = _adopt(t, links[k], acc, tmp, tag, sseqs[k], rseqs[k], sent, got, serr, rerr, eof, hdr)
    t._wait(ops, None if limit is None else max(0.0, limit - (time.monotonic() - started)))
    io.reduce_rest(acc, tmp, red, divisor if k == n - 1 else 1.0, fin, check)  # (not finite: marked)
    return int(k) + 1


def _rounds_of(t: Any, peers: tuple[int, ...]) -> tuple[tuple[Any, ...], array.array[int], array.array[int],
                                                        array.array[int]] | None:
    """``exchange_rounds``' links to ``peers`` (checked once), their fds and the arrays of the seqs filled per call,
    kept on the transport; None where a link is secure (its frames are not the compiled loop's)."""
    links = []
    for peer in peers:
        if type(peer) is not int or not 0 <= peer < t.size or peer == t.rank:
            t._check_peer(peer)
        link = t._links[peer]
        if link.secure is not None:
            return None
        links.append(link)
    n = len(links)
    got = (tuple(links), array.array("i", [link.fd for link in links]), array.array("Q", [0] * n),
           array.array("Q", [0] * n))
    t.__dict__.setdefault("_rounds", {})[peers] = got
    return got


def _release_rounds(t: Any, links: tuple[Any, ...], sseqs: array.array[int], rseqs: array.array[int], done: int,
                    stopped: bool) -> None:
    """The links of ``exchange_rounds`` after the call: the first ``done`` rounds moved both frames, the rest
    nothing (their send seqs given back), but for a ``stopped`` round ``done``, which ``_adopt`` takes over
    (the transport stays driven until it does)."""
    with t._mu:
        for i, link in enumerate(links):
            if i < done:
                link.recv_seq = rseqs[i] + 1
            elif not (stopped and i == done):
                link.send_seq = sseqs[i]
        if stopped:
            t._stepping = links[done]
        else:
            t._driving, t._stepping = False, None
        for i, link in enumerate(links):
            if link.sendq and not (stopped and i == done):  # queued behind the step by another thread
                t._push(link)
        if t._sleepers and not stopped:
            t._cv.notify_all()

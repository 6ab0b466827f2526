"""tcp's multi-round allreduces in one compiled call (``_tcp_io.exchange_plan``).

A recursive doubling over ``p`` ranks runs ``log2 p`` exchange-and-reduce
steps (``gradcoll.transport.tcp_fast``), a halving-doubling ``2 log2 p``
(its reduce-scatter and its allgather), each step with the same Python
around it: the checks of the link, the transport's lock, the seqs, the
hand-over. Here that is done once for all the rounds, and one ``nogil`` call
runs them back to back: round ``k`` sends one part of the buffer to its
partner and adds the partner's frame into another (or copies it there, in
an allgather round), as the step does, and the next round starts as soon as
it is done. A ring's ``2 (n - 1)`` steps run the same way, a round per
segment, each sending to one neighbour and receiving from the other
(``sources``: the round's receive link, where it is not its send link). A
link may serve several rounds (a halving-doubling's reduce-scatter and
allgather meet the same partners, a ring's neighbours every step): its
sends take consecutive seqs, and so do its receives. Running every round in
one call saves the Python between the rounds, a sizeable share of a small
call (docs/performance.md, "rounds in one call").

``Runner`` is such a call prepared once for one sequence of rounds (its
links, where each round's link and seqs go, the ring and staging buffers):
``exchange_plan`` keeps one per sequence, and the group's fast path calls
its own (``plan_runner``) with nothing else around it. Its frame around the
rounds (the links' checks and seqs under the transport's lock, the hand-back)
runs in C (``_tcp_io.PlanCall``); what ends otherwise than as planned comes
back to ``Runner.after``, here.

It takes what the step takes (the sends staged where the step stages them),
and declines before a byte moves where the step would decline on any of the
rounds' links. A round that stops early (a header not due, an error, the end
of a stream, the deadline, another thread's work) is handed to the engine as
the step hands its one round (``tcp_fast._adopt``), the rounds before it
done, the ones after it not started: the caller runs those.
"""

from __future__ import annotations

import array
import time
from types import ModuleType
from typing import Any

import numpy as np

from . import frame as fr
from . import tcp_fast as fast
from .plan import COPY, DIVIDE, FIELDS, FLAGS, RSEQ, SSEQ, TAG, A, B, C, D, make
from .tcp_fast import _adopt, _ring, _stage, staging

__all__ = ["exchange_plan", "exchange_rounds"]


class _Links:
    """The links of a sequence of rounds (their peers checked once, kept on the transport per sequence): round ``k``
    sends on ``links[k]`` and receives on ``rlinks[k]`` (the same link but in a ring's rounds)."""

    __slots__ = ("links", "rlinks", "uniq", "sends_of", "recvs_of", "soff", "roff", "secure")

    def __init__(self, t: Any, peers: tuple[int, ...], sources: tuple[int, ...]) -> None:
        self.links: list[Any] = []
        self.rlinks: list[Any] = []
        self.uniq: list[Any] = []
        self.sends_of: list[list[int]] = []  # per distinct link, the rounds that send on it, in order
        self.recvs_of: list[list[int]] = []  # and those that receive on it
        self.soff: list[int] = []  # per round, how many earlier rounds send on its send link
        self.roff: list[int] = []  # and receive on its receive link
        for k, (peer, src) in enumerate(zip(peers, sources, strict=True)):
            for p in (peer, src):
                if type(p) is not int or not 0 <= p < t.size or p == t.rank:
                    t._check_peer(p)
            for p, mine, off, links in ((peer, self.sends_of, self.soff, self.links),
                                        (src, self.recvs_of, self.roff, self.rlinks)):
                link = t._links[p]
                if link not in self.uniq:
                    self.uniq.append(link)
                    self.sends_of.append([])
                    self.recvs_of.append([])
                rounds = mine[self.uniq.index(link)]
                off.append(len(rounds))
                rounds.append(k)
                links.append(link)
        self.secure = any(link.secure is not None for link in self.uniq)  # (a link's framing is fixed)

    def release(self, t: Any, spec: array.array[int], upto: int, stopped: bool) -> None:
        """After the call: rounds before ``upto`` moved both frames, round ``upto`` was ``stopped`` (``_adopt``
        takes it over; the transport stays driven until it does) or not started, the rest not started."""
        with t._mu:
            for link, sends, recvs in zip(self.uniq, self.sends_of, self.recvs_of, strict=True):
                done = [k for k in recvs if k < upto]
                if done:
                    link.recv_seq = spec[FIELDS * done[-1] + RSEQ] + 1
                if sends:
                    link.send_seq = spec[FIELDS * sends[0] + SSEQ] + sum(1 for k in sends if k < upto) + (
                        1 if stopped and upto in sends else 0)
            if stopped:
                slink, rlink = self.links[upto], self.rlinks[upto]
                t._stepping = slink if slink is rlink else (slink, rlink)
            else:
                t._driving, t._stepping = False, None
            for link in self.uniq:
                if link.sendq and not (stopped and link is self.links[upto]):  # queued behind by another thread
                    t._push(link)
            if t._sleepers and not stopped:
                t._cv.notify_all()


class Runner:
    """``exchange_plan`` for one sequence of rounds, prepared once: its links (``_Links``), where each round's
    link and seqs go in the plan, and the transport's ring and staging buffers. A repeated allreduce of one size
    (the group's fast path) calls it with the plan and the arrays; ``exchange_plan`` keeps one per sequence."""

    __slots__ = ("t", "io", "ls", "n", "fill", "sends", "recvs", "uniq", "ring", "stage", "call")

    def __init__(self, t: Any, io: ModuleType, peers: tuple[int, ...], sources: tuple[int, ...]) -> None:
        self.t, self.io, self.n = t, io, len(peers)
        ls = self.ls = _Links(t, peers, sources)
        self.fill = tuple((FIELDS * k, ls.links[k], ls.rlinks[k], ls.soff[k], ls.roff[k]) for k in range(self.n))
        self.sends = tuple((link, len(s)) for link, s in zip(ls.uniq, ls.sends_of, strict=True) if s)
        self.recvs = tuple((link, len(r)) for link, r in zip(ls.uniq, ls.recvs_of, strict=True) if r)
        self.uniq = tuple(ls.uniq)
        self.ring = _ring(t)
        self.stage = _stage(t) if staging(io) else None
        #: The call (``_tcp_io.PlanCall``: the checks, seqs and hand-back around the rounds in C), where the links
        #: carry no secret.
        self.call: Any = None if ls.secure else io.PlanCall(self, fast)

    def __call__(self, flat: np.ndarray, tmp: np.ndarray, spec: array.array[int], timeout: float | None,
                 divisor: float, check: bool, found: list[tuple[int, float]], at: list[int]) -> int:
        """``exchange_plan``'s call (its tags already checked): ``_tcp_io.PlanCall``'s, 0 where it has none (a
        secret on a link: its frames are tagged, and the engine's step moves them)."""
        return 0 if self.call is None else int(self.call(flat, tmp, spec, timeout, divisor, check, found, at))

    def after(self, answer: tuple[Any, ...], flat: np.ndarray, tmp: np.ndarray, spec: array.array[int],
              limit: float | None, started: float, divisor: float, check: bool, found: list[tuple[int, float]],
              at: list[int]) -> int:
        """The call after ``exchange_plan`` gave ``answer`` (started at ``time.monotonic()`` ``started``): the
        links handed back, or the stopped round finished by the engine; returns the rounds done (0: declined)."""
        k, out, sent, got, serr, rerr, eof, hdr, red, fin, bad = answer
        if out == self.io.BAD_INPUT:
            self.ls.release(self.t, spec, 0, False)
            return 0
        if bad is not None:
            found.append((bad[0], bad[1]))
        if out != self.io.STOPPED:
            self.call.done()
            return self.n
        return self._stopped(k, flat, tmp, spec, sent, got, serr, rerr, eof, hdr, red, fin, limit, started, divisor,
                             check, at)

    def _stopped(self, k: int, flat: np.ndarray, tmp: np.ndarray, spec: array.array[int], sent: int, got: int,
                 serr: int, rerr: int, eof: bool, hdr: bytes | None, red: int, fin: bool, limit: float | None,
                 started: float, divisor: float, check: bool, at: list[int]) -> int:
        """Round ``k`` stopped early: the engine finishes it (``_adopt``); returns the rounds done."""
        t, ls, io = self.t, self.ls, self.io
        at[0] = k
        ls.release(t, spec, k, True)
        i = FIELDS * k
        a, b, c, d, flags = spec[i + A], spec[i + B], spec[i + C], spec[i + D], spec[i + FLAGS]
        copy = bool(flags & COPY)
        ops = _adopt(t, ls.links[k], flat[c:d], flat[a:b] if copy else tmp[: b - a], spec[i + TAG], spec[i + SSEQ],
                     spec[i + RSEQ], sent, got, serr, rerr, eof, hdr, ls.rlinks[k])
        t._wait(ops, None if limit is None else max(0.0, limit - (time.monotonic() - started)))
        if not copy:  # (not finite: marked, as the round marks it)
            io.reduce_rest(flat[a:b], tmp[: b - a], red, divisor if flags & DIVIDE else 1.0, fin, check)
        return int(k) + 1


def runner(t: Any, io: ModuleType, peers: tuple[int, ...], sources: tuple[int, ...] | None = None) -> Runner | None:
    """The transport's ``Runner`` of these rounds (kept per sequence), or None where the peers do not fit."""
    key = peers if sources is None or sources == peers else (peers, sources)
    plans = t.__dict__.setdefault("_plans", {})
    got: Runner | None = plans.get(key)
    if got is None:
        if not peers or (sources is not None and len(sources) != len(peers)):
            return None
        got = plans[key] = Runner(t, io, peers, peers if sources is None else sources)
    return got


def exchange_plan(t: Any, io: ModuleType, peers: tuple[int, ...], flat: np.ndarray, tmp: np.ndarray,
                  spec: array.array[int], timeout: float | None, divisor: float, check: bool,
                  found: list[tuple[int, float]], at: list[int], sources: tuple[int, ...] | None = None) -> int:
    """The rounds of an allreduce on ``flat`` in one compiled call: round ``k`` with ``peers[k]`` as ``spec``
    (``gradcoll.transport.plan``: its tag, bounds and flags; this fills the link and the seqs) says: send
    ``flat[c:d]`` and add the peer's frame into ``flat[a:b]``, or copy it there (``COPY``); ``DIVIDE`` divides
    the round's sum by ``divisor``. ``check``: the first round checks its arrays as ``exchange_reduce``'s
    ``check_input`` does (and a later round with ``CHECK`` the part it adds into), and every sum is checked.
    ``sources``: the peer each round receives from (None: ``peers``; a ring's left neighbour).

    Returns how many rounds are done: all of them, or fewer where a round stopped early (the engine then
    finished that round, as ``exchange_reduce`` does, and the caller runs the others), or 0 with nothing
    moved: the rounds are the caller's (it declines what ``exchange_reduce`` would decline, and an input that
    is not finite in the first round's first piece). ``found`` receives ``(index of flat, value)`` as
    ``exchange_reduce``'s; ``at[0]`` is the round the engine is finishing when that raises.
    """
    if len(spec) != FIELDS * len(peers):
        return 0
    run = runner(t, io, peers, sources)
    if run is None:
        return 0
    tags = spec[TAG::FIELDS]
    if min(tags) < 0 or max(tags) > fr.MAX_TAG:
        for tag in tags:
            fr.check_tag(tag)
    return run(flat, tmp, spec, timeout, divisor, check, found, at)


def exchange_rounds(t: Any, io: ModuleType, peers: tuple[int, ...], acc: np.ndarray, tmp: np.ndarray, tag: int,
                    timeout: float | None, divisor: float, check: bool, found: list[tuple[int, float]],
                    at: list[int]) -> int:
    """The rounds of a recursive doubling: ``exchange_plan`` with every round sending all of ``acc`` (1-D) to
    ``peers[k]`` and adding the peer's frame into it, the last round's sum divided by ``divisor``."""
    n = len(peers)
    if n < 2:
        return 0
    key = (peers, acc.size)
    specs = t.__dict__.setdefault("_rd_plans", {})
    spec = specs.get(key)
    if spec is None:
        spec = specs[key] = make((0, 0, acc.size, 0, acc.size, DIVIDE if k == n - 1 else 0) for k in range(n))
    for k in range(n):
        spec[FIELDS * k + TAG] = tag
    return exchange_plan(t, io, peers, acc, tmp, spec, timeout, divisor, check, found, at)

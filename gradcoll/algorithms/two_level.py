"""Two-level allreduce: reduce inside each host, allreduce between one leader per host, broadcast inside the host.

For a group that spans hosts with more than one rank on a host. ``hosts``
gives each rank's host (any hashable label, one per rank); the ranks of a
host, in rank order, are its *members* and the first of them its *leader*.
With ``H`` hosts, ``n`` ranks and a buffer of ``S`` bytes:

1. **Inside each host, up to the leader** (phase ``TWO_LEVEL_UP``): every
   member sends its buffer to the leader, which adds the ``L`` rows in
   member order with one fused kernel call (the star's reduction: one
   pass, every element checked). The leader receives ``(L - 1) S``.
2. **Between the leaders**: the leaders run the ring (default) or recursive
   doubling over their ``H`` ranks, through the group's own transport
   (``cross=``). ``mean`` divides by ``n`` in the last addition, as the
   flat algorithms do; step 1 then sums. Each leader sends
   ``2 (H - 1) / H S`` bytes (ring) or ``S log2 H`` (recursive doubling)
   across hosts; the other ranks wait.
3. **Inside each host, down** (phase ``TWO_LEVEL_DOWN``): the leader sends
   the result to every member (``(L - 1) S`` out of the leader).

So only the leaders use the network, ``2 (H - 1)`` message latencies
between hosts for the ring instead of the flat ring's ``2 (n - 1)``. The
result is bitwise identical on every rank: the leaders' step gives every
leader the same bits (see ring, recursive doubling), and step 3 copies
them. It runs in the guarded frame of every allreduce
(``gradcoll.algorithms._guard``) over the transport it is given, which
must reach every rank: for a group over tcp that is a
``gradcoll.transport.routed.RoutedTransport``, which takes a host's peers
through shared memory, so steps 1 and 3 never touch a socket, and the error
path still reaches every rank. Steps 1 and 3 are one pluggable pair
(``INTRA``, chosen by ``intra=``): ``"star"``, the messages above, or
``"window"``, one shared window per host (``_two_level_window``: every rank
copies its buffer into its slot, the leader adds the slots straight into its
buffer and copies the result into its own slot, the members copy it out; no
per-pair ring, and waiters sleep in the kernel). ``"auto"`` (the default)
takes the window wherever the transport routes the host through shared
memory. An overflow in a leader's step 2 is planted at element 0 before
step 3, so every member finds the marker there. See docs/algorithms/two_level.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ..errors import UsageError
from ..transport.base import Request, Transport
from ..transport.plan import set_tags
from . import _two_level_window as _win
from . import tags
from ._common import TRANSLATED, Coll, Options, Workspace, chunk_bounds, plant, scratch
from ._guard import ERRORS, LEAN_DTYPES, first_marker, guarded_allreduce
from ._planned import Plan
from .recursive_doubling import rd_pass, rd_plan
from .ring import SEGMENT_BYTES, ring_pass, ring_plan
from .rows import RowsCall, gather_into
from .star import _reduce_rows

__all__ = ["two_level_allreduce", "two_level_rows", "host_layout", "INTRA", "CROSS", "Leaders"]

#: Steps 1 and 3, by name: ``(reduce(coll, flat, opts, members), broadcast(coll, flat, members))``; the leader
#: (``members[0]``) ends step 1 with the host's sum (``opts.op``) and sends it to the members in step 3.
IntraStep = tuple[Callable[[Coll, np.ndarray, Options, list[int]], None], Callable[[Coll, np.ndarray, list[int]], None]]


def host_layout(hosts: Sequence[Hashable]) -> list[list[int]]:
    """The ranks of each host, in rank order; hosts in the order of their lowest rank."""
    by: dict[Hashable, list[int]] = {}
    for r, h in enumerate(hosts):
        by.setdefault(h, []).append(r)
    return list(by.values())


@functools.lru_cache(maxsize=64)
def _layout(hosts: tuple[Hashable, ...]) -> tuple[tuple[int, ...], ...]:
    """``host_layout`` of a call's hosts, once per layout (every call of a group has the same)."""
    return tuple(tuple(m) for m in host_layout(hosts))


def two_level_allreduce(transport: Transport, buf: np.ndarray, *, hosts: Sequence[Hashable] | None = None, op: str = "mean",
                        check_finite: bool = True, seq: int = 0, timeout: float | None = None,
                        workspace: Workspace | None = None, backend: str | None = None, cross: str = "ring",
                        segment_bytes: int = SEGMENT_BYTES, intra: str = "auto") -> np.ndarray:
    """Allreduce ``buf`` in place: inside each host of ``hosts``, between the host leaders, back; returns ``buf``.

    ``hosts`` labels each rank's host (None: every rank on one host, which makes it a star allreduce).
    ``cross``: the leaders' algorithm (``CROSS``). ``intra``: how steps 1 and 3 move the bytes (``INTRA``):
    ``"window"`` through one shared window per host, where ``transport`` routes this rank's host (as given by
    ``hosts``) through shared memory; ``"star"`` by messages; ``"auto"`` the window where it can.
    """
    if hosts is None:
        hosts = [0] * transport.size
    if len(hosts) != transport.size:
        raise UsageError(f"rank {transport.rank}: hosts names {len(hosts)} ranks, the group has {transport.size}")
    if cross not in CROSS:
        raise UsageError(f"cross must be one of {', '.join(CROSS)}; got {cross!r}")
    if intra not in INTRA and intra != "auto":
        raise UsageError(f"intra must be auto or one of {', '.join(INTRA)}; got {intra!r}")
    layout = _layout(tuple(hosts))
    members = next(list(m) for m in layout if transport.rank in m)
    windowed = _win.available(transport, members)
    if intra == "auto":
        intra = "window" if windowed else "star"
    elif intra == "window" and not windowed:
        raise UsageError(f"rank {transport.rank}: intra='window' needs a group that reaches its host's ranks through "
                         f"shared memory (a tcp group's same-host links, over the hosts given); the "
                         f"{transport.name} transport does not")
    reduce_up, broadcast_down = INTRA[intra]

    def body(coll: Coll, flat: np.ndarray, opts: Options) -> None:
        multi = len(layout) > 1
        coll.begin(3)
        coll.step = 1
        up_op = _up_op(opts.op, multi)
        try:
            reduce_up(coll, flat, opts if up_op == opts.op else dataclasses.replace(opts, op=up_op), members)
            if coll.rank == members[0] and multi:
                coll.step = 2
                leaders = Leaders(coll, [m[0] for m in layout])
                CROSS[cross](leaders, flat, opts, segment_bytes, coll.size)
                bad = first_marker(leaders, flat) if opts.check_finite and flat.size else None
                if bad is not None and math.isfinite(flat[0]):
                    plant(flat)  # where every member looks for it (``coll.marks`` stays at element 0)
            coll.step = 3
            broadcast_down(coll, flat, members)
        except Exception as exc:
            if intra == "window":
                _win.raise_alarm(coll, exc)  # the host's ranks waiting on the window wake at once
            raise

    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name="two-level allreduce", algo="two_level", body=body)


def _up_op(op: str, multi: bool) -> str:
    """Step 1's op: a mean over several hosts sums first (the leaders divide by the whole group)."""
    return "sum" if op == "mean" and multi else op


class Leaders(Coll):
    """The host leaders' view of a collective: ranks ``0 .. H-1`` of step 2, whose peers are the group's ranks.

    A schedule written for a whole group (``ring_pass``, ``rd_pass``) runs
    on it unchanged; every message goes to ``members[peer]`` on the group's
    transport, under the collective's own tags, deadline and list of
    pending receives, and errors are worded by the collective itself, in
    the group's numbering.
    """

    __slots__ = ("outer", "members")

    def __init__(self, outer: Coll, members: list[int]) -> None:  # not Coll.__init__: it shares outer's state
        self.outer, self.members = outer, members
        self.t, self.rank, self.size = outer.t, members.index(outer.rank), len(members)
        self.name, self.seq, self.nbytes, self.timeout = outer.name, outer.seq, outer.nbytes, outer.timeout
        self.deadline, self.step, self.steps = outer.deadline, 0, 0
        self.tag0, self.desc, self.status, self.pending = outer.tag0, outer.desc, outer.status, outer.pending
        self.marks: Sequence[int] = (0,)

    def begin(self, steps: int) -> None:
        """Count this step's rounds; the collective's deadline goes on."""
        self.steps, self.step = steps, 0

    def translate(self, exc: BaseException, peer: int) -> BaseException:
        return self.outer.translate(exc, peer)

    def isend(self, peer: int, buf: object, tag: int) -> Request:
        return super().isend(self.members[peer], buf, tag)

    def irecv(self, peer: int, out: object, tag: int) -> Request:
        return super().irecv(self.members[peer], out, tag)

    def wait(self, req: Request, peer: int) -> int:
        return super().wait(req, self.members[peer])

    def sendrecv(self, peer: int, sendbuf: object, recvbuf: object, tag: int) -> None:
        super().sendrecv(self.members[peer], sendbuf, recvbuf, tag)


def _cross_ring(coll: Coll, flat: np.ndarray, opts: Options, segment_bytes: int, n: int) -> None:
    """The leaders' ring. Where the transport runs a plan of rounds in one compiled call (tcp's, reached through
    ``RoutedTransport.exchange_plan``), a float32 or float64 mean or sum with the default segments runs every step
    that way (``ring_plan``), with the frames of the engine's ring, which runs what a declined or stopped call
    leaves."""
    done = 0
    if segment_bytes == SEGMENT_BYTES and isinstance(coll, Leaders) and _compiled(coll, flat, opts):
        p = _leaders_plan(coll, "ring", flat, opts, lambda: ring_plan(coll.rank, coll.size, flat.size,
                                                                         opts.op == "mean", itemsize=flat.itemsize))
        done = _cross_planned(coll, flat, opts, n, p, "ring_rounds")
        if done == len(p.plan.peers):
            return
    ring_pass(coll, flat, opts, allgather=True, shift=0, segment_bytes=segment_bytes, divisor=n, done=done)


def _cross_rd(coll: Coll, flat: np.ndarray, opts: Options, segment_bytes: int, n: int) -> None:
    """The leaders' recursive doubling: its rounds in one compiled call where the ring's would be (the engine's
    frames: the whole buffer a round), between a power-of-two number of leaders."""
    h = coll.size
    done = 0
    if h > 1 and not h & (h - 1) and isinstance(coll, Leaders) and _compiled(coll, flat, opts):
        p = _leaders_plan(coll, "rd", flat, opts, lambda: rd_plan(coll.rank, h, flat.size, opts.op == "mean"))
        done = _cross_planned(coll, flat, opts, n, p, "rd")
    if done < h.bit_length() - 1:
        rd_pass(coll, flat, opts, divisor=n, done=done)


def _compiled(coll: Coll, flat: np.ndarray, opts: Options) -> bool:
    """Whether the leaders' step can run compiled: a transport that compiles plans, a mean or sum of a contiguous
    float32 or float64 buffer, the compiled kernel."""
    return coll.t.rounds is not None and opts.op in ("mean", "sum") \
        and flat.dtype in LEAN_DTYPES and opts.backend in (None, "cython") and flat.flags.c_contiguous


#: The leaders' plans a transport keeps (sizes, dtypes, ops); more clears them.
_KEEP = 64


#: The leaders' plans, per transport (held here, not on the transport: they are the algorithm's state).
_LEADERS: weakref.WeakKeyDictionary[Transport, dict[Any, "_LeadersPlan"]] = weakref.WeakKeyDictionary()


class _LeadersPlan:
    """A leaders' plan in the group's numbering, built once per transport, shape and op (``_leaders_plan``): the
    plan, its peers and sources as group ranks, and the chunks' first elements (the markers): building the
    ring's plan every call was a sizeable share of the leaders' exchange."""

    __slots__ = ("plan", "peers", "sources", "marks")

    def __init__(self, plan: Plan, members: Sequence[int]) -> None:
        self.plan, self.peers = plan, tuple(members[x] for x in plan.peers)
        self.sources = None if plan.sources is None else tuple(members[x] for x in plan.sources)
        b = plan.bounds
        self.marks = [b[c] for c in range(len(b) - 1) if b[c + 1] > b[c]]


def _leaders_plan(coll: Leaders, kind: str, flat: np.ndarray, opts: Options, build: Callable[[], Plan]) -> _LeadersPlan:
    """``build()``'s plan for these leaders and this call's shape and op, kept on the transport (its rounds' tags
    and links are written at every call, as the group's prepared calls do)."""
    key = (kind, coll.rank, tuple(coll.members), flat.size, flat.dtype, opts.op == "mean")
    cache = _LEADERS.get(coll.t)
    if cache is None:
        cache = _LEADERS[coll.t] = {}
    got = cache.get(key)
    if got is None:
        if len(cache) >= _KEEP:
            cache.clear()
        got = cache[key] = _LeadersPlan(build(), coll.members)
    return got


def _cross_planned(coll: Leaders, flat: np.ndarray, opts: Options, n: int, lp: _LeadersPlan, tmp_name: str) -> int:
    """The leaders' rounds of ``lp`` (a mean divides by the group's size ``n``) as one compiled call: the rounds
    it did (0: declined, nothing moved)."""
    p, peers = lp.plan, lp.peers
    set_tags(p.spec, [coll.tag0 + phase for phase in p.phases])
    tmp = scratch(opts.workspace, tmp_name, max(p.tmp, 1), flat.dtype)
    coll.begin(len(peers))
    coll.marks = lp.marks
    at = [0]
    t0 = time.perf_counter()
    try:
        # (the host's sum goes in: a non-finite element of it is a marker, found on the result, not an input)
        assert coll.t.rounds is not None  # (``_compiled``)
        return int(coll.t.rounds.exchange_plan(peers, flat, tmp, p.spec, coll.deadline.remaining(), n,
                                               opts.check_finite, [], at, lp.sources))
    except ERRORS as exc:
        coll.step = at[0] + 1
        if not isinstance(exc, TRANSLATED):
            raise
        peer = getattr(exc, "peer", None)
        raise coll.translate(exc, peer if type(peer) is int else peers[min(at[0], len(peers) - 1)]) from exc
    finally:
        coll.t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")


#: Step 2 by name: ``fn(leaders, flat, opts, segment_bytes, n)``, the group's size ``n`` dividing a mean.
CROSS: dict[str, Callable[[Coll, np.ndarray, Options, int, int], None]] = {
    "ring": _cross_ring,
    "recursive_doubling": _cross_rd,
}


def star_up(coll: Coll, flat: np.ndarray, opts: Options, members: list[int]) -> None:
    """Step 1 by messages: every member sends its buffer to the leader, which adds the rows in member order."""
    if len(members) == 1:
        return
    leader, up = members[0], coll.tag0 + tags.TWO_LEVEL_UP
    if coll.rank != leader:
        coll.send(leader, flat, up)
        return
    rows = scratch(opts.workspace, "two_level", (len(members), flat.size), flat.dtype)
    reqs = [coll.irecv(p, rows[i], up) for i, p in enumerate(members[1:], 1)]
    np.copyto(rows[0], flat)
    for p, req in zip(members[1:], reqs, strict=True):
        coll.wait(req, p)
    if flat.size:
        _reduce_rows(rows, flat, opts)


def star_down(coll: Coll, flat: np.ndarray, members: list[int]) -> None:
    """Step 3 by messages: the leader sends the result to every member."""
    if len(members) == 1:
        return
    leader, down = members[0], coll.tag0 + tags.TWO_LEVEL_DOWN
    if coll.rank != leader:
        coll.recv(leader, flat, down)
        return
    sends = [coll.isend(p, flat, down) for p in members[1:]]
    for p, req in zip(members[1:], sends, strict=True):
        coll.wait(req, p)


#: Steps 1 and 3 by name (``intra=``): ``"star"`` sends messages through the transport's same-host links,
#: ``"window"`` goes through one shared window per host (``gradcoll.algorithms._two_level_window``); ``"auto"`` (the
#: default) takes the window wherever the transport routes the host through shared memory.
INTRA: dict[str, IntraStep] = {"star": (star_up, star_down), "window": (_win.window_up, _win.window_down)}


def two_level_rows(coll: Coll, call: RowsCall) -> None:
    """The two-level allreduce's rows form (``gradcoll.algorithms.rows``) over ``call.hosts``.

    1. Every member sends its row to its host's leader (``RAW_UP``).
    2. Between the ``H`` leaders, a direct reduce-scatter of the hosts' rows:
       leader ``h`` owns chunk ``h`` of ``H``, receives every other host's
       rows of it, reduces all ``n`` rows (``RAW_RS``), and sends the result
       to every other leader (``RAW_AG``).
    3. Each leader sends the result to its members (``RAW_DOWN``).
    Only leaders use the links between hosts: ``(n - L) S / H`` in and out
    of a leader of ``L`` ranks.
    """
    data, n = call.data, coll.size
    layout = _layout(tuple(call.hosts if call.hosts is not None else [0] * n))
    members = next(m for m in layout if coll.rank in m)
    leaders = [m[0] for m in layout]
    h, nh = leaders.index(members[0]), len(layout)
    cb = chunk_bounds(data.size, nh)
    up, down, rs, ag = (coll.tag0 + ph for ph in (tags.RAW_UP, tags.RAW_DOWN, tags.RAW_RS, tags.RAW_AG))
    coll.marks = [cb[c] for c in range(nh) if cb[c + 1] > cb[c]]
    coll.begin(4)
    coll.step = 1
    if coll.rank != members[0]:
        got = coll.irecv(members[0], data, down)  # the leader replies only after it has read ``up`` whole
        coll.send(members[0], data, up)
        coll.step = 4
        coll.wait(got, members[0])
        return
    mine = call.scratch("two_level", (len(members), data.size))
    reqs = [coll.irecv(p, mine[i], up) for i, p in enumerate(members[1:], 1)]
    mine[0] = data
    for p, req in zip(members[1:], reqs, strict=True):
        coll.wait(req, p)
    coll.step = 2
    a, b = cb[h], cb[h + 1]
    others = [j for j in range(nh) if j != h]
    blocks = {j: np.empty((len(layout[j]), b - a), data.dtype) for j in others}
    recvs = [(coll.irecv(leaders[j], blocks[j].reshape(-1), rs), j) for j in others]
    outs = [np.ascontiguousarray(mine[:, cb[j]: cb[j + 1]]) for j in others]
    sends = [(coll.isend(leaders[j], out.reshape(-1), rs), leaders[j]) for j, out in zip(others, outs, strict=True)]
    rows = call.scratch("two_level_rows", (n, b - a))
    gather_into(rows, members, mine[:, a:b])
    for req, j in recvs:
        coll.wait(req, leaders[j])
        gather_into(rows, layout[j], blocks[j])
    call.rows.reduce(rows, data[a:b])
    coll.step = 3
    shared = [(coll.isend(leaders[j], data[a:b], ag), leaders[j]) for j in others]
    gets = [(coll.irecv(leaders[j], data[cb[j]: cb[j + 1]], ag), leaders[j]) for j in others]
    for req, peer in sends + gets + shared:
        coll.wait(req, peer)
    coll.step = 4
    for req, peer in [(coll.isend(p, data, down), p) for p in members[1:]]:
        coll.wait(req, peer)

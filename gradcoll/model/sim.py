"""Simulated network: virtual clocks instead of bytes, for running the real algorithm code on many ranks.

``SimWorld`` holds ``n`` simulated ranks, each a ``SimTransport`` (one thread
per rank drives it), under an ``AlphaBeta`` model; ``SimKernels`` is a rank's
kernel backend (``backend=`` of the algorithms, ``gradcoll.kernels.protocol``).
``gradcoll.algorithms.simulate.simulate`` runs an allreduce on them.

* **Real**: whatever the caller does with the transport: which rank sends
  which message to whom, in which order, with which tags and lengths, and the
  waits. Tags and lengths are checked as by every transport (a mismatch raises
  [`CollectiveMismatch`][gradcoll.errors.CollectiveMismatch]).
* **Not moved**: payloads. ``isend`` records only (tag, length, virtual
  arrival time); ``irecv`` leaves the receive buffer untouched.
* **Not computed**: reductions. ``SimKernels`` advances its rank's clock by
  ``gamma`` times the bytes of incoming contribution (``x`` of an
  accumulate, all rows but one of a reduce) instead of adding; a reduce also
  charges ``delta`` for one row: its only caller, the star's root, first
  copies its own input into row 0.
* **Virtual size**: every length is multiplied by ``scale`` (virtual bytes
  per real byte) when the clocks advance, so a small real buffer stands for a
  large one.

Clock rules (per rank: ``clock``, ``egress_free``, ``ingress_free``; each
touched only by its own rank's thread, so a run is deterministic):

* ``isend`` of ``b`` virtual bytes: the copy in costs the sender's CPU
  first, ``clock += delta b``; then ``start = max(clock, egress_free)``,
  ``egress_free = start + beta b``; the message arrives at
  ``start + alpha + beta b``; waiting for the send sets
  ``clock = max(clock, start + beta b)``.
* waiting for a receive, in the receiver's program order (``w``: the
  receiver's clock when it waits): ``done = max(arrival, ingress_free + beta b)``,
  ``ingress_free = done``, ``clock = max(w + delta b, done + delta b - overlap)``
  (a rank's ingress takes one message at a time; the copy out runs on the
  receiver's CPU). ``overlap`` is the part of the sender's copy in
  (``[c0, c0 + delta b]``) during which the receiver was already waiting,
  ``max(0, min(delta_core b, c0 + delta b - max(w, c0)))``, where
  ``delta_core`` is ``delta`` without the node's cache term (two cores
  streaming the same message still share the memory) but with the per-core
  one (each core's own cache misses run on that core): the transports stream a
  message (shm publishes every 256 KiB, TCP moves segments), so an idle
  receiver copies out behind the sender's copy in. A receiver that was
  copying its own message in meanwhile (the ring, recursive doubling) gets
  no overlap; an idle one (the star's root and non-roots, the fold and
  unfold of recursive doubling) overlaps the whole message.
* CPU per byte (``gamma``, ``delta``) includes the cache terms: ``mem`` on the
  fraction ``max(0, 1 - cache_bytes / S)`` of the buffer that does not fit,
  and ``l2`` on the fraction ``max(0, 1 - l2_bytes / (4 m))`` of a copy or
  reduction of one message of ``m`` bytes that does not fit in the core's
  own cache (``gradcoll.costmodel.out_of_l2``; ``m`` is the message the
  operation copies, or the incoming contribution it reduces).

Under these rules the times of an allreduce equal the closed forms of
``gradcoll.costmodel.predict`` with ``node=None`` (the ring run with one
segment per chunk, the default of ``simulate``), when ``beta`` or ``delta`` is zero:
with both, the closed form adds the star root's link time and copy time,
while here its copy out of one message overlaps the next one's arrival.
**Hosts** (``SimWorld(..., hosts=, local=)``): with a host label per rank
and a ``local`` model, a message between two ranks of one host moves under
``local`` (its alpha, beta and copy cost, through the rank's own local
egress and ingress), any other under the world's model (through the rank's
network egress and ingress). A rank's network port is its own: a host's
ranks do not queue for one NIC, which is exact for the ring with ranks
placed host by host (one rank per host sends across at a time) and for the
two-level allreduce (only the leaders do). Reductions cost the world's
``gamma`` wherever the bytes came from.

What the simulation leaves out: ranks sharing a node's cores (``Node``:
``switch_s``, the node's CPU shared by its cores, ``wait_share`` of the
waiting ranks, and the per-core cache shared by the ranks on a core). Every simulated rank
has a core of its own, because time-sharing is the host scheduler's doing,
not the algorithm's: the message schedule, which is what the simulation
checks, is the same. A few dozen threads are cheap; for 128-1,024 ranks use
the closed form, which tests/model/test_costmodel.py checks against this
simulation.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CollectiveMismatch, UsageError
from ..transport.base import Request, Transport, as_bytes_view, as_writable_view
from .costmodel import AlphaBeta, out_of_l2

__all__ = ["SimTransport", "SimWorld", "SimKernels"]


class _Msg:
    __slots__ = ("seq", "tag", "length", "arrival", "vbytes", "copy_start", "link")

    def __init__(self, seq: int, tag: int, length: int, arrival: float, vbytes: float, copy_start: float,
                 link: _Link) -> None:
        self.seq, self.tag, self.length, self.arrival, self.vbytes = seq, tag, length, arrival, vbytes
        self.copy_start = copy_start  # when the sender began copying it in
        self.link = link  # the medium it moved through


class _Link:
    """One medium's clock constants: latency, seconds per link byte, per copied byte (with the cache terms)."""

    __slots__ = ("alpha", "beta", "delta", "delta_core", "local")

    def __init__(self, model: AlphaBeta, out_of_cache: float, local: bool) -> None:
        self.alpha, self.beta, self.local = model.alpha_s, model.beta_s_per_byte, local
        self.delta = model.delta_s_per_byte + model.mem_s_per_byte * out_of_cache
        self.delta_core = model.delta_s_per_byte


class _Pair:
    __slots__ = ("cond", "messages", "send_seq", "recv_seq")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: collections.deque[_Msg] = collections.deque()
        self.send_seq = 0
        self.recv_seq = 0


class SimWorld:
    """Shared state of ``size`` simulated ranks: FIFOs of message headers per ordered pair."""

    def __init__(self, size: int, model: AlphaBeta, scale: float = 1.0, out_of_cache: float = 0.0, *,
                 hosts: Sequence[object] | None = None, local: AlphaBeta | None = None) -> None:
        if size < 1:
            raise UsageError(f"world size must be >= 1, got {size}")
        if hosts is not None and len(hosts) != size:
            raise UsageError(f"hosts names {len(hosts)} ranks, the world has {size}")
        self.size = size
        self.model = model
        self.scale = scale
        #: CPU seconds per reduced and per copied byte, the node's cache term included (the per-core one, which
        #: depends on the message, is added per operation: ``l2``).
        self.gamma = model.gamma_s_per_byte + model.mem_s_per_byte * out_of_cache
        self.delta = model.delta_s_per_byte + model.mem_s_per_byte * out_of_cache
        #: The part of a copy's cost a streaming receiver can hide (its core's, not the memory's).
        self.delta_core = model.delta_s_per_byte
        self.pairs: dict[tuple[int, int], _Pair] = {}
        self._lock = threading.Lock()
        self.hosts = list(hosts) if hosts is not None else None
        self.net = _Link(model, out_of_cache, False)
        self.local = _Link(local or model, out_of_cache, True)

    def link(self, src: int, dst: int) -> _Link:
        """The medium between ``src`` and ``dst``: the local one inside a host, else the network."""
        if self.hosts is not None and self.hosts[src] == self.hosts[dst]:
            return self.local
        return self.net

    def l2(self, vbytes: float) -> float:
        """Extra CPU seconds per byte of a copy or reduction of one ``vbytes`` message: the per-core cache term."""
        return self.model.l2_s_per_byte * out_of_l2(vbytes, self.model.l2_bytes)

    def pair(self, src: int, dst: int) -> _Pair:
        """The FIFO src -> dst (created on first use: n^2 pairs are not allocated up front)."""
        with self._lock:
            p = self.pairs.get((src, dst))
            if p is None:
                p = self.pairs[(src, dst)] = _Pair()
            return p


class _SendReq(Request):
    __slots__ = ("_t", "_done", "_n")

    def __init__(self, t: "SimTransport", done: float, n: int) -> None:
        self._t, self._done, self._n = t, done, n

    def wait(self, timeout: float | None = None) -> int:
        self._t.clock = max(self._t.clock, self._done)
        return self._n

    def test(self) -> bool:
        return True


class _RecvReq(Request):
    __slots__ = ("_t", "_peer", "_pair", "_length", "_tag", "_result")

    def __init__(self, t: "SimTransport", peer: int, pair: _Pair, length: int, tag: int) -> None:
        self._t, self._peer, self._pair, self._length, self._tag = t, peer, pair, length, tag
        self._result: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self._result is not None:
            return self._result
        t = self._t
        limit = t._timeout(timeout)
        with self._pair.cond:
            if not self._pair.cond.wait_for(lambda: bool(self._pair.messages), limit):
                raise t._timeout_error("recv", self._peer, limit, self._length)
            msg = self._pair.messages.popleft()
            expect = self._pair.recv_seq
            self._pair.recv_seq += 1
        if msg.tag != self._tag or msg.length != self._length or msg.seq != expect:
            raise CollectiveMismatch(
                f"rank {t.rank}: recv from peer {self._peer} expected seq {expect} tag {self._tag} "
                f"({self._length} bytes), but peer {self._peer} sent seq {msg.seq} tag {msg.tag} "
                f"({msg.length} bytes) (sim transport)"
            )
        link = msg.link
        free = t.local_ingress_free if link.local else t.ingress_free
        done = max(msg.arrival, free + link.beta * msg.vbytes)
        if link.local:
            t.local_ingress_free = done
        else:
            t.ingress_free = done
        l2 = t.world.l2(msg.vbytes)
        copy = (link.delta + l2) * msg.vbytes
        core = (link.delta_core + l2) * msg.vbytes
        overlap = max(0.0, min(core, msg.copy_start + copy - max(t.clock, msg.copy_start)))  # streamed behind the sender
        t.clock = max(t.clock + copy, done + copy - overlap)
        self._result = msg.length
        return msg.length

    def test(self) -> bool:
        return self._result is not None or bool(self._pair.messages)


class SimTransport(Transport):
    """One rank of a ``SimWorld``: moves headers, advances virtual clocks."""

    name = "sim"
    #: Allreduces carry their descriptor in the tags (no handshake round, which would need payloads).
    lenient_tags = True

    def __init__(self, world: SimWorld, rank: int, timeout: float = 60.0) -> None:
        super().__init__(rank, world.size, timeout)
        self.world = world
        self.clock = 0.0
        self.egress_free = 0.0
        self.ingress_free = 0.0
        self.local_egress_free = 0.0  # the same for messages inside the host (``SimWorld(hosts=...)``)
        self.local_ingress_free = 0.0
        #: This rank's kernel backend: pass it as ``backend=`` so that reductions cost virtual time.
        self.kernels = SimKernels(self)

    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Record a message of ``len(buf)`` bytes for ``peer``; the payload is not copied."""
        self._check_peer(peer)
        length = len(as_bytes_view(buf))
        vbytes = length * self.world.scale
        link = self.world.link(self.rank, peer)
        copy_start = self.clock
        self.clock += (link.delta + self.world.l2(vbytes)) * vbytes  # the copy in
        start = max(self.clock, self.local_egress_free if link.local else self.egress_free)
        free = start + link.beta * vbytes
        if link.local:
            self.local_egress_free = free
        else:
            self.egress_free = free
        pair = self.world.pair(self.rank, peer)
        with pair.cond:
            seq = pair.send_seq
            pair.send_seq += 1
            pair.messages.append(_Msg(seq, tag, length, start + link.alpha + link.beta * vbytes, vbytes,
                                      copy_start, link))
            pair.cond.notify_all()
        return _SendReq(self, free, length)

    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Post a receive of ``len(out)`` bytes; ``out`` is never written."""
        self._check_peer(peer)
        length = len(as_writable_view(out))
        return _RecvReq(self, peer, self.world.pair(peer, self.rank), length, tag)

    def charge_reduce(self, nbytes: float, copied: float = 0.0, operand: float | None = None) -> None:
        """Advance this rank's clock by the reduction of ``nbytes`` and the copy of ``copied`` real bytes (scaled).

        ``operand`` (real bytes, default ``nbytes``) is one incoming contribution: the message size the per-core
        cache term goes by.
        """
        sc = self.world.scale
        l2 = self.world.l2((nbytes if operand is None else operand) * sc)
        self.clock += ((self.world.gamma + l2) * nbytes + (self.world.delta + l2) * copied) * sc

    def close(self) -> None:
        """Nothing to release."""
        self.closed = True


class SimKernels:
    """The kernel backend of one simulated rank (``gradcoll.kernels.protocol.ReduceKernels``): reductions cost
    the rank virtual time instead of computing.

    The payloads never move, so there is nothing to add and nothing to check:
    ``reduce_rows`` and ``accumulate`` charge the rank's clock (module
    docstring) and report a finite result; ``is_all_finite`` and ``scale``
    cost nothing, as nothing in the model charges them.
    """

    name = "sim"

    def __init__(self, transport: SimTransport) -> None:
        self.transport = transport

    def __repr__(self) -> str:
        return f"SimKernels(rank {self.transport.rank})"

    def reduce_rows(self, rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype[Any],
                    divisor: float, check: bool) -> bool:
        """Charge the reduction of all rows but the first and the copy of the first (the star root's own input)."""
        total = rows.nbytes if isinstance(rows, np.ndarray) else sum(r.nbytes for r in rows)
        row = rows[0].nbytes if len(rows) else 0
        self.transport.charge_reduce(total - row, copied=row, operand=row)
        return True

    def accumulate(self, acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None,
                   check: bool) -> bool:
        """Charge the reduction of the incoming ``x``."""
        self.transport.charge_reduce(x.nbytes)
        return True

    def is_all_finite(self, buf: np.ndarray) -> bool:
        """Nothing moved, so nothing is non-finite."""
        return True

    def scale(self, buf: np.ndarray, factor: float) -> None:
        """Free in the model."""

"""A transport that sends to the ranks of this host over one transport and to every other rank over another.

The two-level allreduce (``gradcoll.algorithms.two_level``) runs on a group
spanning hosts: its steps inside a host should go through shared memory, the
step between hosts through the network. ``RoutedTransport`` is one
[`Transport`][gradcoll.transport.base.Transport] in the group's numbering that
routes each peer: the peers of this host through ``local`` (a transport over
this host's ranks only, numbered ``0 .. len(members) - 1`` in the order of
``members``), the others through ``net`` (the group's own transport, which
connects every rank). So an algorithm written against the interface, and the
collectives' error path, which sends its records to every peer, work
unchanged: a rank waiting on a same-host peer is woken through shared memory,
one waiting on another host through the network.

Errors of ``local`` name the peer in its own numbering; they are raised here
again with the group's (``peer``, ``missing``, the stray frame's ``peer``)
and the message says which link it was. ``blocked_s`` is the sum of both.
Closing closes ``local`` only: ``net`` belongs to the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import CollectiveMismatch, CollectiveTimeout, GradcollError, TransportError, UsageError
from .base import Request, Transport
from .frame import FrameMismatch
from .plan import DECLINED, PlanRunner, Rounds

__all__ = ["RoutedTransport"]


class _Routed(Request):
    """A request of ``local``, whose errors are raised again in the group's numbering."""

    __slots__ = ("_req", "_t", "_peer")

    def __init__(self, req: Request, t: "RoutedTransport", peer: int) -> None:
        self._req, self._t, self._peer = req, t, peer

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._req.wait(timeout)
        except GradcollError as exc:
            raise self._t._renumbered(exc, self._peer) from exc

    def test(self) -> bool:
        return self._req.test()

    def cancel(self) -> bool:
        return self._req.cancel()


class RoutedTransport(Transport, Rounds):
    """``net`` for other hosts, ``local`` (over ``members``, the group ranks of this host) for this one."""

    def __init__(self, net: Transport, local: Transport, members: Sequence[int]) -> None:
        super().__init__(net.rank, net.size, net.timeout)
        members = list(members)
        if len(members) != local.size or members[local.rank] != net.rank:
            raise UsageError(f"rank {net.rank}: host members {members} do not match the local transport "
                             f"(rank {local.rank} of {local.size})")
        self.net, self.local, self.members = net, local, members
        self.name = f"{net.name}+{local.name}"
        self.lenient_tags = net.lenient_tags and local.lenient_tags
        self._index = {p: i for i, p in enumerate(members)}
        self.rounds = self if net.rounds is not None else None  # the leaders' plans, where every peer is remote

    @property
    def blocked_s(self) -> float:
        return self.net.blocked_s + self.local.blocked_s

    @blocked_s.setter
    def blocked_s(self, value: float) -> None:  # the base class's default; the sub-transports keep the counts
        pass

    def note_wait(self, seconds: float) -> None:
        self.net.note_wait(seconds)

    def _renumbered(self, exc: GradcollError, peer: int) -> GradcollError:
        """``exc`` of the local transport (about ``peer``, in the group's numbering, unless it names its own)."""
        own = getattr(exc, "peer", None)
        if isinstance(own, int) and 0 <= own < len(self.members):
            peer = self.members[own]
        where = f"rank {self.rank}: on this host's {self.local.name} link to rank {peer}: {exc}"
        if isinstance(exc, FrameMismatch):
            return FrameMismatch(where, peer=peer, tag=exc.tag, payload=exc.payload)
        if isinstance(exc, CollectiveTimeout):
            return CollectiveTimeout(where, rank=self.rank, missing=[self.members[m] for m in exc.missing
                                                                     if 0 <= m < len(self.members)] or [peer],
                                     op=exc.op, seq=exc.seq, nbytes=exc.nbytes)
        if isinstance(exc, TransportError):
            return type(exc)(where, rank=self.rank, peer=peer)
        if isinstance(exc, CollectiveMismatch):
            return type(exc)(where)
        return exc

    def _route(self, peer: int) -> int | None:
        """``peer``'s rank in ``local``, or None when it is on another host."""
        if not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            self._check_peer(peer)
        return self._index.get(peer)

    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``peer`` over the link that reaches it."""
        q = self._route(peer)
        if q is None:
            return self.net.isend(peer, buf, tag)
        try:
            return _Routed(self.local.isend(q, buf, tag), self, peer)
        except GradcollError as exc:
            raise self._renumbered(exc, peer) from exc

    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Start receiving from ``peer`` over the link that reaches it."""
        q = self._route(peer)
        if q is None:
            return self.net.irecv(peer, out, tag)
        try:
            return _Routed(self.local.irecv(q, out, tag), self, peer)
        except GradcollError as exc:
            raise self._renumbered(exc, peer) from exc

    def sendrecv(self, dst: int, sendbuf: Any, src: int, recvbuf: Any, tag: int = 0,
                 timeout: float | None = None) -> int:
        """Full duplex; one transport's own fast path when both peers are reached through it."""
        qd, qs = self._route(dst), self._route(src)
        if qd is None and qs is None:
            return self.net.sendrecv(dst, sendbuf, src, recvbuf, tag, timeout)
        if qd is not None and qs is not None:
            try:
                return self.local.sendrecv(qd, sendbuf, qs, recvbuf, tag, timeout)
            except GradcollError as exc:
                raise self._renumbered(exc, src) from exc
        return super().sendrecv(dst, sendbuf, src, recvbuf, tag, timeout)

    def exchange_plan(self, peers: tuple[int, ...], *args: Any) -> int:
        """``net``'s rounds in one compiled call (``Rounds.exchange_plan``: the two-level allreduce's ring of
        host leaders) where every peer sent to and received from is on another host; else 0, nothing moved."""
        net = self.net.rounds
        sources = args[8] if len(args) > 8 and args[8] is not None else ()
        if net is None or any(self._route(p) is not None for p in (*peers, *sources)):
            return 0
        return int(net.exchange_plan(peers, *args))

    def exchange_reduce(self, *args: Any, **kw: Any) -> int:
        return DECLINED  # (the routed group's steps take the general path)

    def exchange_rounds(self, *args: Any) -> int:
        return 0

    def plan_runner(self, peers: tuple[int, ...], sources: tuple[int, ...] | None = None) -> PlanRunner | None:
        return None

    @property
    def closed(self) -> bool:
        return bool(self.net.closed or self.local.closed)

    @closed.setter
    def closed(self, value: bool) -> None:  # set by the base class's __init__; the sub-transports keep it
        pass

    def close(self) -> None:
        """Close ``local`` (``net`` is the group's, closed with it)."""
        self.local.close()

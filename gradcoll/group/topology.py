"""Where a group's ranks run, and the groups inside it: host layout, ``split``, the two-level allreduce's links.

**Host layout.** Every rank of a group built by
[`init_process_group`][gradcoll.group.rendezvous.init_process_group] learns the
host of every other at startup: its own is ``GRADCOLL_HOST`` when set (so
tests and containers can say which ranks share a machine), else
``socket.gethostname()``. ``group.hosts`` is the host of each rank,
``group.host_ranks`` the ranks on this rank's host; ``group.stats()`` and
the trace carry the layout. A group built directly on a transport knows it
when given ``hosts=``, for ``inproc`` and ``shm`` (one host by
construction) without, and otherwise learns it (one allgather) at its first
two-level allreduce.

**Subgroups.** [`split(ranks)`][gradcoll.group.topology.Topology.split]
(or [`new_group(group, ranks)`][gradcoll.group.topology.new_group]) is
called by every rank of the group with the same ``ranks`` and returns, on
those ranks, a [`ProcessGroup`][gradcoll.group.ProcessGroup] over them
(numbered in the order given) with its own transport: its own
connections, sequence numbers, poisoning, stall warnings and, when the
parent can shrink, ``shrink()``. The transport is bootstrapped through the
parent (``gradcoll.group.subgroup``: its keys travel by allgather), so no
store is needed. A failure in one group never touches the other's links,
and the two may be used at once from different threads. On the other
ranks it returns a [`NonMember`][gradcoll.group.topology.NonMember], whose
every collective raises UsageError.

**Two-level links.** The two-level allreduce over a tcp group reaches the
ranks of its own host through shared memory: the first call builds one shm
transport per host the same way (a split of the group by host, so every
rank builds it at the same call) and routes through it
(``gradcoll.transport.routed``). When shm cannot be built (another
architecture), every rank stays on tcp and a warning says so.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import socket
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn, Protocol, TypeVar, cast

import numpy as np

from ..algorithms import select_allreduce
from ..algorithms.two_level import host_layout
from ..errors import GradcollError, UsageError
from ..observe.control import open_control
from ..observe.diagnosis import ControlChannel
from ..store import PrefixStore
from ..transport.base import Transport
from ..transport.routed import RoutedTransport
from .subgroup import ExchangeStore, exchange

__all__ = ["HOST_VAR", "local_host", "machine_id", "Topology", "NonMember", "new_group"]

log = logging.getLogger("gradcoll")

#: The variable that names this rank's host (default ``socket.gethostname()``).
HOST_VAR = "GRADCOLL_HOST"
#: Bytes of a host name when the ranks learn each other's by an allgather (longer names are cut).
_NAME_BYTES = 256
#: Transports whose ranks share one host by construction.
ONE_HOST = ("inproc", "shm", "sim")

G = TypeVar("G", bound="Topology")


class _Membership(Protocol):
    """What a subgroup takes over from its parent's membership (``process_group.Membership``)."""

    @property
    def control(self) -> ControlChannel | None: ...

    def adopt(self, control: ControlChannel) -> Any: ...


def local_host() -> str:
    """This rank's host: ``GRADCOLL_HOST`` when set, else the host name."""
    return os.environ.get(HOST_VAR, "").strip() or socket.gethostname()


def machine_id() -> str:
    """This machine, whose cores its ranks share whatever hosts ``GRADCOLL_HOST`` names: the kernel's boot id
    where Linux gives one (containers on one machine share it), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


class NonMember:
    """What ``split`` returns on a rank outside the subgroup: every collective raises UsageError.

    ``ranks`` are the subgroup's members (parent ranks), ``parent_rank`` this
    rank's number in the parent; ``rank`` is -1. ``close()`` does nothing.
    """

    rank = -1

    def __init__(self, parent_rank: int, ranks: Sequence[int]) -> None:
        self.parent_rank, self.ranks = parent_rank, tuple(ranks)
        self.size = len(self.ranks)

    def _refuse(self, what: str) -> NoReturn:
        raise UsageError(f"rank {self.parent_rank} of the parent group is not a member of this subgroup (members: "
                         f"parent ranks {list(self.ranks)}); only its members may call {what}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse(name)

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> NonMember:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"<NonMember parent_rank={self.parent_rank} of subgroup {list(self.ranks)}>"


def _check_parts(parts: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    out, seen = [], set()
    for part in parts:
        ranks = [int(r) for r in part]
        if not ranks:
            raise UsageError("a subgroup needs at least one rank")
        bad = [r for r in ranks if not 0 <= r < size]
        twice = {r for r in ranks if r in seen or ranks.count(r) > 1}
        if bad or twice:
            raise UsageError(f"subgroup ranks {ranks}: " + (f"{bad} out of range for a group of {size}" if bad
                                                            else f"{sorted(twice)} listed twice"))
        seen.update(ranks)
        out.append(ranks)
    return out


class Topology:
    """The host layout and subgroups of a [`ProcessGroup`][gradcoll.group.ProcessGroup] (see the module doc)."""

    rank: int
    size: int
    transport: Transport
    timeout: float
    hosts: tuple[str, ...] | None
    """The host of every rank (None when unknown: a tcp or mpi group built directly on a transport)."""
    _routed: Transport | None
    #: How many ranks of the group this one descends from share this rank's machine (None: unknown); the shm
    #: links of its subgroups and of the two-level allreduce count them against the cores (``shm.create``'s
    #: ``crowd``).
    _crowd: int | None

    def _init_hosts(self, hosts: Sequence[str] | None) -> None:
        if hosts is None and self.transport.name in ONE_HOST:
            hosts = [local_host()] * self.size
        if hosts is not None and len(hosts) != self.size:
            raise UsageError(f"hosts names {len(hosts)} ranks, the group has {self.size}")
        self.hosts = None if hosts is None else tuple(str(h) for h in hosts)
        self._routed = None
        self._crowd = None

    @property
    def host(self) -> str:
        """This rank's host."""
        return self.hosts[self.rank] if self.hosts is not None else local_host()

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host, this one included (only this one when the layout is unknown)."""
        if self.hosts is None:
            return (self.rank,)
        return tuple(r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank])

    def host_layout(self) -> list[list[int]]:
        """The ranks of each host, in rank order, hosts in the order of their lowest rank ([] when unknown)."""
        return [] if self.hosts is None else host_layout(self.hosts)

    @functools.cached_property
    def host_counts(self) -> tuple[int, ...] | None:
        """Ranks per host, in the order of ``host_layout`` (None when unknown); what ``algorithm="auto"`` reads."""
        return None if self.hosts is None else tuple(len(m) for m in host_layout(self.hosts))

    # -- subgroups -----------------------------------------------------------
    def split(self: G, ranks: Sequence[int], *, backend: str | None = None,
              timeout: float | None = None) -> G | NonMember:
        """A group of its own over ``ranks`` (numbered in that order) on those ranks; a NonMember elsewhere.

        Every rank of this group must call it, with the same ``ranks`` (else
        UsageError on every rank). ``backend`` defaults to this group's
        (``"shm"`` makes sense for ranks of one host). ``timeout`` (default
        the group's, at most 60 s) bounds the bootstrap; the new group's
        collectives use this group's timeout.
        """
        return self._split([list(ranks)], backend, timeout)

    def split_by_host(self: G, *, backend: str | None = None, timeout: float | None = None) -> G:
        """The group of the ranks on this rank's host (every rank calls it; each gets its own host's)."""
        layout = self.host_layout()
        if not layout:
            raise UsageError(f"rank {self.rank}: the host layout of this group is unknown (pass hosts=)")
        return cast(G, self._split(layout, backend, timeout))

    def _split(self: G, parts: list[list[int]], backend: str | None, timeout: float | None) -> G | NonMember:
        parts = _check_parts(parts, self.size)
        mine = next((p for p in parts if self.rank in p), None)
        parent = self._parent_membership()
        ctl = parent.control if parent is not None else None
        built = self._build(parts, backend or self.transport.name, timeout, with_control=ctl is not None)
        if mine is None or built is None:
            return NonMember(self.rank, parts[0])
        transport, control = built
        membership = parent.adopt(control) if parent is not None and control else None
        sub = cast(Any, type(self))(
            transport, timeout=self.timeout, segment_bytes=getattr(self, "segment_bytes", None),
            kernel_backend=getattr(self, "kernel_backend", None), membership=membership,
            stall_warning_s=self._diag_stall(), hosts=None if self.hosts is None else [self.hosts[r] for r in mine])
        sub._crowd = self._crowd  # (the other subgroups' ranks share the machine too)
        return cast(G, sub)

    def _parent_membership(self) -> _Membership | None:
        return cast("_Membership | None", getattr(self, "_membership", None))

    def _diag_stall(self) -> float | None:
        diag = getattr(self, "_diag", None)
        return None if diag is None else cast(float | None, diag.stall_s)

    def _build(self, parts: list[list[int]], backend: str, timeout: float | None, with_control: bool,
               quiet: bool = False) -> tuple[Transport, ControlChannel | None] | None:
        """This rank's transport (and control channel) of its part of ``parts``, bootstrapped through this group.

        Every rank calls it; None on a rank in no part. A failure on any rank raises GradcollError on every one
        (``quiet``: returns None on every one).
        """
        if backend == "mpi" or self.transport.name == "mpi":
            raise UsageError(f"rank {self.rank}: subgroups of an mpi group are not supported yet: split the "
                             "communicator with MPI and build the group on it (gradcoll.transport.mpi.create(comm=))")
        limit = min(self.timeout, 60.0) if timeout is None else float(timeout)
        parent = self._parent_membership()
        ctl = parent.control if parent is not None else None
        options = dict(ctl.options) if ctl is not None and ctl.backend == backend else {}
        if backend == "shm" and self._crowd:
            options["crowd"] = max(self._crowd, int(options.get("crowd") or 0))
        host = ctl.host if ctl is not None else "127.0.0.1"
        k = next((i for i, p in enumerate(parts) if self.rank in p), None)

        def build(store: ExchangeStore) -> tuple[Transport, ControlChannel | None]:
            assert k is not None
            members = parts[k]
            me, n, ns = members.index(self.rank), len(members), PrefixStore(f"split{k}", store)
            module = importlib.import_module(f"gradcoll.transport.{backend}")
            transport = cast(Transport, module.create(ns, me, n, timeout=limit, **options))
            transport.timeout = self.timeout
            try:
                control = open_control(ns, me, n, timeout=limit, host=host, backend=backend,
                                       options=options) if with_control else None
            except BaseException:
                transport.close()
                raise
            return transport, control

        value, errors = exchange(cast(Any, self), build if k is not None else None, repr((parts, backend)), limit, _close_built)
        if errors and not quiet:
            raise GradcollError(f"rank {self.rank}: building the subgroup failed on rank(s) {sorted(errors)}: "
                                f"rank {min(errors)}: {errors[min(errors)]}")
        return cast("tuple[Transport, ControlChannel | None] | None", value)

    # -- the two-level allreduce's links -----------------------------------------
    def _two_level(self, nbytes: int, segment_bytes: int) -> tuple[Transport, dict[str, Any]]:
        """The transport the two-level allreduce runs on (built at its first call) and its arguments.

        Between the host leaders it runs what ``auto`` would run on that many ranks: the ring for its ring or
        halving-doubling, recursive doubling for its recursive doubling or star.
        """
        if self.hosts is None:
            self._learn_hosts()
        if self._routed is None:
            self._routed = self._routes()
        leaders = len(self.host_counts or ())
        cross = select_allreduce(nbytes, leaders, self.transport.name) if leaders > 1 else "ring"
        # (halving-doubling, auto's bandwidth-optimal choice, is the ring's bytes; the star, recursive doubling's)
        return self._routed, {"hosts": cast(Sequence[Hashable], self.hosts), "segment_bytes": segment_bytes,
                              "cross": {"halving_doubling": "ring", "star": "recursive_doubling"}.get(cross, cross)}

    def _learn_hosts(self) -> None:
        """Every rank's host, by an allgather (a group built directly on a tcp or mpi transport did not learn it)."""
        name = local_host().encode()[:_NAME_BYTES]
        mine = np.zeros(_NAME_BYTES, np.uint8)
        mine[: len(name)] = np.frombuffer(name, np.uint8)
        rows = cast(Any, self).allgather(mine)
        self.hosts = tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows)
        self.__dict__.pop("host_counts", None)  # computed (None) before the hosts were known
        rec = getattr(getattr(self, "_diag", None), "rec", None)
        if rec is not None:
            rec.hosts = self.hosts

    def _routes(self) -> Transport:
        layout = host_layout(self.hosts or ())
        shared = [m for m in layout if len(m) > 1]
        if self.transport.name != "tcp" or not shared:
            return self.transport  # one medium already reaches every rank the best way it can
        built = self._build(shared, "shm", None, with_control=False, quiet=True)
        if built is None:
            if self.rank in sum(shared, []):
                log.warning("rank %d: no shared-memory links between the ranks of a host; the two-level allreduce "
                            "stays on tcp inside hosts", self.rank)
            return self.transport
        return RoutedTransport(self.transport, built[0], list(self.host_ranks))

    def _close_topology(self) -> None:
        if self._routed is not None and self._routed is not self.transport:
            self._routed.close()


def _close_built(value: Any) -> None:
    transport, control = value
    transport.close()
    if control is not None:
        control.close()


def new_group(group: G, ranks: Sequence[int], *, backend: str | None = None,
              timeout: float | None = None) -> G | NonMember:
    """``group.split(ranks, ...)``: the subgroup over ``ranks`` (see [`Topology.split`][gradcoll.group.topology.Topology.split])."""
    return group.split(ranks, backend=backend, timeout=timeout)

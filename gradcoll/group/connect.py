"""Build a ProcessGroup from a bootstrap store: the transport, the control channel, and the group's membership.

[`init_process_group`][gradcoll.group.rendezvous.init_process_group] calls
[`connect`][gradcoll.group.connect.connect] once the ranks have met in the
store; [`ProcessGroup.shrink`][gradcoll.group.ProcessGroup.shrink] calls it
again, through the [`Regroup`][gradcoll.group.connect.Regroup] membership
every group built here carries, with the survivors and the store the
shrink's leader hosts. The agreement itself is `gradcoll.group.shrink`'s.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Any

from ..errors import BackendUnavailable, UsageError
from ..observe.control import open_control
from ..observe.diagnosis import SHRINKING, ControlChannel
from ..store import PrefixStore, Store
from .process_group import ProcessGroup
from .shrink import agree, check_shrinkable
from .topology import local_host, machine_id

__all__ = ["connect", "load_backend", "Regroup"]


def load_backend(backend: str) -> ModuleType:
    """The module ``gradcoll.transport.<backend>``, checked to have a ``create`` factory."""
    if not isinstance(backend, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", backend):
        raise UsageError(f"backend must be a transport name such as 'tcp', 'shm', 'mpi', 'inproc'; got {backend!r}")
    name = f"gradcoll.transport.{backend}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise BackendUnavailable(f"transport backend {backend!r} is not available: no module {name}") from exc
        raise BackendUnavailable(f"transport backend {backend!r} needs {exc.name!r}, which is not installed") from exc
    if not callable(getattr(module, "create", None)):
        raise BackendUnavailable(f"{name} has no create(store, rank, size, ...) factory")
    return module


def connect(ns: Store, backend: str, rank: int, size: int, *, timeout: float, group_timeout: float,
            kernel_backend: str | None, transport_options: dict[str, Any], group_options: dict[str, Any],
            control_host: str | None = None, generation: int = 0) -> ProcessGroup:
    """Connect the transport and the control channel through ``ns`` and return the group.

    ``timeout`` bounds the connection; ``group_timeout`` every later
    collective. ``group_options`` go to the ProcessGroup (and, but for
    ``trace``, to the group a shrink builds); ``generation`` counts the
    shrinks that led here (it keeps the control datagrams of the groups apart).
    """
    module = load_backend(backend)
    transport = module.create(ns, rank, size, timeout=timeout, **transport_options)
    transport.timeout = group_timeout  # startup is bounded by ``timeout``; collectives by the group's
    try:
        host = control_host or str(transport_options.get("host") or "127.0.0.1")
        control = open_control(ns, rank, size, timeout=timeout, host=host, backend=backend,
                               options=transport_options, generation=generation)
        try:
            hosts, machines = _meet(ns, rank, size, timeout)
        except BaseException:
            control.close()
            raise
    except BaseException:
        transport.close()
        raise
    kept = {k: v for k, v in group_options.items() if k != "trace"}
    group = ProcessGroup(transport, timeout=group_timeout, kernel_backend=kernel_backend,
                         membership=Regroup(control, kept), hosts=hosts, **group_options)
    group._crowd = machines.count(machines[rank])
    return group


def _meet(store: Store, rank: int, size: int, timeout: float) -> tuple[list[str], list[str]]:
    """Wait until every rank has its transport (the store is not needed after this); every rank's host and
    machine (``topology.machine_id``: ``GRADCOLL_HOST`` may name several hosts on one machine)."""
    store.set(f"ready/{rank}", f"{local_host()}\0{machine_id()}".encode())
    got = [store.get(f"ready/{r}", timeout).decode(errors="replace").split("\0", 1) for r in range(size)]
    return [g[0] for g in got], [g[-1] for g in got]


class Regroup:
    """The membership of a group built by [`connect`][gradcoll.group.connect.connect]: its control channel,
    and the settings the group a shrink builds keeps (``stall_warning_s``, ``stats_window``).

    It owns the control channel: the group closes it through
    [`close`][gradcoll.group.connect.Regroup.close], and
    [`shrink`][gradcoll.group.connect.Regroup.shrink] takes it over to agree
    with the survivors after closing the group.
    """

    def __init__(self, control: ControlChannel, group_options: dict[str, Any]) -> None:
        self._control: ControlChannel | None = control
        self._options = dict(group_options)

    @property
    def control(self) -> ControlChannel | None:
        """The control channel (None once a shrink has taken it)."""
        return self._control

    def shrink(self, group: ProcessGroup, timeout: float) -> ProcessGroup:
        """Close ``group``, agree with the survivors over the control channel, connect their new group.

        The new group has the old one's backend, transport options, kernel
        backend, timeout, segment size, stall warning and stats window.
        """
        ctl = self._control
        if ctl is None:
            raise UsageError(f"rank {group.rank}: this group has already been shrunk (its control channel is taken)")
        check_shrinkable(ctl)
        seq = group.seq
        self._control = None  # taken: closing the group leaves it open for the agreement
        group.close()  # peers still waiting on this rank fail now instead of at their timeout
        ctl.state_fn = lambda: (SHRINKING, seq, "shrink", 0, 0.0)
        store: Store | None = None
        try:
            new_rank, size, store = agree(ctl, timeout)
            gen = ctl.generation + 1
            return connect(PrefixStore(f"gradcoll/shrink{gen}", store), ctl.backend, new_rank, size, timeout=timeout,
                           group_timeout=group.timeout, kernel_backend=group.kernel_backend,
                           transport_options=ctl.options, control_host=ctl.host, generation=gen,
                           group_options={**self._options, "segment_bytes": group.segment_bytes})
        finally:
            if store is not None:
                store.close()
            ctl.close()

    def adopt(self, control: ControlChannel) -> Regroup:
        """The membership of a subgroup of this group, whose control channel is ``control``."""
        return Regroup(control, self._options)

    def close(self) -> None:
        """Close the control channel unless a shrink has taken it. Idempotent."""
        if self._control is not None:
            self._control.close()

"""Node configuration and connection: ``NodeConfig``, ``PeerSource``, ``Topology``, ``NodeGroup``.

How gradcoll wires the two topologies (a deliberate departure from the
original, where star meant "workers link only to rank 0" and so ring
collectives failed beyond two ranks):

* Both topologies connect the same full TCP mesh (gradcoll's ``tcp``
  transport); the topology is a *traffic pattern* carried by the returned
  ``NodeGroup``. In ``star`` the node helpers run their allreduce with
  the star algorithm and relay pipeline activations through rank 0; in
  ``mesh`` they use the ring and send activations straight to the next
  rank. Every collective of the group therefore works at any world size in
  both, and a closed link raises (``TransportClosed``/``TransportBroken``)
  instead of hanging.
* Rendezvous goes through gradcoll's TCP store on one known address (no
  broadcast or multicast): the coordinator's address for ``peers``, or the
  address given to ``PeerSource.discover``. Each rank listens on the
  host of its own address (or the interface that routes to the store) on
  an ephemeral port and publishes it in the store; the port in the address
  of ranks 1.. is therefore not used (the tcp transport picks its own).
* The group's shared secret (``NodeConfig.secret``, else ``GRADCOLL_SECRET``,
  the same secret and variable as ``init_process_group`` and the sync
  service) goes to the rendezvous store, whoever hosts it, and to the tcp
  links: a node without it, or with another one, never takes a seat.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import _auth
from ..errors import UsageError
from ..group.process_group import ProcessGroup
from ..group.rendezvous import init_process_group
from ..store import PrefixStore, Store, TCPStore
from ..transport.base import Transport
from .caps import NodeCaps, NodeRole
from .fixed_function import FixedFunction

__all__ = ["Topology", "PeerSource", "NodeConfig", "NodeGroup", "topology_of", "connect_local", "parse_addr"]


class Topology(enum.Enum):
    """Wire topology: how node traffic flows (both connect a full mesh; see the module doc)."""

    MESH = "mesh"
    STAR = "star"

    @classmethod
    def parse(cls, value: "Topology | str") -> "Topology":
        """A Topology from itself or its name ("mesh", "star")."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise UsageError(f"topology must be 'mesh' or 'star', got {value!r}") from None


class NodeGroup(ProcessGroup):
    """The ProcessGroup ``NodeConfig.connect`` returns; it also knows its ``topology``."""

    def __init__(self, transport: Transport, *, topology: Topology = Topology.MESH, **options: Any) -> None:
        super().__init__(transport, **options)
        self.topology = Topology.parse(topology)

    @classmethod
    def adopt(cls, group: ProcessGroup, topology: Topology) -> "NodeGroup":
        """Take over the transport of a fresh, unused ``group``."""
        return cls(group.transport, topology=topology, timeout=group.timeout, segment_bytes=group.segment_bytes,
                   kernel_backend=group.kernel_backend)

    def __repr__(self) -> str:
        return "<NodeGroup" + super().__repr__()[len("<ProcessGroup"):-1] + f" {self.topology.value}>"


def topology_of(group: ProcessGroup) -> Topology:
    """The topology of ``group`` (a plain ProcessGroup counts as a mesh)."""
    return getattr(group, "topology", Topology.MESH)


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    if not isinstance(addr, str):
        raise UsageError(f"an address is a 'host:port' string, got {addr!r}")
    host, sep, port = addr.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"address {addr!r} must look like host:port (port 1..65535)")
    return host, int(port)


def _route_host(host: str, port: int) -> str:
    """The local address that routes to ``host`` (a UDP connect sends nothing)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise UsageError(f"cannot tell which local address reaches {host}:{port} ({exc}); "
                         "pass host= to PeerSource.discover") from exc


@dataclass(frozen=True)
class PeerSource:
    """How a node finds its peers: ``static`` addresses or ``discover`` through a rendezvous store."""

    kind: str
    addrs: tuple[str, ...] = ()
    host: str | None = None  # discover: the address this node listens on (None: the route to the store)
    external: bool = False  # discover: the store already runs there; rank 0 does not host it
    job: str = "default"  # discover: key prefix, so jobs can share one rendezvous store

    def __post_init__(self) -> None:
        object.__setattr__(self, "addrs", tuple(self.addrs))
        if self.kind not in ("static", "discover") or not self.addrs:
            raise UsageError(f"a peer source is PeerSource.static(addrs) or PeerSource.discover(addr), got {self!r}")
        for a in self.addrs:
            parse_addr(a)

    @classmethod
    def static(cls, addrs: Sequence[str]) -> "PeerSource":
        """Fixed addresses: one per rank (mesh) or just the coordinator's (star)."""
        if isinstance(addrs, str):
            addrs = [addrs]
        return cls("static", tuple(addrs))

    @classmethod
    def discover(cls, store: str, *, host: str | None = None, external: bool = False,
                 job: str = "default") -> "PeerSource":
        """Meet through the rendezvous store at ``store`` (hosted by rank 0 unless ``external``)."""
        return cls("discover", (store,), host=host, external=external, job=job)

    def coordinator(self) -> tuple[str, int]:
        """Address of the rendezvous store (rank 0's address)."""
        return parse_addr(self.addrs[0])

    def listen_host(self, rank: int) -> str:
        """The host this rank's transport listens on."""
        if self.kind == "static" and len(self.addrs) > 1:
            return parse_addr(self.addrs[rank])[0]
        return self.host or _route_host(*self.coordinator())


@dataclass(frozen=True)
class NodeConfig:
    """Programmatic node configuration; builders return a new config (``NodeConfig(1, 4).star()``)."""

    rank: int
    world: int
    peer_source: PeerSource | None = None
    wire_topology: Topology = Topology.MESH
    device_directive: str = "auto"
    node_role: NodeRole = NodeRole()
    #: The shared secret set by ``secret()`` (None: ``GRADCOLL_SECRET`` at ``connect``, if set); never printed.
    shared_secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("rank", "world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise UsageError(f"{name} must be an int, got {v!r}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise UsageError(f"rank {self.rank} out of range for world {self.world}")

    # -- builders ----------------------------------------------------------
    def peers(self, addrs: Sequence[str]) -> "NodeConfig":
        """Static peers: ``world`` addresses (any topology, mesh by default) or exactly one, the coordinator's (star)."""
        addrs = [addrs] if isinstance(addrs, str) else list(addrs)
        if len(addrs) not in (1, self.world):
            raise UsageError(f"peers: got {len(addrs)} addresses for a world of {self.world}; "
                             f"pass {self.world} (mesh) or exactly 1 (the coordinator, star)")
        # One address can only be a star; a full list keeps the topology chosen so far
        # (``.star().peers(addrs)`` stays a star, as in the original).
        topo = Topology.STAR if len(addrs) == 1 and self.world > 1 else self.wire_topology
        return replace(self, peer_source=PeerSource.static(addrs), wire_topology=topo)

    def discover(self, store: str, *, host: str | None = None, external: bool = False,
                 job: str = "default") -> "NodeConfig":
        """Find peers through the rendezvous store at ``store`` (see ``PeerSource.discover``)."""
        return replace(self, peer_source=PeerSource.discover(store, host=host, external=external, job=job))

    def star(self) -> "NodeConfig":
        """Route node traffic through rank 0."""
        return replace(self, wire_topology=Topology.STAR)

    def mesh(self) -> "NodeConfig":
        """Route node traffic rank to rank."""
        return replace(self, wire_topology=Topology.MESH)

    def topology(self, topology: Topology | str) -> "NodeConfig":
        """Set the topology by value or name."""
        return replace(self, wire_topology=Topology.parse(topology))

    def device(self, directive: str) -> "NodeConfig":
        """Device directive ("auto", "cpu", "cuda", ...), resolved later by node_device."""
        if not isinstance(directive, str):
            raise UsageError(f"device must be a string, got {directive!r}")
        return replace(self, device_directive=directive)

    def role(self, role: NodeRole) -> "NodeConfig":
        """Set the node's role."""
        if not isinstance(role, NodeRole):
            raise UsageError(f"role must be a NodeRole, got {role!r}")
        return replace(self, node_role=role)

    def fixed_function(self, ff: FixedFunction) -> "NodeConfig":
        """Make this a fixed-function node implementing ``ff``."""
        return self.role(NodeRole.fixed_function(ff))

    def secret(self, secret: bytes | str | None) -> "NodeConfig":
        """The group's shared secret (bytes or str); None: ``GRADCOLL_SECRET`` when ``connect`` runs, if set.

        Every node of the group needs the same one: the rendezvous store
        and every tcp link prove it both ways (``init_process_group``'s
        ``secret``), and a node without it is refused.
        """
        return replace(self, shared_secret=None if secret is None else _auth.resolve(secret))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "NodeConfig":
        """Read RANK, WORLD, PEERS (comma-separated), TOPOLOGY, DEVICE and GRADCOLL_SECRET."""
        env = os.environ if env is None else env
        nums = {}
        for name in ("RANK", "WORLD"):
            raw = env.get(name, "").strip()
            if not raw.lstrip("-").isdigit():
                raise UsageError(f"environment variable {name} must be an integer, got {raw!r}")
            nums[name] = int(raw)
        cfg = cls(nums["RANK"], nums["WORLD"])
        peers = [p for p in env.get("PEERS", "").split(",") if p.strip()]
        if peers:
            cfg = cfg.peers(peers)
        if env.get("TOPOLOGY", "").strip():
            cfg = cfg.topology(env["TOPOLOGY"])
        if env.get("DEVICE", "").strip():
            cfg = cfg.device(env["DEVICE"].strip())
        if env.get(_auth.ENV):
            cfg = cfg.secret(env[_auth.ENV])
        return cfg

    # -- using it ----------------------------------------------------------
    def caps(self) -> NodeCaps:
        """This node's capabilities (its device directive resolved now)."""
        return NodeCaps.here(self.rank, self.node_role, self.device_directive)

    def connect(self, timeout: float = 60.0, *, kernel_backend: str | None = None,
                store: Store | None = None) -> NodeGroup:
        """Meet the other ranks and return the connected group (``timeout`` also bounds every wait).

        ``store`` replaces the rendezvous store (the caller owns it; for
        threads in one process a HashStore will do). The secret (``secret()``,
        else ``GRADCOLL_SECRET``) goes to the store this node opens or hosts
        and to the group's links: a store or a peer that cannot prove it
        raises ProtocolError; a store with a secret refuses this node if it
        has none (GradcollError "requires the group's secret").
        """
        src = self.peer_source
        if src is None and store is None:
            raise UsageError("no peers configured: call .peers(addrs) or .discover(addr) first")
        host = "127.0.0.1" if src is None else src.listen_host(self.rank)
        owned: Store | None = None
        key = _auth.resolve(self.shared_secret)
        if store is None and src is not None and src.kind == "discover" and src.external:
            store = owned = TCPStore(*src.coordinator(), is_master=False, timeout=timeout, secret=key)
        if store is not None and src is not None and src.kind == "discover":
            store = PrefixStore(f"gradcoll-node/{src.job}", store)
        init = ""
        if store is None:
            h, p = src.coordinator()  # type: ignore[union-attr]
            init = f"tcp://[{h}]:{p}" if ":" in h else f"tcp://{h}:{p}"
        try:
            pg = init_process_group("tcp", init or "env://", self.rank, self.world, timeout, store=store,
                                    kernel_backend=kernel_backend, secret=key, host=host)
        finally:
            if owned is not None:
                owned.close()
        return NodeGroup.adopt(pg, self.wire_topology)


def connect_local(world: int, *, topology: Topology | str = Topology.MESH, timeout: float = 30.0,
                  kernel_backend: str | None = None, secret: bytes | str | None = None) -> list[NodeGroup]:
    """Connect ``world`` ranks in this process (one thread each) over TCP on 127.0.0.1.

    For tests, demos and dev machines: a rendezvous TCPStore on an ephemeral
    port stands in for the coordinator's address. ``secret`` as for
    ``NodeConfig.secret`` (default ``GRADCOLL_SECRET``).
    """
    key = _auth.resolve(secret)
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, secret=key)
    addr = f"127.0.0.1:{master.port}"
    groups: list[NodeGroup | None] = [None] * world
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        cfg = NodeConfig(rank, world).discover(addr, host="127.0.0.1", external=True).topology(topology).secret(key)
        try:
            groups[rank] = cfg.connect(timeout, kernel_backend=kernel_backend)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    master.close()
    if errors or any(g is None for g in groups):
        for g in groups:
            if g is not None:
                g.close()
        if errors:
            raise errors[0]
        raise UsageError(f"connect_local: ranks did not connect within {timeout}s")
    return groups  # type: ignore[return-value]

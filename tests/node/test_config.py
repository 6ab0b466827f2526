"""NodeConfig builders, from_env, peer sources, and connecting over TCP on 127.0.0.1."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from gradcoll.errors import UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.node import FixedFunction, NodeConfig, NodeGroup, NodeRole, PeerSource, Topology, connect_local, topology_of
from gradcoll.node.config import parse_addr
from gradcoll.store import TCPStore
from gradcoll.testing import run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_defaults_and_builders_return_new_configs() -> None:
    cfg = NodeConfig(1, 4)
    assert (cfg.wire_topology, cfg.device_directive, cfg.node_role, cfg.peer_source) == \
        (Topology.MESH, "auto", NodeRole.worker(), None)
    ff = FixedFunction("x3", 4, 4)
    built = cfg.star().device("cpu").fixed_function(ff)
    assert built.wire_topology is Topology.STAR and built.device_directive == "cpu"
    assert built.node_role == NodeRole.fixed_function(ff) and cfg.node_role == NodeRole.worker()
    assert built.mesh().wire_topology is Topology.MESH and built.topology("star").wire_topology is Topology.STAR
    assert cfg.role(NodeRole.worker()) == cfg


def test_peers_takes_world_addresses_or_exactly_one() -> None:
    addrs = [f"10.0.0.{i}:2950{i}" for i in range(4)]
    mesh = NodeConfig(2, 4).peers(addrs)
    assert mesh.wire_topology is Topology.MESH and mesh.peer_source == PeerSource.static(addrs)
    assert mesh.peer_source.listen_host(2) == "10.0.0.2" and mesh.peer_source.coordinator() == ("10.0.0.0", 29500)
    star = NodeConfig(2, 4).peers(["10.0.0.1:29500"])
    assert star.wire_topology is Topology.STAR
    with pytest.raises(ValueError, match="got 3 addresses for a world of 4"):
        NodeConfig(0, 4).peers(addrs[:3])
    with pytest.raises(ValueError, match="got 0 addresses for a world of 4"):
        NodeConfig(0, 4).peers([])
    assert NodeConfig(0, 1).peers(["127.0.0.1:1"]).wire_topology is Topology.MESH


@pytest.mark.parametrize("bad", [(4, 4), (-1, 2), (0, 0), (True, 2)])
def test_rank_and_world_are_checked(bad: tuple) -> None:
    with pytest.raises(UsageError):
        NodeConfig(*bad)


def test_from_env_reads_rank_world_peers_topology_device() -> None:
    env = {"RANK": "1", "WORLD": "3", "PEERS": "a:1,b:2,c:3", "TOPOLOGY": "star", "DEVICE": "cpu"}
    cfg = NodeConfig.from_env(env)
    assert (cfg.rank, cfg.world, cfg.wire_topology, cfg.device_directive) == (1, 3, Topology.STAR, "cpu")
    assert cfg.peer_source.addrs == ("a:1", "b:2", "c:3")
    assert NodeConfig.from_env({"RANK": "0", "WORLD": "3", "PEERS": "h:9"}).wire_topology is Topology.STAR
    with pytest.raises(UsageError, match="WORLD"):
        NodeConfig.from_env({"RANK": "0"})
    with pytest.raises(UsageError, match="topology must be"):
        NodeConfig.from_env({"RANK": "0", "WORLD": "1", "TOPOLOGY": "ring"})


@pytest.mark.parametrize("addr, want", [("h:1", ("h", 1)), ("[::1]:80", ("::1", 80)), (" 1.2.3.4:65535", ("1.2.3.4", 65535))])
def test_parse_addr(addr: str, want: tuple) -> None:
    assert parse_addr(addr) == want


@pytest.mark.parametrize("addr", ["h", "h:", ":80", "h:0", "h:65536", "h:x"])
def test_parse_addr_refuses(addr: str) -> None:
    with pytest.raises(UsageError, match="host:port"):
        parse_addr(addr)


def test_connect_without_peers_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no peers"):
        NodeConfig(0, 2).connect(timeout=1)


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_connect_through_rank0_hosted_store(topology: str) -> None:
    addrs = [f"127.0.0.1:{_free_port()}"] + ["127.0.0.1:1"] * 2  # ranks 1.. listen on ephemeral ports
    cfgs = [NodeConfig(r, 3).peers(addrs if topology == "mesh" else addrs[:1]) for r in range(3)]
    groups = run_ranks([lambda c: c.connect(timeout=10, kernel_backend="numpy")] * 3, cfgs, timeout=20)
    try:
        assert all(isinstance(g, ProcessGroup) and isinstance(g, NodeGroup) for g in groups)
        assert [topology_of(g) for g in groups] == [Topology(topology)] * 3
        out = run_ranks([lambda g: g.allreduce(np.full(3, g.rank + 1.0), op="sum", algorithm="ring")] * 3, groups)
        assert all((o == 6).all() for o in out)
    finally:
        for g in groups:
            g.close()


def test_two_jobs_discover_through_one_external_store() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    addr = f"127.0.0.1:{master.port}"
    try:
        cfgs = [NodeConfig(r, 2).discover(addr, external=True, job=job) for job in ("a", "b") for r in range(2)]
        groups = run_ranks([lambda c: c.connect(timeout=10)] * 4, cfgs, timeout=20)
        # job a's ranks add 1 + 1, job b's 10 + 10: a rank that joined the other job would mix them
        args = list(zip(groups, [1.0, 1.0, 10.0, 10.0], strict=True))
        sums = run_ranks([lambda gv: gv[0].allreduce(np.full(1, gv[1]), op="sum")[0]] * 4, args, timeout=20)
        assert sums == [2.0, 2.0, 20.0, 20.0]
        for g in groups:
            g.close()
    finally:
        master.close()


def test_plain_process_groups_count_as_mesh() -> None:
    groups = connect_local(1)
    assert topology_of(groups[0]) is Topology.MESH and "NodeGroup" in repr(groups[0])
    groups[0].close()

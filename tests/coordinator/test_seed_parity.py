"""API parity with entrenar's GradientServer and WorkerClient: names, argument order, types and units.

Written from entrenar's documented API (method signatures, result structs,
configuration defaults), not from gradcoll's behaviour; entrenar's own
end-to-end tests live in test_cluster.py. Where gradcoll departs on purpose,
the test pins the departure that docs/coordinator.md states.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import pytest

from gradcoll.coordinator import (
    AllReduceResult,
    AveragedBlockResult,
    AveragedNonBlockResult,
    AveragedResult,
    BlockAllReduceResult,
    DistributedConfig,
    GradientServer,
    NonBlockAllReduceResult,
    ShardAssignment,
    WorkerClient,
)
from gradcoll.errors import GradcollError
from tests.helpers import field_names, positional_params

from .test_cluster import Workers, server_config


def test_server_methods_and_argument_order() -> None:
    expected = {
        "bind": ["config"], "wait_for_workers": [], "set_total_samples": ["n"],
        "send_shard_assignments": ["step"], "collect_and_reduce": ["step"],
        "broadcast_averaged": ["step", "result"], "shutdown_workers": [], "worker_count": [],
        "collect_and_reduce_block": ["step", "block_idx"], "broadcast_averaged_block": ["step", "result"],
        "collect_and_reduce_non_block": ["step", "expected_component"],
        "broadcast_averaged_non_block": ["step", "result"], "local_addr": [],
    }
    for name, params in expected.items():
        assert positional_params(getattr(GradientServer, name)) == params, name


def test_worker_methods_and_argument_order() -> None:
    expected = {
        "connect": ["config", "gpu_count", "backend"], "receive_shard": [],
        "send_gradients": ["step", "gradients", "loss", "correct", "total"], "receive_averaged": [],
        "send_block_gradient": ["step", "block_idx", "num_blocks", "gradients", "component_sizes"],
        "receive_averaged_block": [], "send_non_block_gradient": ["step", "component", "gradients"],
        "receive_averaged_non_block": [], "worker_id": [], "total_workers": [],
    }
    for name, params in expected.items():
        assert positional_params(getattr(WorkerClient, name)) == params, name


def test_result_struct_fields_in_entrenars_order() -> None:
    assert field_names(AllReduceResult) == ["avg_gradients", "global_loss", "total_correct", "total_samples",
                                        "allreduce_ms"]
    assert field_names(BlockAllReduceResult) == ["block_idx", "avg_gradients", "component_sizes", "allreduce_ms"]
    assert field_names(NonBlockAllReduceResult) == ["component", "avg_gradients", "allreduce_ms"]
    assert field_names(AveragedResult) == ["step", "gradients", "global_loss"]
    assert field_names(AveragedBlockResult) == ["step", "block_idx", "gradients", "component_sizes"]
    assert field_names(AveragedNonBlockResult) == ["step", "component", "gradients"]
    assert [n for n, _ in ShardAssignment.FIELDS] == ["step", "shard_start", "shard_end"]


def test_config_defaults_are_entrenars_in_milliseconds() -> None:
    cfg = DistributedConfig.coordinator("127.0.0.1:0", 2)
    assert (cfg.heartbeat_interval_ms, cfg.heartbeat_timeout_ms) == (5000, 30000)
    assert cfg.node_id == f"{socket.gethostname()}-{os.getpid()}"
    assert str(cfg.role.value) == "coordinator" and cfg.expect_workers == 2
    assert DistributedConfig.worker("127.0.0.1:9000").coordinator_addr == "127.0.0.1:9000"
    with pytest.raises(GradcollError, match="coordinator_addr"):
        DistributedConfig("worker")


def test_one_step_of_every_kind_has_entrenars_types() -> None:
    sizes = [2, 1, 1, 2, 2, 2, 2, 1, 1]

    def worker(c: WorkerClient) -> dict[str, Any]:
        out: dict[str, Any] = {"id": c.worker_id(), "total": c.total_workers()}
        out["shard"] = c.receive_shard()
        c.send_gradients(0, [1.0 + c.worker_id(), 2.0], 0.5, 3, 4)  # step, gradients, loss, correct, total
        out["avg"] = c.receive_averaged()
        c.send_block_gradient(0, 1, 2, np.full(sum(sizes), 1.0 + 2 * c.worker_id()), sizes)
        out["block"] = c.receive_averaged_block()
        c.send_non_block_gradient(0, 2, [4.0, 4.0])
        out["non_block"] = c.receive_averaged_non_block()
        out["end"] = c.receive_shard()
        return out

    with GradientServer.bind(server_config(2)) as srv:
        addr = srv.local_addr()  # documented departure: a (host, port) tuple, which every address argument takes
        assert isinstance(addr, tuple) and addr[1] > 0
        ws = Workers(addr, worker, 2)
        srv.wait_for_workers()
        assert srv.worker_count() == 2 and type(srv.worker_count()) is int
        srv.set_total_samples(8)
        srv.send_shard_assignments(0)
        res = srv.collect_and_reduce(0)
        srv.broadcast_averaged(0, res)
        block = srv.collect_and_reduce_block(0, 1)
        srv.broadcast_averaged_block(0, block)
        nb = srv.collect_and_reduce_non_block(0, 2)
        srv.broadcast_averaged_non_block(0, nb)
        srv.shutdown_workers()
        out = ws.values()

    assert res.avg_gradients.tolist() == [1.5, 2.0] and res.avg_gradients.dtype == np.float32
    assert (res.total_correct, res.total_samples) == (6, 8)
    assert type(res.total_correct) is int and type(res.total_samples) is int
    assert type(res.global_loss) is float and res.global_loss == 0.5
    assert type(res.allreduce_ms) is float and res.allreduce_ms > 0  # milliseconds
    assert block.block_idx == 1 and block.avg_gradients.tolist() == [2.0] * sum(sizes)
    # Documented departure: component sizes are a tuple, vectors are float32 NumPy arrays.
    assert block.component_sizes == tuple(sizes) and list(block.component_sizes) == sizes
    assert (nb.component, nb.avg_gradients.tolist()) == (2, [4.0, 4.0])
    for wid, got in out.items():
        assert (got["id"], got["total"]) == (wid, 2) and type(got["id"]) is int
        assert got["shard"] == ShardAssignment(0, 4 * wid, 4 * wid + 4)
        assert (got["avg"].step, got["avg"].gradients.tolist(), got["avg"].global_loss) == (0, [1.5, 2.0], 0.5)
        assert (got["block"].step, got["block"].block_idx, list(got["block"].component_sizes)) == (0, 1, sizes)
        assert (got["non_block"].step, got["non_block"].component) == (0, 2)
        assert got["end"] is None  # Shutdown

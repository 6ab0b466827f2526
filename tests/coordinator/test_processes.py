"""Real worker processes (multiprocessing, spawn): a full training step, and a worker killed mid-step."""

from __future__ import annotations

import multiprocessing
import queue
from typing import Any

import numpy as np
import pytest

from gradcoll.coordinator import DistributedConfig, GradientServer
from gradcoll.errors import TransportBroken

SPAWN_S = 60.0  # a fresh interpreter imports numpy and gradcoll; generous on a loaded 2-core machine
NB, SIZES = 3, [2, 1]


def _worker(addr: tuple[str, int], role: str, results: Any) -> None:
    from gradcoll.coordinator import DistributedConfig, WorkerClient

    try:
        with WorkerClient.connect(DistributedConfig.worker(addr, timeout_s=30), 1, "cpu") as c:
            results.put(("joined", c.worker_id(), role))
            if role == "victim":
                c.receive_shard()
                c.receive_shard()  # no second shard comes before the test kills this process
                return
            w, got = c.worker_id() + 1.0, []
            while (shard := c.receive_shard()) is not None:
                for b in reversed(range(NB)):
                    c.send_block_gradient(shard.step, b, NB, [w * b, w, -w], SIZES)
                    got.append(c.receive_averaged_block().gradients.tolist())
                for comp in (0, 1, 2):
                    c.send_non_block_gradient(shard.step, comp, np.full(4, w, np.float32))
                    got.append(c.receive_averaged_non_block().gradients.tolist())
            results.put(("done", c.worker_id(), got))
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        results.put(("error", type(e).__name__, str(e)))


def _start(addr: tuple[str, int], roles: list[str]) -> tuple[list[Any], Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(addr, r, results), daemon=True) for r in roles]
    for p in procs:
        p.start()
    return procs, results


def _get(results: Any) -> tuple[str, Any, Any]:
    try:
        return results.get(timeout=SPAWN_S)
    except queue.Empty:
        pytest.fail(f"no word from a worker process within {SPAWN_S}s")


def _stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def test_worker_processes_train_two_steps():
    cfg = DistributedConfig.coordinator("127.0.0.1:0", 2, timeout_s=SPAWN_S)
    with GradientServer.bind(cfg) as srv:
        procs, results = _start(srv.local_addr(), ["worker", "worker"])
        try:
            srv.wait_for_workers()
            srv.set_total_samples(4)
            for step in range(2):
                srv.send_shard_assignments(step)
                for b in reversed(range(NB)):
                    srv.broadcast_averaged_block(step, srv.collect_and_reduce_block(step, b))
                for comp in (0, 1, 2):
                    srv.broadcast_averaged_non_block(step, srv.collect_and_reduce_non_block(step, comp))
            srv.shutdown_workers()
            outcomes = [_get(results) for _ in range(4)]
        finally:
            _stop(procs)
    done = [o for o in outcomes if o[0] == "done"]
    assert len(done) == 2, outcomes
    want = ([[1.5 * b, 1.5, -1.5] for b in reversed(range(NB))] + [[1.5] * 4] * 3) * 2
    assert all(got == want for _, _, got in done)


def test_a_killed_worker_process_aborts_the_others():
    cfg = DistributedConfig.coordinator("127.0.0.1:0", 2, timeout_s=SPAWN_S)
    with GradientServer.bind(cfg) as srv:
        procs, results = _start(srv.local_addr(), ["victim", "worker"])
        try:
            srv.wait_for_workers()
            joined = [_get(results) for _ in range(2)]
            victim_id = next(wid for _, wid, role in joined if role == "victim")
            srv.set_total_samples(4)
            srv.send_shard_assignments(0)
            procs[0].kill()  # the "victim" process, waiting for its next shard
            procs[0].join(10)
            # A kill is seen as EOF or, if the victim had unread input, as a reset: both name the worker.
            with pytest.raises(TransportBroken, match=rf"worker {victim_id} \(node .*\) failed: .*(closed the connection|broke)"):
                for b in reversed(range(NB)):
                    srv.broadcast_averaged_block(0, srv.collect_and_reduce_block(0, b))
            kind, name, text = _get(results)
        finally:
            _stop(procs)
    assert (kind, name) == ("error", "TransportBroken")
    assert "the coordinator aborted the cluster" in text and f"worker {victim_id} (node " in text

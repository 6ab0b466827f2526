"""Serving a pipeline over TCP on 127.0.0.1: workers, fixed-function boards, the coordinator's helpers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading

import numpy as np
import pytest

from gradcoll.errors import ProtocolError, TransportBroken, TransportClosed, UsageError
from gradcoll.node import (
    FixedFunction,
    FixedFunctionDevice,
    LoopbackFixedFunction,
    NodeCaps,
    NodeConfig,
    NodeControl,
    NodeReport,
    OpSpec,
    RemoteStageError,
    StageRefused,
    StageSpec,
    collect_caps,
    connect_local,
    drive_pipeline,
    serve_fixed_function_n,
    serve_worker,
    serve_worker_n,
    ship_stage,
    wire,
)
from gradcoll.testing import run_ranks

X3 = FixedFunction("x3", 4, 4)
RELU = StageSpec([OpSpec.of("relu")], stage_id="relu")


def _board(stage_id: str = "x3", fn=lambda x: x * 3) -> LoopbackFixedFunction:
    return LoopbackFixedFunction(stage_id, fn)


@pytest.fixture(params=["mesh", "star"])
def topology(request) -> str:
    return request.param


def _groups(world: int, topology: str = "mesh"):
    return connect_local(world, topology=topology, timeout=10, kernel_backend="numpy")


def _run(fns, groups, timeout: float = 20.0):
    try:
        return run_ranks(fns, groups, timeout=timeout, on_error=lambda: [g.close() for g in groups])
    finally:
        for g in groups:
            g.close()


def _worker(control_steps: int | None = 1):
    def serve(g):
        control = NodeControl.unbounded() if control_steps is None else NodeControl.steps(control_steps)
        return serve_worker_n(g, NodeCaps.here(g.rank, device="cpu"), None, control)
    return serve


def _fixed(board=None, ff: FixedFunction = X3, steps: int = 1):
    return lambda g: serve_fixed_function_n(g, ff, board or _board(), NodeControl.steps(steps))


def test_relu_then_x3_board_turns_the_input_into_0_6_0_12(topology: str) -> None:
    """The original's test: 3 ranks, relu on rank 1, a x3 board on rank 2, NodeControl.steps(1) counts 1."""
    def coordinator(g):
        caps = collect_caps(g)
        assert [c.role.kind for c in caps] == ["worker", "fixed_function"]
        ship_stage(g, 1, RELU)
        ship_stage(g, 2, StageSpec(stage_id="x3"))
        return drive_pipeline(g, [[-1, 2, -3, 4]])

    out, r1, r2 = _run([coordinator, _worker(1), _fixed()], _groups(3, topology))
    np.testing.assert_array_equal(out[0], [0, 6, 0, 12])
    assert r1 == NodeReport(1, "cpu", "linux", 1) and r2 == NodeReport(2, "fixed_function", "linux", 1)


@pytest.mark.parametrize("world", [2, 4])
def test_many_activations_through_every_worker(topology: str, world: int) -> None:
    inputs = [np.arange(5, dtype=np.float32) - k for k in range(7)]

    def coordinator(g):
        collect_caps(g)
        for r in range(1, world):
            ship_stage(g, r, StageSpec([OpSpec.of("scale", factor=r + 1)]))
        out = drive_pipeline(g, inputs, window=3)
        g.close()  # ends the workers' loops: rank 1's upstream closes, then rank 2's, ...
        return out

    def worker(g):
        report = _worker(None)(g)
        g.close()  # as a worker process does when it exits: the next rank's loop ends in turn
        return report

    out = _run([coordinator] + [worker] * (world - 1), _groups(world, topology))
    factor = np.prod(np.arange(2, world + 1))
    for x, y in zip(inputs, out[0], strict=True):
        np.testing.assert_array_equal(y, x * factor)
    assert [r.activations for r in out[1:]] == [len(inputs)] * (world - 1)  # each ended when rank 0 closed


def test_a_5_element_input_to_a_4_element_board_is_refused() -> None:
    def coordinator(g):
        collect_caps(g)
        ship_stage(g, 1, StageSpec(stage_id="x3"))
        with pytest.raises(RemoteStageError, match="rank 1: fixed-function stage 'x3' takes 4 elems, got 5"):
            drive_pipeline(g, [np.ones(5)])

    def board(g):
        with pytest.raises(StageRefused, match="takes 4 elems, got 5"):
            _fixed()(g)

    _run([coordinator, board], _groups(2))


def test_a_board_output_of_the_wrong_length_is_refused() -> None:
    def coordinator(g):
        collect_caps(g)
        ship_stage(g, 1, StageSpec(stage_id="x3"))
        with pytest.raises(RemoteStageError, match="must produce 4 elems, the board returned 3"):
            drive_pipeline(g, [np.ones(4)])

    def board(g):
        with pytest.raises(StageRefused, match="the board returned 3"):
            _fixed(_board(fn=lambda x: x[:3]))(g)

    _run([coordinator, board], _groups(2))


def test_a_board_whose_id_differs_from_its_descriptor_is_refused_before_sending_anything() -> None:
    groups = _groups(2)
    try:
        with pytest.raises(StageRefused, match="board implements stage 'x4' but its descriptor says 'x3'"):
            _fixed(_board("x4"))(groups[1])
        groups[1].close()
        with pytest.raises(TransportClosed):  # nothing was sent before the refusal: no caps to collect
            collect_caps(groups[0])
    finally:
        for g in groups:
            g.close()


def test_a_stage_with_another_id_is_refused_naming_both_ids() -> None:
    def coordinator(g):
        collect_caps(g)
        with pytest.raises(StageRefused, match="rank 1 refused stage 'relu'.*'x3' cannot run stage 'relu'"):
            ship_stage(g, 1, RELU)

    def board(g):
        with pytest.raises(StageRefused, match="fixed-function stage 'x3' cannot run stage 'relu'"):
            _fixed()(g)

    _run([coordinator, board], _groups(2))


def test_a_stage_whose_weights_do_not_load_is_refused_at_rank_0() -> None:
    bad = StageSpec([OpSpec.of("linear", weight="file:///nonexistent/w.npy")])

    def coordinator(g):
        collect_caps(g)
        with pytest.raises(StageRefused, match="rank 1 cannot load stage None: op 0 \\(linear\\): cannot load"):
            ship_stage(g, 1, bad)

    def worker(g):
        with pytest.raises(UsageError, match="cannot load weight"):
            _worker()(g)

    _run([coordinator, worker], _groups(2))


def test_a_resolver_that_raises_anything_still_answers_rank_0() -> None:
    def resolve(uri: str) -> None:
        raise KeyError(uri)

    def coordinator(g):
        collect_caps(g)
        with pytest.raises(StageRefused, match="cannot load stage 's'.*'mem://w'"):
            ship_stage(g, 1, StageSpec([OpSpec.of("add_bias", bias="mem://w")], stage_id="s"))

    def worker(g):
        with pytest.raises(KeyError):
            serve_worker_n(g, NodeCaps.here(1, device="cpu"), resolve, NodeControl.steps(1))

    _run([coordinator, worker], _groups(2))


def test_stop_handle_stops_an_idle_worker_within_one_receive_timeout() -> None:
    control = NodeControl.unbounded(poll=0.05)
    handle = control.stop_handle()
    shipped = threading.Event()

    def coordinator(g):
        collect_caps(g)
        ship_stage(g, 1, RELU)  # returns once the worker has acked: it is now idle in its loop
        shipped.set()

    def worker(g):
        return serve_worker_n(g, NodeCaps.here(1, device="cpu"), None, control)

    def stopper(_):
        assert shipped.wait(10)
        handle.stop()

    groups = _groups(2)
    try:
        report = run_ranks([coordinator, worker, stopper], groups + [None], timeout=10)[1]
        assert report.activations == 0 and handle.stopped and control.stopped
    finally:
        for g in groups:
            g.close()


def test_stop_before_a_stage_arrives_returns_an_empty_report() -> None:
    control = NodeControl.steps(5)
    control.stop_handle().stop()
    groups = _groups(2)
    try:
        report = serve_worker_n(groups[1], NodeCaps.here(1, device="cpu"), None, control)
        assert report == NodeReport(1, "cpu", "linux", 0)
    finally:
        for g in groups:
            g.close()


def test_a_closed_upstream_ends_the_loop_cleanly_and_a_closed_coordinator_is_an_error() -> None:
    def coordinator(g):
        collect_caps(g)
        ship_stage(g, 1, RELU)
        drive_pipeline(g, [[1.0]])
        g.close()

    out = _run([coordinator, lambda g: serve_worker(g)], _groups(2))
    assert out[1].activations == 1
    # Waiting for a stage that never comes is not a clean end: the coordinator went away.
    groups = _groups(2)
    groups[0].close()
    with pytest.raises(TransportClosed):
        serve_worker(groups[1])
    groups[1].close()


def test_worker_world_of_one_and_misuse() -> None:
    (g,) = _groups(1)
    try:
        assert [y.tolist() for y in drive_pipeline(g, [[1, 2]])] == [[1.0, 2.0]]
        with pytest.raises(UsageError, match="coordinator"):
            serve_worker(g)
        with pytest.raises(UsageError, match="window"):
            drive_pipeline(g, [], window=0)
    finally:
        g.close()
    assert isinstance(_board(), FixedFunctionDevice)


def test_garbage_instead_of_a_stage_is_a_protocol_error() -> None:
    def coordinator(g):
        collect_caps(g)
        g.transport.send(1, b"no node message!", wire.HEADER_TAG)  # 16 bytes, like a header

    def worker(g):
        with pytest.raises(ProtocolError):
            _worker()(g)

    _run([coordinator, worker], _groups(2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_worker(addr: str) -> None:
    group = NodeConfig(1, 2).peers([addr]).mesh().connect(timeout=20, kernel_backend="numpy")
    serve_worker(group)


def test_a_dead_worker_is_an_error_at_rank_0_never_a_hang() -> None:
    addr = f"127.0.0.1:{_free_port()}"
    child = multiprocessing.get_context("spawn").Process(target=_child_worker, args=(addr,), daemon=True)
    child.start()
    try:
        group = NodeConfig(0, 2).peers([addr]).mesh().connect(timeout=20, kernel_backend="numpy")
        collect_caps(group)
        ship_stage(group, 1, RELU)
        np.testing.assert_array_equal(drive_pipeline(group, [[-1, 1]])[0], [0, 1])
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        with pytest.raises((TransportBroken, TransportClosed)):
            drive_pipeline(group, [[-1, 1]], timeout=10)
        group.close()
    finally:
        if child.is_alive():
            child.kill()

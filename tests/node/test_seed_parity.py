"""API parity with the original node driver: names, argument order, element types, defaults.

Written from the original's documented API (the node module's structs,
enums, traits and functions and their signatures), not from gradcoll's
behaviour. Where gradcoll departs on purpose, the test pins the departure
that docs/node.md states.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import gradcoll.node as node
from gradcoll.errors import UsageError
from gradcoll.node import (
    DataSpec,
    FixedFunction,
    LoopbackFixedFunction,
    NodeCaps,
    NodeConfig,
    NodeControl,
    NodeReport,
    NodeRole,
    OpSpec,
    StageRefused,
    StageSpec,
    Topology,
    TrainReport,
    TrainSpec,
    collect_caps,
    connect_local,
    drive_pipeline,
    send_caps,
    serve_fixed_function_n,
    serve_worker_n,
    ship_stage,
    train_local,
)
from gradcoll.node.dtypes import BOARD_DTYPES, COMPUTE_DTYPES, canonical_dtype
from gradcoll.testing import run_ranks
from tests.helpers import field_names, positional_params

# -- element types: the original's names beside NumPy's --------------------------------------------

SPELLINGS = [
    ("f16", "float16"), ("F16", "float16"), ("float16", "float16"), (np.float16, "float16"),
    ("f32", "float32"), ("F32", "float32"), ("float32", "float32"), (np.dtype("<f4"), "float32"),
    ("f64", "float64"), ("F64", "float64"), ("float64", "float64"), (np.float64, "float64"),
]


@pytest.mark.parametrize("spelling, canonical", SPELLINGS)
def test_fixed_function_takes_the_originals_element_type_names(spelling: object, canonical: str) -> None:
    ff = FixedFunction("scale3", 4, 4, spelling)  # type: ignore[arg-type]
    assert ff.dtype == canonical
    assert ff == FixedFunction("scale3", 4, 4, canonical)


def test_bf16_and_integer_datapaths_are_board_types_exchanged_as_float32() -> None:
    for short, canonical in [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"),
                             ("i8", "int8"), ("u8", "uint8"), ("i32", "int32")]:
        ff = FixedFunction("q", 4, 4, short)
        assert (ff.dtype, ff.exchange_dtype) == (canonical, "float32")
    assert FixedFunction("h", 4, 4, "f16").exchange_dtype == "float16"
    # Stage ops and training compute in NumPy: bf16 is refused there, with the reason.
    with pytest.raises(UsageError, match="fixed-function board"):
        StageSpec(dtype="bf16")
    with pytest.raises(UsageError, match=r"float32 \(f32\)"):
        StageSpec(dtype="c64")
    for bad in ("bool", "c64", None, True, "", "complex64", "float128"):
        with pytest.raises(UsageError, match="fixed-function dtype must be one of"):
            FixedFunction("q", 4, 4, bad)  # type: ignore[arg-type]


def test_one_normaliser_serves_stages_train_specs_and_boards() -> None:
    assert StageSpec(dtype="f64").dtype == "float64"
    data = DataSpec(None, None, 0, 1, [[1.0]], [1.0])
    spec = TrainSpec([OpSpec.of("scale", factor=2.0)], {"w": "mem://w"}, data, [0.1], dtype="f16")
    assert spec.dtype == "float16"
    assert TrainSpec.from_json(spec.to_json()).dtype == "float16"
    assert set(COMPUTE_DTYPES) < set(BOARD_DTYPES)
    for short, canonical in [("f16", "float16"), ("f32", "float32"), ("f64", "float64")]:
        assert canonical_dtype(short) == canonical_dtype(canonical) == canonical


@pytest.mark.parametrize("short, canonical", [("f16", "float16"), ("f32", "float32"), ("f64", "float64"),
                                              ("bf16", "bfloat16")])
def test_both_spellings_round_trip_through_the_json_caps_as_one(short: str, canonical: str) -> None:
    a = NodeCaps(2, NodeRole.fixed_function(FixedFunction("b", 4, 4, short)), ("fixed_function",), "linux")
    b = NodeCaps(2, NodeRole.fixed_function(FixedFunction("b", 4, 4, canonical)), ("fixed_function",), "linux")
    wire_a, wire_b = json.dumps(a.to_dict()), json.dumps(b.to_dict())
    assert wire_a == wire_b  # what a peer receives carries the canonical form only
    assert json.loads(wire_a)["role"]["fixed"]["dtype"] == canonical
    assert NodeCaps.from_dict(json.loads(wire_a)) == a == b
    # A peer that writes the short name is read into the same caps.
    doc = json.loads(wire_a)
    doc["role"]["fixed"]["dtype"] = short
    assert NodeCaps.from_dict(doc) == a


def test_short_names_survive_send_caps_and_collect_caps_over_tcp() -> None:
    groups = connect_local(3, kernel_backend="numpy")
    sent = {1: FixedFunction("x3", 4, 4, "f32"), 2: FixedFunction("x3", 4, 4, "float32")}

    def worker(g):  # type: ignore[no-untyped-def]
        return send_caps(g, NodeCaps(g.rank, NodeRole.fixed_function(sent[g.rank]), ("fixed_function",), "linux"))

    try:
        got = run_ranks([collect_caps, worker, worker], groups, timeout=20)[0]
    finally:
        for g in groups:
            g.close()
    assert [c.role.fixed.dtype for c in got] == ["float32", "float32"]
    assert got[0].role == got[1].role


@pytest.mark.parametrize("dtype, handed", [("f32", np.float32), ("bf16", np.float32), ("f16", np.float16)])
def test_a_board_declared_in_short_names_serves_the_originals_pipeline(dtype: str, handed: type) -> None:
    """The original's test: relu on rank 1, a x3 board on rank 2: [-1, 2, -3, 4] -> [0, 6, 0, 12]."""
    board_inputs: list[np.dtype] = []

    def x3(x: np.ndarray) -> np.ndarray:
        board_inputs.append(x.dtype)
        return x * 3

    def coordinator(g):  # type: ignore[no-untyped-def]
        caps = collect_caps(g)
        assert caps[1].role.fixed.dtype == canonical_dtype(dtype, BOARD_DTYPES)
        ship_stage(g, 1, StageSpec([OpSpec.of("relu")], stage_id="relu", dtype="f32"))
        ship_stage(g, 2, StageSpec(stage_id="x3"))
        return drive_pipeline(g, [[-1, 2, -3, 4]])

    fns = [coordinator,
           lambda g: serve_worker_n(g, NodeCaps.here(g.rank, device="cpu"), None, NodeControl.steps(1)),
           lambda g: serve_fixed_function_n(g, FixedFunction("x3", 4, 4, dtype), LoopbackFixedFunction("x3", x3),
                                            NodeControl.steps(1))]
    groups = connect_local(3, timeout=10, kernel_backend="numpy")
    try:
        out, r1, r2 = run_ranks(fns, groups, timeout=20, on_error=lambda: [g.close() for g in groups])
    finally:
        for g in groups:
            g.close()
    np.testing.assert_array_equal(out[0], [0, 6, 0, 12])
    assert board_inputs == [np.dtype(handed)]
    assert (r1.activations, r2.activations) == (1, 1)


# -- names, fields and argument order ----------------------------------------------------------------


def test_every_name_of_the_original_module_is_exported() -> None:
    for name in ("FixedFunction", "LoopbackFixedFunction", "NodeCaps", "NodeConfig", "NodeControl", "NodeReport",
                 "NodeStopHandle", "ProcessGroup", "TrainReport", "NodeRole", "PeerSource", "Topology",
                 "FixedFunctionDevice", "collect_caps", "mean_reduce", "node_device", "platform_tag", "send_caps",
                 "serve_fixed_function_n", "serve_trainer", "serve_trainer_here", "serve_worker", "serve_worker_n",
                 "weight_cache"):
        assert hasattr(node, name), name


def test_function_argument_order() -> None:
    expected = {
        "serve_worker": ["group", "resolve"],
        "serve_worker_n": ["group", "caps", "resolve", "control"],
        "serve_fixed_function_n": ["group", "ff", "board", "control"],
        "serve_trainer": ["group", "caps", "resolve", "log"],
        "serve_trainer_here": ["group", "resolve", "log"],
        "send_caps": ["group", "caps"],
        "mean_reduce": ["group", "buf"],
    }
    for name, params in expected.items():
        assert positional_params(getattr(node, name)) == params, name
    assert positional_params(node.collect_caps)[:1] == ["group"]
    assert positional_params(FixedFunction) == ["stage_id", "input_elems", "output_elems", "dtype"]
    assert positional_params(LoopbackFixedFunction) == ["stage_id", "fn"]
    assert positional_params(NodeConfig)[:2] == ["rank", "world"]


def test_struct_fields() -> None:
    assert field_names(NodeCaps) == ["rank", "role", "devices", "platform"]
    assert field_names(NodeReport) == ["rank", "device", "platform", "activations"]
    assert field_names(TrainReport) == ["rank", "platform", "metrics", "params"]
    assert field_names(FixedFunction) == ["stage_id", "input_elems", "output_elems", "dtype"]


def test_builders_chain_as_in_the_original_example() -> None:
    cfg = NodeConfig(1, 2).peers(["192.168.1.10:29500", "192.168.1.11:29501"]).device("auto")
    assert (cfg.rank, cfg.world, cfg.device_directive, cfg.wire_topology) == (1, 2, "auto", Topology.MESH)
    assert NodeConfig(1, 2).node_role == NodeRole.worker()  # defaults: mesh, "auto", worker
    assert NodeConfig(1, 3).star().wire_topology is Topology.STAR
    assert NodeConfig(1, 3).star().mesh().wire_topology is Topology.MESH
    # peers() keeps a topology chosen before it, as the original does.
    addrs = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    assert NodeConfig(1, 3).star().peers(addrs).wire_topology is Topology.STAR
    assert NodeConfig(1, 3).peers(addrs).wire_topology is Topology.MESH
    assert NodeConfig(1, 3).peers(addrs[:1]).wire_topology is Topology.STAR  # one address: the coordinator
    with pytest.raises(ValueError, match="got 2 addresses for a world of 3"):
        NodeConfig(1, 3).peers(addrs[:2])
    ff = FixedFunction("x3", 4, 4, "f32")
    assert NodeConfig(2, 3).fixed_function(ff).node_role == NodeRole.fixed_function(ff)


def test_node_control_and_stop_handle_methods() -> None:
    ctl = NodeControl.steps(2)
    assert ctl.should_continue(0) and ctl.should_continue(1) and not ctl.should_continue(2)
    unbounded = NodeControl.unbounded()
    assert unbounded.should_continue(10**9)
    handle = unbounded.stop_handle()
    assert handle.is_stopped() is False
    handle.stop()
    assert handle.is_stopped() is True and not unbounded.should_continue(0)


def test_platform_is_a_free_form_tag() -> None:
    assert node.platform_tag() in ("ios", "android", "macos", "linux", "windows", "wasm", "unknown")
    caps = NodeCaps(1, NodeRole.worker(), ("cpu",), "freebsd")
    assert NodeCaps.from_dict(json.loads(json.dumps(caps.to_dict()))).platform == "freebsd"


def test_accepts_and_can_train() -> None:
    ff = FixedFunction("x3", 4, 4, "f32")
    board = NodeCaps(2, NodeRole.fixed_function(ff), ("fixed_function",), "linux")
    assert ff.accepts(StageSpec(stage_id="x3")) and board.accepts(StageSpec(stage_id="x3"))
    assert not ff.accepts(StageSpec(stage_id="relu")) and not board.accepts(StageSpec())
    # Documented departure: accepts is a bool; check_stage raises the original's error, naming both ids.
    with pytest.raises(StageRefused, match="'x3' cannot run stage 'relu'"):
        ff.check_stage(StageSpec(stage_id="relu"))
    with pytest.raises(StageRefused, match="cannot train"):
        board.can_train()


def test_train_report_params_and_a_log_flag(capsys: pytest.CaptureFixture[str]) -> None:
    data = DataSpec(None, None, 0, 2, [[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [1.0, 1.0]])
    spec = TrainSpec([OpSpec.of("add_bias", bias="b"), OpSpec.of("scale", factor=0.5)], [("b", "mem://b")],
                     data, [0.1])
    report = train_local(spec, {"mem://b": np.zeros(2)}.__getitem__, log=True)  # the original's flag form
    assert "epoch 1/1" in capsys.readouterr().err
    # Documented departure: params is a dict by name in the spec's order; items() are the original's pairs.
    assert [name for name, _ in report.params.items()] == ["b"]
    train_local(spec, {"mem://b": np.zeros(2)}.__getitem__, log=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(UsageError, match="log must be"):
        train_local(spec, {"mem://b": np.zeros(2)}.__getitem__, log=3)  # type: ignore[arg-type]


def test_mean_reduce_averages_in_place_and_returns_the_buffer() -> None:
    groups = connect_local(2, kernel_backend="numpy")
    bufs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
    try:
        outs = run_ranks([lambda g: node.mean_reduce(g, bufs[g.rank])] * 2, groups, timeout=20)
    finally:
        for g in groups:
            g.close()
    for out, buf in zip(outs, bufs, strict=True):
        assert out.tolist() == [2.0, 3.0]
        assert out is buf  # documented departure: the original returned a new vector


def test_from_env_needs_rank_and_world() -> None:
    # Documented departure: the original defaulted RANK to 0 and WORLD to 1.
    with pytest.raises(UsageError, match="RANK"):
        NodeConfig.from_env({})
    cfg = NodeConfig.from_env({"RANK": "1", "WORLD": "2", "PEERS": "10.0.0.1:1, 10.0.0.2:1", "DEVICE": "cpu"})
    assert (cfg.rank, cfg.world, cfg.device_directive, cfg.wire_topology) == (1, 2, "cpu", Topology.MESH)
    assert NodeConfig.from_env({"RANK": "1", "WORLD": "2", "TOPOLOGY": "star"}).wire_topology is Topology.STAR


def test_discover_takes_a_store_address_not_udp_ports() -> None:
    # Documented departure: peers meet through a TCP store on one address.
    assert NodeConfig(1, 2).discover("10.0.0.1:29500").peer_source.kind == "discover"  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="host:port"):
        NodeConfig(1, 2).discover(29600)  # type: ignore[arg-type]


def test_weight_cache_and_node_device_take_the_originals_arguments() -> None:
    cache = node.weight_cache()
    assert isinstance(cache, node.WeightCache)
    assert node.node_device("cpu") == "cpu"

"""Roles, capabilities, platform tag, device resolution, and caps over the wire as JSON."""

from __future__ import annotations

import logging

import pytest

from gradcoll.errors import UsageError
from gradcoll.node import FixedFunction, NodeCaps, NodeRole, StageRefused, StageSpec, collect_caps, connect_local, node_device, platform_tag, send_caps, wire
from gradcoll.node import caps as caps_mod
from gradcoll.testing import run_ranks

FF = FixedFunction("x3", 4, 4)


def test_platform_tag_is_one_of_the_known_tags(monkeypatch) -> None:
    assert platform_tag() == "linux"
    for plat, tag in [("darwin", "macos"), ("win32", "windows"), ("emscripten", "wasm"), ("wasi", "wasm"),
                      ("ios", "ios"), ("android", "android"), ("plan9", "unknown")]:
        monkeypatch.setattr(caps_mod.sys, "platform", plat)
        assert platform_tag() == tag


def test_node_device_resolves_auto_and_falls_back_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(caps_mod, "_available", lambda d: d == "cuda")
    assert node_device("auto") == node_device("") == "cuda" and node_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(caps_mod, "_available", lambda d: False)
    assert node_device("auto") == "cpu" and node_device("CPU") == "cpu"
    with caplog.at_level(logging.WARNING, logger="gradcoll.node.caps"):
        assert node_device("cuda") == "cpu"
        assert node_device("tpu") == "cpu"
    assert "'cuda' is not available" in caplog.text and "unknown device 'tpu'" in caplog.text


def test_node_device_probes_the_real_backends() -> None:
    assert node_device("auto") in ("cuda", "cpu")  # under the test suite's simulator: never "cudasim"


def test_can_train_refuses_a_fixed_function_rank_naming_its_stage() -> None:
    NodeCaps(1, NodeRole.worker(), ("cpu",), "linux").can_train()
    with pytest.raises(StageRefused, match="rank 2 is fixed-function stage 'x3' and cannot train"):
        NodeCaps(2, NodeRole.fixed_function(FF), ("fixed_function",), "linux").can_train()


def test_accepts() -> None:
    worker = NodeCaps(1, NodeRole.worker(), ("cpu",), "linux")
    board = NodeCaps(2, NodeRole.fixed_function(FF), ("fixed_function",), "linux")
    assert worker.accepts(StageSpec(stage_id="anything")) and board.accepts(StageSpec(stage_id="x3"))
    assert not board.accepts(StageSpec(stage_id="x4")) and not board.accepts(StageSpec())


def test_caps_round_trip_and_strict_parsing() -> None:
    for c in (NodeCaps.here(3, device="cpu"), NodeCaps(2, NodeRole.fixed_function(FF), ("fixed_function",), "ios")):
        assert NodeCaps.from_dict(c.to_dict()) == c
    good = NodeCaps.here(1, device="cpu").to_dict()
    for bad in ({**good, "extra": 1}, {**good, "platform": ""}, {**good, "platform": "x" * 65},
                {**good, "platform": "linux\n"}, {**good, "platform": 7}, {**good, "devices": "cpu"},
                {**good, "role": {"kind": "fixed_function", "fixed": None}}, {**good, "rank": -1}):
        with pytest.raises(UsageError):
            NodeCaps.from_dict(bad)


def test_collect_caps_gets_ranks_in_order_as_json() -> None:
    groups = connect_local(4, kernel_backend="numpy")
    try:
        roles = [None, NodeRole.worker(), NodeRole.fixed_function(FF), NodeRole.worker()]
        fns = [collect_caps] + [lambda g: send_caps(g, NodeCaps(g.rank, roles[g.rank], ("cpu",), "linux"))] * 3
        got = run_ranks(fns, groups, timeout=20)[0]
        assert [c.rank for c in got] == [1, 2, 3] and got[1].role == roles[2]
    finally:
        for g in groups:
            g.close()


def test_collect_caps_refuses_caps_for_another_rank_and_misuse() -> None:
    groups = connect_local(2, kernel_backend="numpy")
    try:
        with pytest.raises(UsageError, match="caps say rank 5"):
            send_caps(groups[1], NodeCaps(5, NodeRole.worker(), ("cpu",), "linux"))
        with pytest.raises(UsageError, match="coordinator"):
            send_caps(groups[0], NodeCaps(0, NodeRole.worker(), ("cpu",), "linux"))
        forged = NodeCaps(5, NodeRole.worker(), ("cpu",), "linux").to_dict()
        fns = [collect_caps, lambda g: wire.send_json(g, 0, {"type": "caps", "caps": forged})]
        with pytest.raises(AssertionError, match="ProtocolError: rank 0: peer 1 sent caps for rank 5"):
            run_ranks(fns, groups, timeout=20)
    finally:
        for g in groups:
            g.close()

"""Data-parallel training: 4 ranks over TCP in both topologies against the single-process reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradcoll.errors import ProtocolError, UsageError
from gradcoll.node import (
    DataSpec,
    FixedFunction,
    NodeCaps,
    NodeRole,
    OpSpec,
    StageRefused,
    TrainSpec,
    collect_caps,
    connect_local,
    coordinate_trainer,
    run_trainer,
    serve_trainer,
    serve_trainer_here,
    ship_train_spec,
    train_local,
    wire,
)
from gradcoll.testing import run_ranks

RNG = np.random.default_rng(7)
X = RNG.normal(size=(40, 3))
Y = np.tanh(X @ RNG.normal(size=(3, 2))) + 0.1
LABELS = (X[:, 0] > 0).astype(np.float64) + (X[:, 1] > 0)
ARRAYS = {"mem://x": X, "mem://y": Y, "mem://labels": LABELS,
          "mem://w1": RNG.normal(size=(4, 3)) * 0.5, "mem://b1": np.zeros(4),
          "mem://w2": RNG.normal(size=(2, 4)) * 0.5, "mem://w3": RNG.normal(size=(3, 3)) * 0.5}
RESOLVE = ARRAYS.__getitem__
MLP = [OpSpec.of("linear", weight="w1", bias="b1"), OpSpec.of("gelu"), OpSpec.of("linear", weight="w2")]
PARAMS = {"w1": "mem://w1", "b1": "mem://b1", "w2": "mem://w2"}


def _spec(shard_len: int = 10, batch: int = 4, **kw) -> TrainSpec:
    data = kw.pop("data", DataSpec("mem://x", "mem://y", 0, shard_len))
    return TrainSpec(kw.pop("ops", MLP), kw.pop("params", PARAMS), data, kw.pop("lr", [0.2, 0.1, 0.05]),
                     kw.pop("momentum", 0.9), batch, **kw)


def _train(specs, topology: str, worker=None):
    groups = connect_local(len(specs), topology=topology, timeout=10, kernel_backend="numpy")
    worker = worker or (lambda g: serve_trainer(g, NodeCaps.here(g.rank, device="cpu"), RESOLVE))
    fns = [lambda g: coordinate_trainer(g, specs, RESOLVE)] + [worker] * (len(specs) - 1)
    try:
        return run_ranks(fns, groups, timeout=30, on_error=lambda: [g.close() for g in groups])
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_four_ranks_reach_the_single_process_parameters(topology: str) -> None:
    specs = _spec(shard_len=10, batch=4).shards(4)  # batches of 4, 4, 2: lane counts differ within an epoch
    reports = _train(specs, topology)
    ref = train_local(specs, RESOLVE)
    for rep in reports:
        assert rep.params.keys() == ref.params.keys()
        for name in ref.params:
            np.testing.assert_allclose(rep.params[name], ref.params[name], rtol=2e-5, atol=1e-6)
        m = rep.metrics
        assert (m.samples, m.steps) == (30, 9) and m.last_loss < m.first_loss
        assert m.wall_s >= m.compute_s + m.comm_s * 0.99 and m.comm_s > 0
    assert [r.rank for r in reports] == [0, 1, 2, 3]


def test_full_batch_over_four_shards_equals_one_process_over_all_rows() -> None:
    """With one batch per shard, every step averages over all 40 rows: the same as one rank with batch 40."""
    whole = _spec(shard_len=40, batch=40, dtype="float64", lr=[0.1] * 5)
    reports = _train(_spec(shard_len=10, batch=10, dtype="float64", lr=[0.1] * 5).shards(4), "mesh")
    ref = train_local(whole, RESOLVE)
    for name in ref.params:
        np.testing.assert_allclose(reports[2].params[name], ref.params[name], rtol=1e-10)
    assert ref.metrics.steps == 5 and ref.metrics.samples == 200


def test_momentum_sgd_by_hand() -> None:
    """One linear layer, mse, two steps: v = mu v + g, p -= lr v, computed here with plain NumPy."""
    x, y, w = ARRAYS["mem://x"][:4], ARRAYS["mem://y"][:4], ARRAYS["mem://w2"][:, :3]
    arrays = {"x": x, "y": y, "w": w}
    spec = TrainSpec([OpSpec.of("linear", weight="w")], {"w": "w"}, DataSpec("x", "y", 0, 4), [0.3, 0.2], 0.5, 4,
                     dtype="float64")
    got = train_local(spec, arrays.__getitem__).params["w"]
    p, v = w.copy(), np.zeros_like(w)
    for lr in (0.3, 0.2):
        g = 2 * (x @ p.T - y).T @ x / (2 * 4)  # d/dW of the mean over rows of the mean over outputs
        v = 0.5 * v + g
        p = p - lr * v
    np.testing.assert_allclose(got, p, rtol=1e-12)


def test_cross_entropy_and_pushed_data() -> None:
    ops = [OpSpec.of("linear", weight="w3")]
    rows = [DataSpec(shard_start=10 * r, shard_len=10, pushed_x=X[10 * r:10 * r + 10], pushed_y=LABELS[10 * r:10 * r + 10])
            for r in range(2)]
    specs = [_spec(ops=ops, params={"w3": "mem://w3"}, data=d, loss="cross_entropy", batch=5, lr=[0.5] * 4)
             for d in rows]
    reports = _train(specs, "star")
    ref = train_local(specs, RESOLVE)
    np.testing.assert_allclose(reports[1].params["w3"], ref.params["w3"], rtol=2e-5, atol=1e-6)
    assert ref.metrics.last_loss < ref.metrics.first_loss


def test_a_fixed_function_rank_refuses_and_every_rank_fails_together() -> None:
    specs = _spec().shards(3)
    ff = NodeRole.fixed_function(FixedFunction("x3", 4, 4))

    def worker(g):
        caps = NodeCaps(g.rank, ff if g.rank == 2 else NodeRole.worker(), ("cpu",), "linux")
        with pytest.raises(StageRefused) as info:
            serve_trainer(g, caps, RESOLVE)
        return str(info.value)

    groups = connect_local(3, timeout=10, kernel_backend="numpy")

    def coordinator(g):
        with pytest.raises(StageRefused) as info:
            coordinate_trainer(g, specs, RESOLVE)
        return str(info.value)

    try:
        msgs = run_ranks([coordinator, worker, worker], groups, timeout=30)
    finally:
        for g in groups:
            g.close()
    assert "ranks [2] refused the train spec" in msgs[0] and "ranks [2]" in msgs[1]
    assert "fixed-function stage 'x3' and cannot train" in msgs[2]


def test_shards_that_are_not_uniform_are_refused_on_every_rank() -> None:
    specs = [_spec(shard_len=10), _spec(shard_len=12)]
    groups = connect_local(2, timeout=10, kernel_backend="numpy")

    def rank(g):
        with pytest.raises(StageRefused, match=r"shard_len per rank is \[10, 12\]"):
            if g.rank == 0:
                collect_caps(g)
                ship_train_spec(g, 1, specs[1])
                run_trainer(g, specs[0], RESOLVE)
            else:
                serve_trainer_here(g, RESOLVE)

    try:
        run_ranks([rank] * 2, groups, timeout=30)
    finally:
        for g in groups:
            g.close()


def test_train_spec_json_round_trip_and_validation() -> None:
    spec = _spec(data=DataSpec(shard_len=2, pushed_x=[[1, 2, 3], [4, 5, 6]], pushed_y=[[0, 1], [1, 0]]))
    back = TrainSpec.from_json(spec.to_json())
    assert back == spec and np.array_equal(back.data.pushed_x, spec.data.pushed_x)
    for bad, words in [
        (dict(ops=[OpSpec.of("linear", weight="nope")]), "names parameter 'nope'"),
        (dict(lr=[]), "one learning rate per epoch"),
        (dict(loss="hinge"), "loss must be"),
        (dict(momentum=float("inf")), "momentum"),
    ]:
        with pytest.raises(UsageError, match=words):
            _spec(**bad)
    with pytest.raises(UsageError, match="shard_len = 2 rows"):
        DataSpec(shard_len=2, pushed_x=[[1]], pushed_y=[[1], [2]])
    with pytest.raises(UsageError, match="needs ops, params, data, lr"):
        TrainSpec.from_json('{"ops": [], "exec": "x"}')
    with pytest.raises(UsageError, match="does not fit data"):
        train_local(_spec(data=DataSpec("mem://x", "mem://y", 35, 10)), RESOLVE)


def test_float64_accumulate_is_read_under_its_old_name_deterministic_too() -> None:
    spec = _spec(float64_accumulate=True)
    assert spec.float64_accumulate and spec.deterministic and _spec(deterministic=True) == spec
    assert json.loads(spec.to_json())["float64_accumulate"] is True
    old = {k: v for k, v in spec.to_dict().items() if k != "float64_accumulate"}
    assert TrainSpec.from_dict({**old, "deterministic": True}) == spec
    assert TrainSpec.from_dict(old) == _spec()
    for doc, words in [({**old, "deterministic": None}, "deterministic must be true or false"),
                       ({**old, "float64_accumulate": 1}, "float64_accumulate must be true or false"),
                       ({**old, "float64_accumulate": True, "deterministic": False}, "disagree")]:
        with pytest.raises(UsageError, match=words):
            TrainSpec.from_dict(doc)


def test_rank_0_does_not_serve_and_a_bad_spec_is_a_protocol_error() -> None:
    groups = connect_local(2, timeout=10, kernel_backend="numpy")
    try:
        with pytest.raises(UsageError, match="coordinator"):
            serve_trainer_here(groups[0])

        def coordinator(g):
            collect_caps(g)
            wire.send_json(g, 1, {"type": "train", "spec": {"ops": "rm -rf /"}})

        def worker(g):
            with pytest.raises(ProtocolError, match="invalid train spec"):
                serve_trainer_here(g, RESOLVE)

        run_ranks([coordinator, worker], groups, timeout=20)
    finally:
        for g in groups:
            g.close()


def test_a_spec_that_cannot_run_is_refused_before_the_first_step() -> None:
    specs = _spec().shards(2)
    specs[1] = TrainSpec(MLP, {**PARAMS, "w2": "mem://w3"}, specs[1].data, specs[1].lr, batch=4)  # (3, 3): no fit
    groups = connect_local(2, timeout=10, kernel_backend="numpy")

    def rank(g):
        with pytest.raises(StageRefused) as info:
            if g.rank == 0:
                coordinate_trainer(g, specs, RESOLVE)
            else:
                serve_trainer_here(g, RESOLVE)
        return str(info.value)

    try:
        msgs = run_ranks([rank] * 2, groups, timeout=30)
    finally:
        for g in groups:
            g.close()
    assert "ranks [1] refused" in msgs[0] and "rank 1: op 2 (linear)" in msgs[1]

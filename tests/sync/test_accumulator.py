"""DistributedGradientAccumulator: commit, collect by cid, FedAvg / Sum / WeightedMean."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from gradcoll import kernels  # noqa: E402
from gradcoll.errors import CollectiveMismatch, NonFiniteError, UsageError  # noqa: E402
from gradcoll.sync import AccumulatorConfig, Aggregation, DistributedGradientAccumulator, MemoryBlockStore, aggregate_gradients, get_gradient, put_gradient


def _acc(strategy="fedavg"):
    store = MemoryBlockStore()
    acc = DistributedGradientAccumulator("round-1", AccumulatorConfig(strategy=strategy))
    return acc, store


def test_commit_local_stores_a_retrievable_gradient():
    acc, store = _acc()
    g = np.arange(70_000, dtype=np.float32)
    cid = acc.commit_local(g, store)
    assert np.array_equal(get_gradient(store, cid), g)
    g[0] = 99  # the accumulator keeps its own copy
    assert acc.local_gradient[0] == 0


def test_fedavg_of_local_and_peers():
    acc, store = _acc()
    acc.commit_local([1.0, 2.0, 3.0], store)
    assert not acc.is_ready(1)
    acc.add_peer_gradient("b", put_gradient(store, [3.0, 4.0, 5.0]), store)
    acc.add_peer_gradient("c", put_gradient(store, [5.0, 6.0, 7.0]), store)
    assert acc.is_ready(2) and not acc.is_ready(3) and acc.peer_count == 2
    assert acc.aggregate().tolist() == [3.0, 4.0, 5.0]


def test_sum_and_mean_alias():
    for strategy, want in (("sum", [4.0, 6.0]), (Aggregation.MEAN, [2.0, 3.0])):
        acc, store = _acc(strategy)
        acc.commit_local([1.0, 2.0], store)
        acc.add_peer_gradient("p", put_gradient(store, [3.0, 4.0]), store)
        assert acc.aggregate().tolist() == want


def test_weighted_mean_uses_each_contributions_weight():
    acc, store = _acc("weighted_mean")
    acc.commit_local([0.0, 0.0], store, weight=1.0)
    acc.add_peer_gradient("p", put_gradient(store, [4.0, 8.0]), store, weight=3.0)
    assert acc.aggregate().tolist() == [3.0, 6.0]


def test_weighted_mean_refuses_bad_weights():
    with pytest.raises(UsageError, match="no weight for peer 'b'"):
        aggregate_gradients({"a": [1.0], "b": [2.0]}, "weighted_mean", weights={"a": 1.0})
    with pytest.raises(UsageError, match="sum to 0"):
        aggregate_gradients({"a": [1.0]}, "weighted_mean", weights={"a": 0.0})
    with pytest.raises(UsageError, match="finite"):
        aggregate_gradients({"a": [1.0]}, "weighted_mean", weights={"a": float("nan")})


def test_result_matches_the_kernel_in_sorted_peer_order():
    rng = np.random.default_rng(0)
    grads = {p: rng.standard_normal(50_000).astype(np.float32) for p in ("zed", "amy", "kim")}
    want = kernels.mean_reduce([grads["amy"], grads["kim"], grads["zed"]])
    got = aggregate_gradients(grads)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # Insertion order does not matter: every member gets the same bits.
    again = aggregate_gradients(dict(reversed(list(grads.items()))))
    assert np.array_equal(again.view(np.uint32), got.view(np.uint32))


def test_non_finite_names_the_peer():
    acc, store = _acc()
    acc.commit_local(np.ones(10, np.float32), store)
    bad = np.ones(10, np.float32)
    bad[7] = np.inf
    acc.add_peer_gradient("worker-3", put_gradient(store, bad), store)
    with pytest.raises(NonFiniteError, match="peer 'worker-3'.*element 7") as err:
        acc.aggregate()
    assert err.value.index == 7 and err.value.value == np.inf


def test_weighted_non_finite_reports_the_sent_value():
    with pytest.raises(NonFiniteError, match="peer 'b' sent non-finite value nan"):
        aggregate_gradients({"a": [1.0], "b": [np.nan]}, "weighted_mean", weights={"a": 1.0, "b": 0.0})


def test_length_mismatch_names_the_peer():
    acc, store = _acc()
    acc.commit_local([1.0, 2.0], store)
    with pytest.raises(CollectiveMismatch, match="peer 'short' contributed 1 elements"):
        acc.add_peer_gradient("short", put_gradient(store, [1.0]), store)
    with pytest.raises(CollectiveMismatch, match="peer 'b' contributed 3"):
        aggregate_gradients({"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0]})


def test_a_peer_contributes_once():
    acc, store = _acc()
    acc.commit_local([1.0], store)
    cid = put_gradient(store, [2.0])
    acc.add_peer_gradient("p", cid, store)
    for peer in ("p", "local"):
        with pytest.raises(UsageError, match="already contributed"):
            acc.add_peer_gradient(peer, cid, store)


def test_aggregate_before_commit_and_empty_gradients():
    acc, store = _acc()
    with pytest.raises(UsageError, match="commit_local"):
        acc.aggregate()
    acc.commit_local([], store)
    acc.add_peer_gradient("p", put_gradient(store, []), store)
    assert acc.aggregate().size == 0


def test_unknown_strategy_is_misuse():
    with pytest.raises(UsageError, match="unknown aggregation"):
        AccumulatorConfig(strategy="median")

"""Tests of gradcoll.optimizer: parity with the original, the documented departures, threads."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gradcoll.kernels
from gradcoll.errors import GradcollError, NonFiniteError, UsageError
from gradcoll.optimizer import (
    AggregatedGradient,
    AggregationStrategy,
    DimensionMismatch,
    DistOptimizerStats,
    DistributedOptimizer,
    GradientUpdate,
    NonFiniteUpdate,
    OptimizerError,
    StaleUpdate,
    WorkerId,
    WorkerNotFound,
    WorkerState,
)

SYNC = AggregationStrategy.synchronous()


def upd(worker: str, layer: str, grads, step: int = 0, timestamp: int = 0) -> GradientUpdate:
    return GradientUpdate(WorkerId(worker), layer, grads, step, timestamp)


def make(strategy: AggregationStrategy, *workers: str) -> DistributedOptimizer:
    opt = DistributedOptimizer(strategy)
    for w in workers:
        assert opt.register_worker(WorkerId(w))
    return opt


# --------------------------------------------------------------------------
# Parity: the original's tests and documented behaviour (docs/optimizer.md)
# --------------------------------------------------------------------------


def test_new_optimizer_is_empty():
    opt = DistributedOptimizer(SYNC)
    assert opt.strategy == SYNC
    assert (opt.current_step, opt.dropped_updates) == (0, 0)
    assert opt.stats() == DistOptimizerStats(0, 0, 0, 0, 0, 0)
    assert opt.active_workers() == []
    assert opt.try_aggregate("fc") is None
    assert opt.last_aggregated("fc") is None


def test_register_is_false_for_known_ids_even_inactive():
    opt = make(SYNC, "w1")
    assert not opt.register_worker(WorkerId("w1"))
    assert opt.deregister_worker(WorkerId("w1"))
    assert not opt.register_worker(WorkerId("w1"))
    assert opt.worker_count() == 1
    assert opt.active_worker_count() == 0


def test_soft_deregistration_keeps_the_entry():
    opt = make(SYNC, "w1", "w2")
    assert opt.deregister_worker(WorkerId("w1"))
    assert not opt.deregister_worker(WorkerId("ghost"))
    assert opt.worker_count() == 2
    assert opt.active_worker_count() == 1
    assert [w.worker_id for w in opt.active_workers()] == ["w2"]
    assert opt.worker_state("w1").active is False


def test_unknown_worker_is_refused():
    opt = make(SYNC)
    with pytest.raises(WorkerNotFound) as ei:
        opt.submit_update(upd("ghost", "fc", [1.0]), now=5)
    assert str(ei.value) == "worker not found: ghost"
    assert ei.value.worker_id == "ghost"
    assert opt.dropped_updates == 0


def test_async_threshold_two_accepts_an_update_two_steps_old():
    opt = make(AggregationStrategy.asynchronous(2), "w1")
    opt.advance_step()
    opt.advance_step()
    opt.submit_update(upd("w1", "fc", [1.0], step=0), now=1)
    assert opt.pending_updates_for("fc") == 1
    assert opt.dropped_updates == 0


def test_async_threshold_one_rejects_an_update_two_steps_old():
    opt = make(AggregationStrategy.asynchronous(1), "w1")
    opt.advance_step()
    opt.advance_step()
    with pytest.raises(StaleUpdate) as ei:
        opt.submit_update(upd("w1", "fc", [1.0], step=0), now=1)
    assert str(ei.value) == "stale update from worker w1: update step 0, current step 2"
    assert (ei.value.worker_id, ei.value.update_step, ei.value.current_step) == ("w1", 0, 2)
    assert (ei.value.staleness, ei.value.threshold) == (2, 1)
    assert opt.dropped_updates == 1
    assert opt.pending_updates_for("fc") == 0
    assert opt.worker_state("w1").total_updates == 0  # a refused update is not recorded


def test_async_accepts_updates_from_future_steps():
    opt = make(AggregationStrategy.asynchronous(0), "w1")
    opt.submit_update(upd("w1", "fc", [1.0], step=7), now=1)
    agg = opt.try_aggregate("fc")
    assert agg is not None and agg.step == 0
    assert opt.worker_state("w1").latest_step == 7


def test_sync_mean_of_two_workers():
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0, 2.0]), now=1)
    assert opt.try_aggregate("fc") is None  # w2 has not submitted yet
    opt.submit_update(upd("w2", "fc", [3.0, 4.0]), now=2)
    agg = opt.try_aggregate("fc")
    assert agg is not None
    np.testing.assert_array_equal(agg.values, [2.0, 3.0])
    assert agg.contributing_workers == 2  # a count, as in the original
    assert agg.contributors == ("w1", "w2")
    assert (agg.layer_id, agg.step) == ("fc", 0)
    assert opt.pending_updates_for("fc") == 0
    assert opt.last_aggregated("fc") is agg
    assert opt.stats().total_aggregations == 1


def test_federated_average_waits_for_rounds():
    opt = make(AggregationStrategy.federated_average(2), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [2.0]), now=1)
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w2", "fc", [4.0]), now=1)
    agg = opt.try_aggregate("fc")
    np.testing.assert_array_equal(agg.values, [3.0])


def test_gossip_average_waits_for_fanout():
    opt = make(AggregationStrategy.gossip_average(2), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [0.0]), now=1)
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w2", "fc", [2.0]), now=1)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [1.0])


def test_async_aggregates_anything_pending():
    opt = make(AggregationStrategy.asynchronous(3), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [5.0]), now=1)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [5.0])
    assert opt.try_aggregate("fc") is None


def test_eviction_uses_a_strict_cutoff():
    opt = make(SYNC, "old", "fresh", "edge")
    opt.submit_update(upd("old", "fc", [1.0]), now=100)
    opt.submit_update(upd("fresh", "fc", [1.0]), now=900)
    opt.submit_update(upd("edge", "fc", [1.0]), now=500)
    assert opt.evict_stale_workers(500, 1000) == 1
    assert [w.worker_id for w in opt.active_workers()] == ["fresh", "edge"]
    assert opt.worker_state("old").active is False
    assert opt.evict_stale_workers(500, 1000) == 0  # already inactive: not counted again


def test_eviction_cutoff_saturates_at_zero_and_never_seen_is_zero():
    opt = make(SYNC, "silent")
    assert opt.worker_state("silent").last_seen == 0
    assert opt.evict_stale_workers(5000, 1000) == 0  # cutoff max(0, -4000) = 0; 0 < 0 is false
    assert opt.evict_stale_workers(500, 1000) == 1


def test_inactive_workers_may_still_submit():
    opt = make(AggregationStrategy.federated_average(1), "w1")
    opt.deregister_worker(WorkerId("w1"))
    opt.submit_update(upd("w1", "fc", [1.0], step=3), now=42)
    st = opt.worker_state("w1")
    assert (st.total_updates, st.latest_step, st.last_seen, st.active) == (1, 3, 42, False)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [1.0])


def test_sync_with_zero_active_workers_never_aggregates():
    opt = make(SYNC, "w1")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    opt.deregister_worker(WorkerId("w1"))
    assert opt.try_aggregate("fc") is None
    assert opt.pending_updates_for("fc") == 1


def test_dimension_mismatch_is_refused_and_not_counted_as_dropped():
    opt = make(AggregationStrategy.asynchronous(5), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0, 2.0]), now=1)
    with pytest.raises(DimensionMismatch) as ei:
        opt.submit_update(upd("w2", "fc", [1.0, 2.0, 3.0]), now=1)
    assert str(ei.value) == "dimension mismatch for layer fc: expected 2, got 3"
    assert (ei.value.layer_id, ei.value.expected, ei.value.got, ei.value.worker_id) == ("fc", 2, 3, "w2")
    assert opt.dropped_updates == 0
    assert opt.worker_state("w2").total_updates == 0
    opt.submit_update(upd("w2", "other", [1.0, 2.0, 3.0]), now=1)  # another layer is independent


def test_a_replacement_may_change_the_length_when_it_is_alone():
    opt = make(AggregationStrategy.federated_average(2), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0, 2.0]), now=1)
    opt.submit_update(upd("w1", "fc", [1.0, 2.0, 3.0]), now=2)  # replaces the only pending update
    with pytest.raises(DimensionMismatch, match="expected 3, got 2"):
        opt.submit_update(upd("w2", "fc", [1.0, 2.0]), now=3)


def test_submit_records_latest_step_last_seen_and_count():
    opt = make(AggregationStrategy.federated_average(9), "w1")
    opt.submit_update(upd("w1", "a", [1.0], step=4), now=10)
    opt.submit_update(upd("w1", "b", [1.0], step=2), now=20)
    assert opt.worker_state("w1") == WorkerState(WorkerId("w1"), 4, 20, True, 2)


def test_aggregate_gradients_is_an_elementwise_mean():
    out = DistributedOptimizer.aggregate_gradients([upd("a", "l", [1.0, 2.0]), upd("b", "l", [3.0, 6.0])])
    np.testing.assert_array_equal(out, [2.0, 4.0])
    assert out.dtype == np.float64


def test_aggregate_gradients_is_empty_for_nothing():
    assert DistributedOptimizer.aggregate_gradients([]).shape == (0,)
    assert DistributedOptimizer.aggregate_gradients([upd("a", "l", []), upd("b", "l", [])]).shape == (0,)


def test_sync_advance_step_clears_leftovers():
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    assert opt.advance_step() == 1
    assert opt.current_step == 1
    assert opt.pending_updates_for("fc") == 0
    assert opt.stats().pending_layers == 0


def test_stats_snapshot():
    opt = make(AggregationStrategy.federated_average(2), "w1", "w2", "w3")
    opt.deregister_worker(WorkerId("w3"))
    opt.submit_update(upd("w1", "a", [1.0]), now=1)
    opt.submit_update(upd("w1", "b", [1.0]), now=1)
    opt.submit_update(upd("w2", "b", [3.0]), now=1)
    opt.try_aggregate("b")
    opt.advance_step()
    assert opt.stats() == DistOptimizerStats(
        total_workers=3,
        active_workers=2,
        current_step=1,
        total_aggregations=1,
        dropped_updates=0,
        pending_layers=1,
        pending_updates=1,
    )


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        WorkerNotFound("w9"),
        StaleUpdate("w1", 3, 9, 2),
        DimensionMismatch("fc", 4, 5, "w2"),
        NonFiniteUpdate("w1", "fc", 3, 7, float("nan"), contributor=1),
    ],
)
def test_errors_are_optimizer_errors_and_pickle(exc):
    assert isinstance(exc, OptimizerError) and isinstance(exc, GradcollError)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert {k: repr(v) for k, v in vars(back).items()} == {k: repr(v) for k, v in vars(exc).items()}


def test_error_classes_double_as_builtin_categories():
    assert issubclass(DimensionMismatch, ValueError)
    assert issubclass(WorkerNotFound, LookupError)
    assert issubclass(NonFiniteUpdate, NonFiniteError)
    assert not issubclass(StaleUpdate, ValueError)  # slow workers are normal, not misuse


# --------------------------------------------------------------------------
# Departures from the original (documented in docs/optimizer.md)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy", [AggregationStrategy.federated_average(2), AggregationStrategy.gossip_average(2)]
)
def test_quorum_counts_distinct_workers(strategy):
    opt = make(strategy, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    opt.submit_update(upd("w1", "fc", [5.0]), now=2)  # same layer and step: replaces
    assert opt.pending_updates_for("fc") == 1
    assert opt.stats().replaced_updates == 1
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w1", "fc", [9.0], step=1), now=3)  # another step: kept, still one worker
    assert opt.pending_updates_for("fc") == 2
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w2", "fc", [3.0]), now=4)
    agg = opt.try_aggregate("fc")
    assert agg.contributing_workers == 2 and agg.contributors == ("w1", "w2")  # w1 counts once
    assert agg.contributions == (("w1", 0), ("w1", 1), ("w2", 0))
    np.testing.assert_allclose(agg.values, [(5.0 + 9.0 + 3.0) / 3])


def test_sync_resubmission_replaces_and_counts_once():
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    opt.submit_update(upd("w1", "fc", [3.0]), now=2)
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w2", "fc", [5.0]), now=3)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [4.0])
    assert opt.dropped_updates == 0


def test_sync_mean_uses_only_current_step_updates_of_active_workers():
    opt = make(SYNC, "w1", "w2", "w3")
    opt.deregister_worker(WorkerId("w3"))
    opt.advance_step()
    opt.submit_update(upd("w1", "fc", [100.0], step=0), now=1)  # late: belongs to step 0
    opt.submit_update(upd("w3", "fc", [100.0], step=1), now=1)  # inactive worker
    opt.submit_update(upd("w2", "fc", [4.0], step=2), now=1)  # early: belongs to step 2
    opt.submit_update(upd("w1", "fc", [1.0], step=1), now=1)
    assert opt.try_aggregate("fc") is None
    opt.submit_update(upd("w2", "fc", [3.0], step=1), now=1)
    agg = opt.try_aggregate("fc")
    np.testing.assert_array_equal(agg.values, [2.0])
    assert agg.contributions == (("w1", 1), ("w2", 1))
    assert opt.dropped_updates == 2  # the late step-0 update and the inactive worker's
    assert opt.pending_updates_for("fc") == 1  # the step-2 update waits for its round
    opt.advance_step()
    opt.submit_update(upd("w1", "fc", [6.0], step=2), now=1)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [5.0])


def test_sync_advance_counts_missed_updates_as_dropped_and_keeps_future_ones():
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0], step=0), now=1)
    opt.submit_update(upd("w1", "fc", [1.0], step=1), now=1)
    opt.advance_step()
    assert opt.dropped_updates == 1
    assert opt.pending_updates_for("fc") == 1


def test_async_advance_drops_updates_that_became_too_stale():
    opt = make(AggregationStrategy.asynchronous(1), "w1")
    opt.submit_update(upd("w1", "fc", [1.0], step=0), now=1)
    opt.advance_step()
    assert opt.pending_updates_for("fc") == 1  # staleness 1 is within the bound
    opt.advance_step()
    assert opt.pending_updates_for("fc") == 0
    assert opt.dropped_updates == 1
    assert opt.try_aggregate("fc") is None


def test_async_inverse_staleness_weighting():
    opt = make(AggregationStrategy.asynchronous(5, weighting="inverse_staleness"), "fast", "slow")
    opt.advance_step()
    opt.advance_step()
    opt.submit_update(upd("fast", "fc", [0.0, 4.0], step=2), now=1)  # staleness 0, weight 1
    opt.submit_update(upd("slow", "fc", [3.0, 8.0], step=0), now=1)  # staleness 2, weight 1/3
    agg = opt.try_aggregate("fc")
    np.testing.assert_allclose(agg.weights, [0.75, 0.25])
    np.testing.assert_allclose(agg.values, [0.75, 5.0])


def test_uniform_weights_are_reported():
    opt = make(AggregationStrategy.asynchronous(5), "a", "b", "c", "d")
    for i, w in enumerate("abcd"):
        opt.submit_update(upd(w, "fc", [float(i)]), now=1)
    agg = opt.try_aggregate("fc")
    assert agg.weights == (0.25,) * 4
    np.testing.assert_array_equal(agg.values, [1.5])


def test_aggregate_gradients_refuses_unequal_lengths():
    with pytest.raises(DimensionMismatch, match=r"^dimension mismatch for layer fc: expected 2, got 1$"):
        DistributedOptimizer.aggregate_gradients([upd("a", "fc", [1.0, 2.0]), upd("b", "fc", [1.0])])
    with pytest.raises(DimensionMismatch):
        DistributedOptimizer.aggregate_gradients([upd("a", "fc", []), upd("b", "fc", [1.0])])


def test_aggregate_gradients_weighted_and_bad_weights():
    ups = [upd("a", "l", [1.0]), upd("b", "l", [4.0])]
    np.testing.assert_allclose(DistributedOptimizer.aggregate_gradients(ups, weights=[2, 1]), [2.0])
    for bad in ([1.0], [0.0, 0.0], [-1.0, 2.0], [float("nan"), 1.0]):
        with pytest.raises(UsageError):
            DistributedOptimizer.aggregate_gradients(ups, weights=bad)


def test_reactivate_worker():
    opt = make(SYNC, "w1")
    opt.submit_update(upd("w1", "fc", [1.0]), now=100)
    assert opt.evict_stale_workers(100, 1000) == 1
    assert opt.reactivate_worker(WorkerId("w1"))
    assert opt.active_worker_count() == 1
    assert opt.evict_stale_workers(100, 1000) == 1  # last_seen was not refreshed
    assert opt.reactivate_worker(WorkerId("w1"), now=1000)
    assert opt.evict_stale_workers(100, 1000) == 0
    assert opt.reactivate_worker(WorkerId("w1"))  # already active: still true
    assert not opt.reactivate_worker(WorkerId("ghost"))


def test_register_with_now_protects_fresh_workers_from_eviction():
    opt = DistributedOptimizer(SYNC)
    opt.register_worker(WorkerId("w1"), now=1000)
    assert opt.evict_stale_workers(500, 1200) == 0


def test_last_seen_never_goes_back():
    opt = make(AggregationStrategy.asynchronous(9), "w1")
    opt.submit_update(upd("w1", "fc", [1.0]), now=500)
    opt.submit_update(upd("w1", "fc", [1.0], step=1), now=300)
    assert opt.worker_state("w1").last_seen == 500


def test_strategy_can_be_switched():
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    assert opt.try_aggregate("fc") is None
    opt.strategy = AggregationStrategy.asynchronous(0)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [1.0])
    with pytest.raises(UsageError):
        opt.strategy = "sync"


# --------------------------------------------------------------------------
# Non-finite gradients and the fused kernel
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_update_is_refused_at_submit_and_nothing_is_lost(bad):
    opt = make(AggregationStrategy.federated_average(2), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0, 2.0, 3.0]), now=1)
    with pytest.raises(NonFiniteUpdate) as ei:
        opt.submit_update(upd("w2", "fc", [1.0, bad, 3.0], step=0), now=2)
    e = ei.value
    assert isinstance(e, NonFiniteError)
    assert (e.worker_id, e.layer_id, e.step, e.index) == ("w2", "fc", 0, 1)
    assert e.value == bad or (np.isnan(bad) and np.isnan(e.value))
    assert "worker w2" in str(e) and "layer fc" in str(e)
    assert opt.pending_updates_for("fc") == 1
    assert opt.worker_state("w2").total_updates == 0
    assert opt.dropped_updates == 0
    opt.submit_update(upd("w2", "fc", [3.0, 4.0, 5.0]), now=3)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [2.0, 3.0, 4.0])


def test_the_cheaper_checks_are_reported_first():
    opt = make(AggregationStrategy.asynchronous(0), "w1")
    with pytest.raises(WorkerNotFound):
        opt.submit_update(upd("ghost", "fc", [float("nan")]), now=1)
    opt.advance_step()
    with pytest.raises(StaleUpdate):
        opt.submit_update(upd("w1", "fc", [float("nan")], step=0), now=1)


def test_aggregate_gradients_names_the_non_finite_update():
    ups = [upd("a", "fc", [1.0, 2.0]), upd("b", "fc", [1.0, float("inf")], step=4)]
    with pytest.raises(NonFiniteUpdate) as ei:
        DistributedOptimizer.aggregate_gradients(ups)
    assert (ei.value.worker_id, ei.value.contributor, ei.value.index, ei.value.step) == ("b", 1, 1, 4)
    with pytest.raises(NonFiniteUpdate):
        DistributedOptimizer.aggregate_gradients(ups, weights=[1.0, 1.0])


def test_mean_near_the_float_limit_does_not_overflow():
    big = np.finfo(np.float64).max / 2 * 1.5
    out = DistributedOptimizer.aggregate_gradients([upd("a", "l", [big, -big]), upd("b", "l", [big, -big])])
    np.testing.assert_allclose(out, [big, -big])


def test_the_mean_goes_through_the_fused_kernel(monkeypatch):
    calls = []
    real = gradcoll.kernels.mean_reduce

    def spy(inputs, out=None, **kw):
        calls.append(kw)
        return real(inputs, out, **kw)

    monkeypatch.setattr(gradcoll.kernels, "mean_reduce", spy)
    opt = make(SYNC, "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    opt.submit_update(upd("w2", "fc", [2.0]), now=1)
    opt.try_aggregate("fc")
    assert calls and all(np.dtype(c["accumulate_dtype"]) == np.float64 for c in calls)
    assert all(c.get("check_finite", True) for c in calls)


def test_a_failing_mean_leaves_the_queue_intact(monkeypatch):
    opt = make(AggregationStrategy.gossip_average(2), "w1", "w2")
    opt.submit_update(upd("w1", "fc", [1.0]), now=1)
    opt.submit_update(upd("w2", "fc", [3.0]), now=1)
    real = gradcoll.kernels.mean_reduce

    def broken(inputs, out=None, **kw):
        raise NonFiniteError("planted", contributor=1, index=0, value=float("nan"))

    monkeypatch.setattr(gradcoll.kernels, "mean_reduce", broken)
    with pytest.raises(NonFiniteUpdate) as ei:
        opt.try_aggregate("fc")
    assert ei.value.worker_id == "w2"
    assert opt.pending_updates_for("fc") == 2
    assert opt.stats().total_aggregations == 0
    monkeypatch.setattr(gradcoll.kernels, "mean_reduce", real)
    np.testing.assert_array_equal(opt.try_aggregate("fc").values, [2.0])


# --------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------


def test_gradient_update_is_an_immutable_float64_copy():
    buf = np.array([1, 2, 3], dtype=np.int32)
    u = GradientUpdate("w1", "fc", buf, 2, 7)
    buf[0] = 99
    assert u.gradients.dtype == np.float64 and u.gradients.tolist() == [1.0, 2.0, 3.0]
    assert not u.gradients.flags.writeable
    assert type(u.worker_id) is WorkerId and u.dim == 3
    assert u == GradientUpdate(WorkerId("w1"), "fc", [1.0, 2.0, 3.0], 2, 7)
    assert u != GradientUpdate("w1", "fc", [1.0, 2.0, 4.0], 2, 7)
    with pytest.raises(AttributeError):
        u.step = 3


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(worker_id=1),
        dict(layer_id=None),
        dict(gradients=[[1.0], [2.0]]),
        dict(gradients=["x"]),
        dict(step=-1),
        dict(step=1.5),
        dict(timestamp=-3),
    ],
)
def test_gradient_update_validation(kwargs):
    base = dict(worker_id="w", layer_id="l", gradients=[1.0], step=0, timestamp=0)
    with pytest.raises(UsageError):
        GradientUpdate(**{**base, **kwargs})


def test_worker_id_is_a_string_value():
    w = WorkerId("w1")
    assert w == "w1" and hash(w) == hash("w1") and isinstance(w, str)
    assert repr(w) == "WorkerId('w1')"
    opt = make(SYNC, "w1")
    opt.submit_update(GradientUpdate("w1", "fc", [1.0], 0, 0), now=1)  # plain str accepted too
    assert opt.try_aggregate("fc").contributors == (w,)


def test_strategy_constructors_and_validation():
    s = AggregationStrategy.asynchronous(3)
    assert (s.kind, s.staleness_threshold, s.weighting, s.quorum) == ("asynchronous", 3, "uniform", 1)
    assert AggregationStrategy.federated_average(4).quorum == 4
    assert AggregationStrategy.gossip_average(2).fanout == 2
    assert SYNC.quorum is None
    assert eval(repr(AggregationStrategy.asynchronous(2, "inverse_staleness"))) == AggregationStrategy.asynchronous(
        2, "inverse_staleness"
    )
    for build in (
        lambda: AggregationStrategy.asynchronous(-1),
        lambda: AggregationStrategy.asynchronous(1, weighting="linear"),
        lambda: AggregationStrategy.federated_average(0),
        lambda: AggregationStrategy.gossip_average(0),
        lambda: AggregationStrategy("bulk"),
        lambda: AggregationStrategy("synchronous", rounds=2),
        lambda: AggregationStrategy("federated_average", rounds=2, weighting="inverse_staleness"),
    ):
        with pytest.raises(UsageError):
            build()
    with pytest.raises(UsageError):
        DistributedOptimizer("synchronous")


def test_aggregated_gradient_is_a_value():
    a = AggregatedGradient("fc", [1.0, 2.0], 1, 3, (("w1", 3),), (1.0,))
    assert a == AggregatedGradient("fc", np.array([1.0, 2.0]), 1, 3, ((WorkerId("w1"), 3),), (1.0,))
    assert a.contributors == ("w1",)
    assert not a.values.flags.writeable
    with pytest.raises(UsageError, match="contributors"):  # the old meaning: ids, not a count
        AggregatedGradient("fc", [1.0], ("w1",), 3)
    with pytest.raises(UsageError, match="2 distinct workers"):
        AggregatedGradient("fc", [1.0], 1, 3, (("w1", 3), ("w2", 3)), (0.5, 0.5))


def test_bad_arguments_are_usage_errors():
    opt = make(SYNC, "w1")
    with pytest.raises(UsageError):
        opt.submit_update(upd("w1", "fc", [1.0]), now=-1)
    with pytest.raises(UsageError):
        opt.submit_update("not an update", now=1)
    with pytest.raises(UsageError):
        opt.evict_stale_workers(-5, 10)
    with pytest.raises(UsageError):
        opt.register_worker(42)
    with pytest.raises(WorkerNotFound):
        opt.worker_state("ghost")


# --------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------


def test_eight_submitters_and_an_aggregator_lose_and_duplicate_nothing():
    n_threads, per_thread, layers = 8, 1250, ("l0", "l1", "l2", "l3")
    opt = DistributedOptimizer(AggregationStrategy.asynchronous(10**9))
    for t in range(n_threads):
        opt.register_worker(f"w{t}")
    start = threading.Barrier(n_threads + 1)
    done = threading.Event()
    results: list[AggregatedGradient] = []
    errors: list[BaseException] = []

    def submitter(t: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                # Each update is identified by (worker, layer, step) and carries
                # its own identity in the gradients, so the sums can be checked.
                opt.submit_update(upd(f"w{t}", layers[i % 4], [t, i, 1.0], step=i), now=i)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    def aggregator() -> None:
        try:
            start.wait()
            k = 0
            while not done.is_set():
                for layer in layers:
                    agg = opt.try_aggregate(layer)
                    if agg is not None:
                        results.append(agg)
                k += 1
                if k % 50 == 0:
                    opt.advance_step()  # exercised concurrently; the huge threshold drops nothing
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(n_threads)]
    agg_thread = threading.Thread(target=aggregator)
    for th in threads + [agg_thread]:
        th.start()
    for th in threads:
        th.join(timeout=60)
    done.set()
    agg_thread.join(timeout=60)
    assert not errors, errors
    for layer in layers:  # drain what the aggregator had not seen yet
        agg = opt.try_aggregate(layer)
        if agg is not None:
            results.append(agg)

    seen = [(w, agg.layer_id, s) for agg in results for (w, s) in agg.contributions]
    assert len(seen) == n_threads * per_thread
    assert len(set(seen)) == len(seen)
    assert set(seen) == {(f"w{t}", layers[i % 4], i) for t in range(n_threads) for i in range(per_thread)}
    # The values agree with the contributions: sum of means times counts is the total.
    total = sum(agg.values * len(agg.contributions) for agg in results)
    np.testing.assert_allclose(
        total, [per_thread * sum(range(n_threads)), n_threads * sum(range(per_thread)), n_threads * per_thread]
    )
    st = opt.stats()
    assert (st.dropped_updates, st.replaced_updates, st.pending_updates) == (0, 0, 0)
    assert st.total_aggregations == len(results)
    assert sum(w.total_updates for w in opt.active_workers()) == n_threads * per_thread


def test_synchronous_rounds_from_threads():
    n_threads, steps = 8, 40
    opt = DistributedOptimizer(SYNC)
    for t in range(n_threads):
        opt.register_worker(f"w{t}")
    submitted = threading.Barrier(n_threads + 1)
    advanced = threading.Barrier(n_threads + 1)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for step in range(steps):
                opt.submit_update(upd(f"w{t}", "fc", [t + step, 1.0], step=step), now=step)
                submitted.wait(timeout=30)
                advanced.wait(timeout=30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    try:
        for step in range(steps):
            submitted.wait(timeout=30)
            agg = opt.try_aggregate("fc")
            assert agg is not None and agg.step == step
            assert sorted(agg.contributors) == sorted(f"w{t}" for t in range(n_threads))
            assert agg.contributing_workers == n_threads
            np.testing.assert_allclose(agg.values, [step + (n_threads - 1) / 2, 1.0])
            opt.advance_step()
            advanced.wait(timeout=30)
    except BaseException:
        # Free the workers so the failure is reported instead of a hang.
        submitted.abort()
        advanced.abort()
        raise
    finally:
        for th in threads:
            th.join(timeout=30)
    assert not errors, errors
    assert opt.stats().total_aggregations == steps and opt.dropped_updates == 0


def test_the_parameter_server_example_converges():
    script = Path(__file__).resolve().parents[2] / "examples" / "async_parameter_server.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "steps 400" in run.stdout and "straggler" in run.stdout
    final_loss = float(run.stdout.split("loss ")[1].split(" -> ")[1].split(";")[0])
    assert final_loss < 1e-3

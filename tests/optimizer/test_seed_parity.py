"""API parity with the original DistributedOptimizer: names, argument order, types and units.

Written from the original's documented API (its struct fields, method
signatures and return types), not from gradcoll's behaviour. Where gradcoll
departs on purpose, the test pins the departure that docs/optimizer.md
states, so neither side can drift silently.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcoll import optimizer
from gradcoll.errors import UsageError
from gradcoll.optimizer import (
    AggregatedGradient,
    AggregationStrategy,
    DimensionMismatch,
    DistOptimizerStats,
    DistributedOptimizer,
    GradientUpdate,
    OptimizerDistError,
    StaleUpdate,
    WorkerId,
    WorkerNotFound,
    WorkerState,
)
from tests.helpers import field_names, positional_params


def _two_workers(strategy: AggregationStrategy) -> DistributedOptimizer:
    opt = DistributedOptimizer(strategy)
    opt.register_worker(WorkerId("w1"))
    opt.register_worker(WorkerId("w2"))
    return opt


# -- fields and types -----------------------------------------------------------------------------


def test_aggregated_gradient_contributing_workers_is_a_count() -> None:
    # "How many workers contributed to this aggregation" (an unsigned integer).
    opt = _two_workers(AggregationStrategy.synchronous())
    opt.submit_update(GradientUpdate(WorkerId("w1"), "fc", [1.0, 2.0], 0, 0), 10)
    opt.submit_update(GradientUpdate(WorkerId("w2"), "fc", [3.0, 4.0], 0, 0), 12)
    agg = opt.try_aggregate("fc")
    assert agg is not None
    assert agg.contributing_workers == 2
    assert type(agg.contributing_workers) is int
    assert agg.values.tolist() == [2.0, 3.0]
    assert (agg.layer_id, agg.step) == ("fc", 0)
    # gradcoll's additions, under names of their own.
    assert agg.contributors == ("w1", "w2")
    assert agg.contributions == (("w1", 0), ("w2", 0))
    assert agg.weights == (0.5, 0.5)


def test_contributing_workers_counts_a_worker_once_however_many_steps_it_gave() -> None:
    # Documented departure: the original counted updates (it let one worker fill a quorum).
    opt = _two_workers(AggregationStrategy.federated_average(rounds=2))
    opt.submit_update(GradientUpdate("w1", "fc", [2.0], 0, 0), 1)
    opt.submit_update(GradientUpdate("w1", "fc", [4.0], 1, 0), 2)
    opt.submit_update(GradientUpdate("w2", "fc", [6.0], 0, 0), 3)
    agg = opt.try_aggregate("fc")
    assert agg is not None
    assert agg.contributing_workers == 2 and len(agg.contributions) == 3
    assert agg.values.tolist() == [4.0]


def test_field_names_and_order_of_the_value_types() -> None:
    assert field_names(AggregatedGradient)[:4] == ["layer_id", "values", "contributing_workers", "step"]
    assert field_names(GradientUpdate) == ["worker_id", "layer_id", "gradients", "step", "timestamp"]
    assert field_names(WorkerState) == ["worker_id", "latest_step", "last_seen", "active", "total_updates"]
    assert field_names(DistOptimizerStats)[:6] == ["total_workers", "active_workers", "current_step",
                                               "total_aggregations", "dropped_updates", "pending_layers"]


def test_public_fields_strategy_current_step_dropped_updates() -> None:
    strategy = AggregationStrategy.asynchronous(staleness_threshold=1)
    opt = DistributedOptimizer(strategy)
    assert opt.strategy == strategy
    assert opt.current_step == 0 and type(opt.current_step) is int
    assert opt.dropped_updates == 0 and type(opt.dropped_updates) is int
    opt.strategy = AggregationStrategy.synchronous()  # assignable, as the original's public field
    assert opt.strategy == AggregationStrategy.synchronous()
    # Documented departure: the counters only move through the methods.
    with pytest.raises(AttributeError):
        opt.current_step = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        opt.dropped_updates = 5  # type: ignore[misc]


def test_strategy_variants_and_theirfield_names() -> None:
    # Synchronous | Asynchronous { staleness_threshold } | FederatedAverage { rounds } | GossipAverage { fanout }
    assert AggregationStrategy.synchronous().kind == "synchronous"
    assert AggregationStrategy.asynchronous(staleness_threshold=3).staleness_threshold == 3
    assert AggregationStrategy.federated_average(rounds=2).rounds == 2
    assert AggregationStrategy.gossip_average(fanout=4).fanout == 4


def test_stats_and_worker_state_hold_integers() -> None:
    opt = _two_workers(AggregationStrategy.synchronous())
    opt.submit_update(GradientUpdate("w1", "fc", [1.0], 0, 7), 1234)
    st = opt.stats()
    assert st == DistOptimizerStats(2, 2, 0, 0, 0, 1, 1, 0)
    assert all(type(getattr(st, f)) is int for f in field_names(DistOptimizerStats))
    w1 = next(w for w in opt.active_workers() if w.worker_id == "w1")
    assert (w1.latest_step, w1.last_seen, w1.active, w1.total_updates) == (0, 1234, True, 1)
    assert type(w1.last_seen) is int


# -- methods: names, argument order, results -------------------------------------------------------


def test_method_names_and_argument_order() -> None:
    expected = {
        "register_worker": ["worker_id"],
        "deregister_worker": ["worker_id"],
        "submit_update": ["update", "now"],
        "try_aggregate": ["layer_id"],
        "aggregate_gradients": ["updates"],
        "advance_step": [],
        "active_workers": [],
        "worker_count": [],
        "active_worker_count": [],
        "pending_updates_for": ["layer_id"],
        "last_aggregated": ["layer_id"],
        "evict_stale_workers": ["max_age_ms", "now"],
        "stats": [],
    }
    for name, params in expected.items():
        assert positional_params(getattr(DistributedOptimizer, name)) == params, name
    assert positional_params(DistributedOptimizer) == ["strategy"]


def test_register_and_deregister_return_bools() -> None:
    opt = DistributedOptimizer(AggregationStrategy.synchronous())
    assert opt.register_worker(WorkerId("w1")) is True
    assert opt.register_worker(WorkerId("w1")) is False
    assert opt.deregister_worker(WorkerId("w1")) is True
    assert opt.register_worker(WorkerId("w1")) is False  # present even if inactive
    assert opt.deregister_worker(WorkerId("ghost")) is False
    assert (opt.worker_count(), opt.active_worker_count()) == (1, 0)


def test_submit_returns_nothing_and_errors_are_optimizer_dist_errors() -> None:
    opt = _two_workers(AggregationStrategy.asynchronous(staleness_threshold=1))
    assert opt.submit_update(GradientUpdate("w1", "fc", [1.0, 2.0], 0, 0), 0) is None
    with pytest.raises(WorkerNotFound) as nf:
        opt.submit_update(GradientUpdate("ghost", "fc", [1.0, 2.0], 0, 0), 0)
    with pytest.raises(DimensionMismatch) as dm:
        opt.submit_update(GradientUpdate("w2", "fc", [1.0], 0, 0), 0)
    opt.advance_step()
    opt.advance_step()
    with pytest.raises(StaleUpdate) as su:
        opt.submit_update(GradientUpdate("w2", "fc", [1.0, 2.0], 0, 0), 0)
    for err in (nf.value, dm.value, su.value):
        assert isinstance(err, OptimizerDistError)
    assert OptimizerDistError is optimizer.OptimizerError
    assert str(nf.value) == "worker not found: ghost"
    assert str(dm.value) == "dimension mismatch for layer fc: expected 2, got 1"
    assert str(su.value) == "stale update from worker w2: update step 0, current step 2"


def test_try_aggregate_clears_the_layer_and_stores_the_result() -> None:
    opt = _two_workers(AggregationStrategy.gossip_average(fanout=2))
    opt.submit_update(GradientUpdate("w1", "fc", [0.0], 0, 0), 1)
    assert opt.try_aggregate("fc") is None and opt.pending_updates_for("fc") == 1
    opt.submit_update(GradientUpdate("w2", "fc", [2.0], 0, 0), 1)
    agg = opt.try_aggregate("fc")
    assert agg is not None and agg.values.tolist() == [1.0]
    assert opt.pending_updates_for("fc") == 0
    assert opt.last_aggregated("fc") is agg
    assert opt.last_aggregated("other") is None


def test_aggregate_gradients_is_a_static_elementwise_mean_in_float64() -> None:
    ups = [GradientUpdate("a", "l", [1.0, 2.0], 0, 0), GradientUpdate("b", "l", [3.0, 6.0], 0, 0)]
    out = DistributedOptimizer.aggregate_gradients(ups)
    assert out.tolist() == [2.0, 4.0] and out.dtype == np.float64
    assert len(DistributedOptimizer.aggregate_gradients([])) == 0
    empty = [GradientUpdate("a", "l", [], 0, 0), GradientUpdate("b", "l", [], 0, 0)]
    assert len(DistributedOptimizer.aggregate_gradients(empty)) == 0
    # Documented departure: values are read-only NumPy arrays, not lists.
    assert isinstance(out, np.ndarray) and not out.flags.writeable


def test_advance_step_moves_by_one_and_sync_skips_the_missed_step() -> None:
    opt = _two_workers(AggregationStrategy.synchronous())
    opt.submit_update(GradientUpdate("w1", "fc", [1.0], 0, 0), 1)
    assert opt.advance_step() == 1  # documented departure: returns the new step
    assert opt.current_step == 1
    assert opt.pending_updates_for("fc") == 0  # w2 never submitted: step 0 is skipped
    assert opt.dropped_updates == 1


def test_evict_stale_workers_takes_milliseconds_and_returns_a_count() -> None:
    opt = _two_workers(AggregationStrategy.asynchronous(staleness_threshold=10))
    opt.submit_update(GradientUpdate("w1", "fc", [1.0], 0, 0), 100)
    opt.submit_update(GradientUpdate("w2", "fc", [1.0], 0, 0), 900)
    evicted = opt.evict_stale_workers(500, 1000)  # max_age_ms, now
    assert evicted == 1 and type(evicted) is int
    assert [w.worker_id for w in opt.active_workers()] == ["w2"]


def test_worker_id_is_a_string_value() -> None:
    assert WorkerId("a") == WorkerId("a") and WorkerId("a") != WorkerId("b")
    assert str(WorkerId("worker-1")) == "worker-1"
    assert sorted([WorkerId("c"), WorkerId("a"), WorkerId("b")]) == ["a", "b", "c"]


def test_the_old_tuple_meaning_is_refused_with_a_pointer_to_contributors() -> None:
    with pytest.raises(UsageError, match="contributors"):
        AggregatedGradient("fc", [1.0], (WorkerId("w1"),), 0)  # type: ignore[arg-type]

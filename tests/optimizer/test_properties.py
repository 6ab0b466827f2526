"""Property tests of gradcoll.optimizer: random operation sequences against a small model.

The state machine drives register/deregister/reactivate/submit/aggregate/
advance/evict (and strategy switches) and checks after every step that the
optimizer agrees with a plain-Python model of the original's semantics plus the
documented departures, that counters never go backwards, that ``stats()``
agrees with the individual getters, and that every aggregate is the NumPy
(weighted) mean of exactly the updates it reports, each used at most once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gradcoll.optimizer import (
    AggregationStrategy,
    DimensionMismatch,
    DistributedOptimizer,
    GradientUpdate,
    NonFiniteUpdate,
    StaleUpdate,
    WorkerNotFound,
    WorkerState,
)

WORKERS = ("w0", "w1", "w2", "w3")
LAYERS = ("a", "b")
DIMS = {"a": 3, "b": 1}

strategies = st.one_of(
    st.just(AggregationStrategy.synchronous()),
    st.builds(
        AggregationStrategy.asynchronous,
        st.integers(0, 3),
        st.sampled_from(["uniform", "inverse_staleness"]),
    ),
    st.builds(AggregationStrategy.federated_average, st.integers(1, 4)),
    st.builds(AggregationStrategy.gossip_average, st.integers(1, 4)),
)
times = st.integers(0, 3000)
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
# Mostly the current step (so synchronous rounds complete), sometimes late or early.
offsets = st.sampled_from([0, 0, 0, 0, -1, -2, -3, 1, 2])


@dataclass
class ModelWorker:
    active: bool = True
    last_seen: int = 0
    latest_step: int = 0
    total_updates: int = 0


class OptimizerMachine(RuleBasedStateMachine):
    @initialize(strategy=strategies, initial=st.integers(1, len(WORKERS)))
    def setup(self, strategy, initial):
        self.opt = DistributedOptimizer(strategy)
        self.strategy = strategy
        self.step = 0
        self.workers: dict[str, ModelWorker] = {}
        # layer -> {(worker, step): (serial, gradients)}; dicts keep first-queued order
        self.pending: dict[str, dict[tuple[str, int], tuple[int, np.ndarray]]] = {layer: {} for layer in LAYERS}
        self.serial = 0
        self.used_serials: set[int] = set()
        self.dropped = 0
        self.replaced = 0
        self.aggregations = 0
        self.last_stats = self.opt.stats()
        self.last_totals: dict[str, int] = {}
        for w in WORKERS[:initial]:
            self.membership("register", w, None)

    # -- model helpers -----------------------------------------------------

    def staleness(self, update_step: int) -> int:
        return max(0, self.step - update_step)

    def expired(self, update_step: int) -> bool:
        s = self.strategy
        if s.kind == "synchronous":
            return update_step < self.step
        if s.kind == "asynchronous":
            return self.staleness(update_step) > s.staleness_threshold
        return False

    # -- rules ---------------------------------------------------------------

    @rule(
        action=st.sampled_from(["register", "deregister", "reactivate"]),
        w=st.sampled_from(WORKERS),
        now=st.one_of(st.none(), times),
    )
    def membership(self, action, w, now):
        known = w in self.workers
        if action == "register":
            got = self.opt.register_worker(w) if now is None else self.opt.register_worker(w, now=now)
            assert got == (not known)
            if not known:
                self.workers[w] = ModelWorker(last_seen=now or 0)
        elif action == "deregister":
            assert self.opt.deregister_worker(w) == known
            if known:
                self.workers[w].active = False
        else:
            assert self.opt.reactivate_worker(w, now=now) == known
            if known:
                m = self.workers[w]
                m.active = True
                if now is not None:
                    m.last_seen = max(m.last_seen, now)

    @rule(max_age=st.integers(0, 2000), now=times)
    def evict(self, max_age, now):
        cutoff = max(0, now - max_age)
        victims = [w for w, m in self.workers.items() if m.active and m.last_seen < cutoff]
        assert self.opt.evict_stale_workers(max_age, now) == len(victims)
        for w in victims:
            self.workers[w].active = False

    @rule(
        w=st.sampled_from(WORKERS + ("ghost",)),
        layer=st.sampled_from(LAYERS),
        offset=offsets,
        values=st.lists(finite, min_size=4, max_size=4),
        now=times,
        flavour=st.sampled_from(["ok", "ok", "ok", "ok", "wrong_length", "nan", "inf"]),
    )
    def submit(self, w, layer, offset, values, now, flavour):
        step = max(0, self.step + offset)
        dim = DIMS[layer] + (1 if flavour == "wrong_length" else 0)
        grads = np.array(values[:dim])
        if flavour in ("nan", "inf"):
            grads[-1] = np.nan if flavour == "nan" else -np.inf
        key = (w, step)
        pending = self.pending[layer]
        others = [g for k, (_, g) in pending.items() if k != key]
        update = GradientUpdate(w, layer, grads, step, timestamp=now)

        if w not in self.workers:
            expected = WorkerNotFound
        elif self.strategy.kind == "asynchronous" and self.staleness(step) > self.strategy.staleness_threshold:
            expected = StaleUpdate
        elif others and len(others[0]) != dim:
            expected = DimensionMismatch
        elif flavour in ("nan", "inf"):
            expected = NonFiniteUpdate
        else:
            expected = None

        if expected is not None:
            with pytest.raises(expected):
                self.opt.submit_update(update, now)
            if expected is StaleUpdate:
                self.dropped += 1
            return
        self.opt.submit_update(update, now)
        m = self.workers[w]
        m.latest_step = max(m.latest_step, step)
        m.last_seen = max(m.last_seen, now)
        m.total_updates += 1
        if key in pending:
            self.replaced += 1
        self.serial += 1
        pending[key] = (self.serial, grads)

    @rule(
        layer=st.sampled_from(LAYERS),
        values=st.lists(finite, min_size=3, max_size=3),
        now=times,
        late=st.booleans(),
        then_aggregate=st.booleans(),
    )
    def submit_round(self, layer, values, now, late, then_aggregate):
        """Every active worker submits for the current step, as in a synchronous round.

        Optionally one worker also sends a late update for the previous step
        first, and the layer is aggregated straight after: random rule order
        alone rarely completes a round, and these are the cases that matter.
        """
        active = [w for w, m in self.workers.items() if m.active]
        if late and active:
            self.submit(active[-1], layer, -1, values + [9.0], now, "ok")
        for i, w in enumerate(active):
            self.submit(w, layer, 0, [v + i for v in values] + [0.0], now, "ok")
        if then_aggregate:
            self.aggregate(layer)

    @rule(layer=st.sampled_from(LAYERS))
    def aggregate(self, layer):
        pending = self.pending[layer]
        s = self.strategy
        ready = False
        if s.kind == "synchronous":
            active = {w for w, m in self.workers.items() if m.active}
            chosen = [k for k in pending if k[1] == self.step and k[0] in active]
            ready = bool(pending) and bool(active) and len(chosen) == len(active)
            consumed = [k for k in pending if k[1] <= self.step]
        else:
            chosen = [k for k in pending if not self.expired(k[1])]
            ready = bool(pending) and len({w for w, _ in chosen}) >= s.quorum
            consumed = list(pending)

        agg = self.opt.try_aggregate(layer)
        if not ready:
            assert agg is None
            return
        assert agg is not None
        assert agg.layer_id == layer and agg.step == self.step
        assert sorted(agg.contributions) == sorted(chosen)
        assert list(agg.contributors) == list(dict.fromkeys(w for w, _ in agg.contributions))
        assert agg.contributing_workers == len(agg.contributors)
        # The aggregate is the NumPy (weighted) mean of exactly what it reports.
        rows = np.array([pending[k][1] for k in agg.contributions])
        if s.kind == "asynchronous" and s.weighting == "inverse_staleness":
            raw = np.array([1.0 / (1 + self.staleness(st_)) for _, st_ in agg.contributions])
        else:
            raw = np.ones(len(agg.contributions))
        np.testing.assert_allclose(agg.weights, raw / raw.sum(), rtol=1e-12)
        np.testing.assert_allclose(agg.values, np.average(rows, axis=0, weights=raw), rtol=1e-9, atol=1e-9)
        # No update is ever aggregated twice.
        serials = {pending[k][0] for k in agg.contributions}
        assert not serials & self.used_serials
        self.used_serials |= serials
        assert self.opt.last_aggregated(layer) is agg
        for k in consumed:
            del pending[k]
        self.dropped += len(consumed) - len(chosen)
        self.aggregations += 1

    @rule()
    def advance(self):
        self.step += 1
        assert self.opt.advance_step() == self.step
        if self.strategy.kind in ("synchronous", "asynchronous"):
            for pending in self.pending.values():
                old = [k for k in pending if self.expired(k[1])]
                for k in old:
                    del pending[k]
                self.dropped += len(old)

    @rule(strategy=strategies)
    def switch_strategy(self, strategy):
        self.opt.strategy = strategy
        self.strategy = strategy

    # -- invariants -------------------------------------------------------------

    @invariant()
    def agrees_with_model_and_getters(self):
        opt = self.opt
        stats = opt.stats()
        active = [w for w, m in self.workers.items() if m.active]
        assert stats.total_workers == opt.worker_count() == len(self.workers)
        assert stats.active_workers == opt.active_worker_count() == len(opt.active_workers()) == len(active)
        assert [s.worker_id for s in opt.active_workers()] == active
        assert stats.current_step == opt.current_step == self.step
        assert stats.dropped_updates == opt.dropped_updates == self.dropped
        assert stats.total_aggregations == self.aggregations
        assert stats.replaced_updates == self.replaced
        counts = {layer: opt.pending_updates_for(layer) for layer in LAYERS}
        assert counts == {layer: len(p) for layer, p in self.pending.items()}
        assert stats.pending_updates == sum(counts.values())
        assert stats.pending_layers == sum(1 for c in counts.values() if c)
        for w, m in self.workers.items():
            assert opt.worker_state(w) == WorkerState(w, m.latest_step, m.last_seen, m.active, m.total_updates)

    @invariant()
    def counters_never_go_backwards(self):
        now, before = self.opt.stats(), self.last_stats
        for field in ("current_step", "total_aggregations", "dropped_updates", "replaced_updates", "total_workers"):
            assert getattr(now, field) >= getattr(before, field), field
        totals = {w: self.opt.worker_state(w).total_updates for w in self.workers}
        assert all(totals[w] >= n for w, n in self.last_totals.items())
        self.last_stats, self.last_totals = now, totals


OptimizerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestOptimizerMachine = OptimizerMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 9),
    dim=st.integers(0, 40),
    data=st.data(),
)
def test_aggregate_gradients_matches_numpy(n, dim, data):
    rows = data.draw(st.lists(st.lists(finite, min_size=dim, max_size=dim), min_size=n, max_size=n))
    updates = [GradientUpdate(f"w{i}", "l", r, 0, 0) for i, r in enumerate(rows)]
    out = DistributedOptimizer.aggregate_gradients(updates)
    assert out.dtype == np.float64 and out.shape == (dim,)
    if dim:
        np.testing.assert_allclose(out, np.mean(np.array(rows), axis=0), rtol=1e-12, atol=1e-12)
    weights = data.draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
    out = DistributedOptimizer.aggregate_gradients(updates, weights=weights)
    if dim:
        np.testing.assert_allclose(
            out, np.average(np.array(rows), axis=0, weights=weights), rtol=1e-9, atol=1e-9
        )


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=2, max_size=6).filter(lambda ls: len(set(ls)) > 1))
def test_unequal_lengths_always_raise(lengths):
    updates = [GradientUpdate(f"w{i}", "l", [1.0] * k, 0, 0) for i, k in enumerate(lengths)]
    with pytest.raises(DimensionMismatch) as ei:
        DistributedOptimizer.aggregate_gradients(updates)
    assert ei.value.expected == lengths[0] and ei.value.got != lengths[0]

"""DistributedOptimizer: in-memory bookkeeping that turns worker updates into aggregates.

A parameter server (or any coordinator) registers workers, feeds it their
per-layer gradient updates with ``submit_update``,
asks ``try_aggregate`` whether a layer is ready,
and moves the global step on with ``advance_step``.
The ``AggregationStrategy`` decides when a layer is ready and which
pending updates are too old to use.

Thread safety: one lock guards all state, so workers may submit from many
threads while another thread aggregates. The copy and NaN/Inf scan of an
update happen before the lock is taken; the mean of a layer is computed
under it, so an aggregate and the pending queue it empties never disagree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from . import mean
from .errors import DimensionMismatch, NonFiniteUpdate, StaleUpdate, WorkerNotFound
from .values import (
    ASYNCHRONOUS,
    SYNCHRONOUS,
    AggregatedGradient,
    AggregationStrategy,
    DistOptimizerStats,
    GradientUpdate,
    WorkerId,
    WorkerState,
    as_worker_id,
    count,
)

__all__ = ["DistributedOptimizer"]

# Pending updates of one layer, keyed by (worker, step): a resubmission for the
# same key replaces the earlier update instead of being counted twice.
_Pending = dict[tuple[WorkerId, int], GradientUpdate]


@dataclass
class _Worker:
    """Mutable per-worker record; only ever touched under the optimizer's lock."""

    worker_id: WorkerId
    latest_step: int = 0
    last_seen: int = 0
    active: bool = True
    total_updates: int = 0

    def snapshot(self) -> WorkerState:
        return WorkerState(self.worker_id, self.latest_step, self.last_seen, self.active, self.total_updates)


def _staleness(current_step: int, update_step: int) -> int:
    # Updates from the future (a fast worker) are simply fresh, never negative.
    return max(0, current_step - update_step)


class DistributedOptimizer:
    """Coordinator for gradient aggregation across the workers of a data-parallel job.

    ``strategy`` governs when a layer's pending updates are combined;
    ``backend`` names the kernel backend for the mean (``None``: gradcoll
    picks one). All methods are safe to call from several threads.
    """

    def __init__(self, strategy: AggregationStrategy, *, backend: str | None = None) -> None:
        self._lock = threading.Lock()
        self._strategy = self._check_strategy(strategy)
        self._backend = backend
        self._step = 0
        self._dropped = 0
        self._replaced = 0
        self._aggregations = 0
        self._workers: dict[WorkerId, _Worker] = {}
        self._pending: dict[str, _Pending] = {}
        self._last: dict[str, AggregatedGradient] = {}

    @staticmethod
    def _check_strategy(strategy: AggregationStrategy) -> AggregationStrategy:
        if not isinstance(strategy, AggregationStrategy):
            raise UsageError(f"strategy must be an AggregationStrategy, got {type(strategy).__name__}")
        return strategy

    # -- public fields of the original, as properties -------------------------

    @property
    def strategy(self) -> AggregationStrategy:
        """The aggregation strategy in force (assignable; applies from the next call)."""
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: AggregationStrategy) -> None:
        strategy = self._check_strategy(strategy)
        with self._lock:
            self._strategy = strategy

    @property
    def current_step(self) -> int:
        """The global training step (read-only: it only moves through ``advance_step``)."""
        return self._step

    @property
    def dropped_updates(self) -> int:
        """Updates refused as stale or discarded as too old before they could be aggregated."""
        return self._dropped

    # -- workers ---------------------------------------------------------------

    def register_worker(self, worker_id: str, *, now: int = 0) -> bool:
        """Register a worker; ``False`` if the id is already known, even if inactive."""
        wid = as_worker_id(worker_id)
        now = count("now", now)
        with self._lock:
            if wid in self._workers:
                return False
            self._workers[wid] = _Worker(wid, last_seen=now)
            return True

    def deregister_worker(self, worker_id: str) -> bool:
        """Mark a worker inactive, keeping its record; ``False`` if unknown."""
        with self._lock:
            w = self._workers.get(as_worker_id(worker_id))
            if w is None:
                return False
            w.active = False
            return True

    def reactivate_worker(self, worker_id: str, *, now: int | None = None) -> bool:
        """Mark an evicted or deregistered worker active again; ``False`` if unknown.

        Pass ``now`` to refresh its ``last_seen``, so that the next eviction
        pass does not evict it again straight away.
        """
        now = None if now is None else count("now", now)
        with self._lock:
            w = self._workers.get(as_worker_id(worker_id))
            if w is None:
                return False
            w.active = True
            if now is not None:
                w.last_seen = max(w.last_seen, now)
            return True

    def evict_stale_workers(self, max_age_ms: int, now: int) -> int:
        """Mark inactive every active worker last seen before ``now - max_age_ms``; returns how many."""
        max_age_ms = count("max_age_ms", max_age_ms)
        now = count("now", now)
        cutoff = max(0, now - max_age_ms)
        evicted = 0
        with self._lock:
            for w in self._workers.values():
                if w.active and w.last_seen < cutoff:  # strict: last_seen == cutoff survives
                    w.active = False
                    evicted += 1
        return evicted

    def active_workers(self) -> list[WorkerState]:
        """Snapshots of the active workers, in registration order."""
        with self._lock:
            return [w.snapshot() for w in self._workers.values() if w.active]

    def worker_state(self, worker_id: str) -> WorkerState:
        """Snapshot of one worker, active or not; raises ``WorkerNotFound`` if unknown."""
        wid = as_worker_id(worker_id)
        with self._lock:
            w = self._workers.get(wid)
            if w is None:
                raise WorkerNotFound(wid)
            return w.snapshot()

    def worker_count(self) -> int:
        """Number of registered workers, active or not."""
        with self._lock:
            return len(self._workers)

    def active_worker_count(self) -> int:
        """Number of active workers."""
        with self._lock:
            return sum(1 for w in self._workers.values() if w.active)

    # -- updates -----------------------------------------------------------------

    def submit_update(self, update: GradientUpdate, now: int) -> None:
        """Queue ``update`` for its layer; ``now`` (ms) becomes the worker's ``last_seen``.

        Checks, in order: unknown worker (``WorkerNotFound``); under the
        asynchronous strategy, staleness above the threshold (counted as
        dropped, ``StaleUpdate``); a length differing from the layer's
        pending updates (``DimensionMismatch``); NaN/Inf in the gradients
        (``NonFiniteUpdate``). A refused update changes nothing else. An
        update for a (worker, layer, step) already pending replaces it.
        """
        if not isinstance(update, GradientUpdate):
            raise UsageError(f"submit_update takes a GradientUpdate, got {type(update).__name__}")
        now = count("now", now)
        # The O(n) scan runs before the lock so concurrent submitters overlap;
        # its verdict is reported only after the cheaper checks, in their order.
        bad = mean.first_nonfinite(update.gradients, self._backend)
        key = (update.worker_id, update.step)
        with self._lock:
            w = self._workers.get(update.worker_id)
            if w is None:
                raise WorkerNotFound(update.worker_id)
            s = self._strategy
            # __post_init__ sets staleness_threshold for every asynchronous strategy.
            if s.kind == ASYNCHRONOUS and s.staleness_threshold is not None and _staleness(self._step, update.step) > s.staleness_threshold:
                self._dropped += 1
                raise StaleUpdate(update.worker_id, update.step, self._step, s.staleness_threshold)
            pending = self._pending.get(update.layer_id)
            if pending:
                # All pending updates of a layer share one length; the one this
                # update replaces does not constrain it.
                expected = next((u.dim for k, u in pending.items() if k != key), update.dim)
                if expected != update.dim:
                    raise DimensionMismatch(update.layer_id, expected, update.dim, update.worker_id)
            if bad is not None:
                raise NonFiniteUpdate(update.worker_id, update.layer_id, update.step, bad[0], bad[1])
            w.latest_step = max(w.latest_step, update.step)
            # Submitters race, so `now` can arrive out of order; liveness never goes back.
            w.last_seen = max(w.last_seen, now)
            w.total_updates += 1
            if pending is None:
                pending = self._pending[update.layer_id] = {}
            if key in pending:
                self._replaced += 1
            pending[key] = update

    def _expired(self, update: GradientUpdate, strategy: AggregationStrategy) -> bool:
        """True when ``update`` may no longer be aggregated at the current step."""
        if strategy.kind == SYNCHRONOUS:
            return update.step < self._step
        if strategy.kind == ASYNCHRONOUS and strategy.staleness_threshold is not None:  # always set for this kind
            return _staleness(self._step, update.step) > strategy.staleness_threshold
        return False  # federated and gossip averaging accept updates of any step

    def try_aggregate(self, layer_id: str) -> AggregatedGradient | None:
        """Combine ``layer_id``'s pending updates if the strategy's quorum is met, else ``None``.

        On success the used updates leave the queue, too-old ones are dropped
        (and counted), the result is kept for ``last_aggregated``, and its
        ``step`` is the current step. Nothing changes when ``None`` is returned
        or when the mean raises.
        """
        with self._lock:
            pending = self._pending.get(layer_id)
            if not pending:
                return None
            s = self._strategy
            if s.kind == SYNCHRONOUS:
                active = {wid for wid, w in self._workers.items() if w.active}
                # Only current-step updates of active workers enter the mean;
                # one per worker, since pending is keyed by (worker, step).
                chosen = [u for u in pending.values() if u.step == self._step and u.worker_id in active]
                if not active or len(chosen) != len(active):
                    return None
                # Older steps and inactive workers' updates are consumed as
                # dropped; later steps stay queued for their own round.
                consumed = [k for k, u in pending.items() if u.step <= self._step]
            else:
                chosen = [u for u in pending.values() if not self._expired(u, s)]
                if len({u.worker_id for u in chosen}) < (s.quorum or 1):
                    return None
                consumed = list(pending)
            weights = None
            if s.kind == ASYNCHRONOUS and s.weighting == "inverse_staleness":
                weights = [1.0 / (1 + _staleness(self._step, u.step)) for u in chosen]
            values, norm = mean.combine(chosen, weights, backend=self._backend)
            # Commit only after the mean succeeded: an error leaves the queue intact.
            for k in consumed:
                del pending[k]
            if not pending:
                del self._pending[layer_id]
            self._dropped += len(consumed) - len(chosen)
            result = AggregatedGradient(
                layer_id=layer_id,
                values=values,
                contributing_workers=len({u.worker_id for u in chosen}),
                step=self._step,
                contributions=tuple((u.worker_id, u.step) for u in chosen),
                weights=norm,
            )
            self._last[layer_id] = result
            self._aggregations += 1
            return result

    @staticmethod
    def aggregate_gradients(updates: list[GradientUpdate], *, weights: list[float] | None = None) -> np.ndarray:
        """Element-wise mean of ``updates`` (weighted if ``weights``); empty for no or all-empty updates.

        Unequal lengths raise ``DimensionMismatch`` (the original padded
        with zeros); NaN/Inf raise ``NonFiniteUpdate``.
        """
        return mean.combine(list(updates), weights)[0]

    def advance_step(self) -> int:
        """Move the global step on by one and drop pending updates now too old; returns the new step.

        Synchronous: updates of the finished step (workers that missed it)
        are dropped. Asynchronous: updates now beyond the staleness threshold
        are dropped. Both are counted in ``dropped_updates``.
        """
        with self._lock:
            self._step += 1
            s = self._strategy
            if s.kind in (SYNCHRONOUS, ASYNCHRONOUS):
                for layer_id in list(self._pending):
                    pending = self._pending[layer_id]
                    old = [k for k, u in pending.items() if self._expired(u, s)]
                    for k in old:
                        del pending[k]
                    self._dropped += len(old)
                    if not pending:
                        del self._pending[layer_id]
            return self._step

    # -- inspection --------------------------------------------------------------

    def pending_updates_for(self, layer_id: str) -> int:
        """Number of updates waiting to be aggregated for ``layer_id``."""
        with self._lock:
            return len(self._pending.get(layer_id, ()))

    def last_aggregated(self, layer_id: str) -> AggregatedGradient | None:
        """The most recent aggregate of ``layer_id``, if any."""
        with self._lock:
            return self._last.get(layer_id)

    def stats(self) -> DistOptimizerStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return DistOptimizerStats(
                total_workers=len(self._workers),
                active_workers=sum(1 for w in self._workers.values() if w.active),
                current_step=self._step,
                total_aggregations=self._aggregations,
                dropped_updates=self._dropped,
                pending_layers=len(self._pending),
                pending_updates=sum(len(p) for p in self._pending.values()),
                replaced_updates=self._replaced,
            )

    def __repr__(self) -> str:
        st = self.stats()
        return (
            f"DistributedOptimizer({self._strategy!r}, step={st.current_step}, "
            f"workers={st.active_workers}/{st.total_workers} active, pending_layers={st.pending_layers})"
        )

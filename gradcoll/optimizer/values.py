"""Value types of the distributed optimizer: ids, updates, strategies, results, snapshots.

Every type here is an immutable value. Gradients are stored as read-only
float64 arrays, so an update handed to the optimizer cannot change under it
(the caller keeps its own buffer; we copy once at construction).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = [
    "WorkerId",
    "GradientUpdate",
    "AggregationStrategy",
    "AggregatedGradient",
    "WorkerState",
    "DistOptimizerStats",
    "SYNCHRONOUS",
    "ASYNCHRONOUS",
    "FEDERATED_AVERAGE",
    "GOSSIP_AVERAGE",
]

SYNCHRONOUS = "synchronous"
ASYNCHRONOUS = "asynchronous"
FEDERATED_AVERAGE = "federated_average"
GOSSIP_AVERAGE = "gossip_average"
_KINDS = (SYNCHRONOUS, ASYNCHRONOUS, FEDERATED_AVERAGE, GOSSIP_AVERAGE)
_WEIGHTINGS = ("uniform", "inverse_staleness")


class WorkerId(str):
    """A worker's identity: a string value that hashes and compares like the plain ``str``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"WorkerId({str.__repr__(self)})"


def as_worker_id(value: Any) -> WorkerId:
    """Return ``value`` as a ``WorkerId``; any ``str`` is accepted."""
    if isinstance(value, WorkerId):
        return value
    if not isinstance(value, str):
        raise UsageError(f"a worker id must be a string, got {type(value).__name__}")
    return WorkerId(value)


def count(name: str, value: Any, minimum: int = 0) -> int:
    """Validate a step/time/count argument: an integer >= ``minimum``."""
    if isinstance(value, bool):
        raise UsageError(f"{name} must be an integer, got a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {v}")
    return v


def _frozen_f64(values: Any, what: str) -> np.ndarray:
    """A read-only 1-D float64 copy of ``values``."""
    try:
        arr = np.array(values, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what} must be a 1-D sequence of numbers: {exc}") from exc
    if arr.ndim != 1:
        raise UsageError(f"{what} must be 1-D, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    # Bitwise-style equality that treats NaN == NaN, so an update equals itself.
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


@dataclass(frozen=True, eq=False)
class GradientUpdate:
    """One worker's gradients for one layer at one training step.

    ``gradients`` is stored as a read-only float64 copy; ``timestamp`` is the
    worker's own clock (ms) and is informational: liveness uses the ``now``
    passed to ``DistributedOptimizer.submit_update``.
    """

    worker_id: WorkerId
    layer_id: str
    gradients: np.ndarray
    step: int
    timestamp: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_id", as_worker_id(self.worker_id))
        if not isinstance(self.layer_id, str):
            raise UsageError(f"layer_id must be a string, got {type(self.layer_id).__name__}")
        object.__setattr__(self, "gradients", _frozen_f64(self.gradients, "gradients"))
        object.__setattr__(self, "step", count("step", self.step))
        object.__setattr__(self, "timestamp", count("timestamp", self.timestamp))

    @property
    def dim(self) -> int:
        """Number of gradient elements."""
        return int(self.gradients.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GradientUpdate):
            return NotImplemented
        return (
            (self.worker_id, self.layer_id, self.step, self.timestamp)
            == (other.worker_id, other.layer_id, other.step, other.timestamp)
            and _same_array(self.gradients, other.gradients)
        )


@dataclass(frozen=True)
class AggregationStrategy:
    """When and how pending updates of a layer are combined.

    Build one with the constructors: ``synchronous``,
    ``asynchronous``, ``federated_average``, ``gossip_average``.
    Only the field of the chosen ``kind`` is set.
    """

    kind: str
    staleness_threshold: int | None = None
    rounds: int | None = None
    fanout: int | None = None
    weighting: str = "uniform"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise UsageError(f"unknown aggregation strategy {self.kind!r}; known: {', '.join(_KINDS)}")
        if self.weighting not in _WEIGHTINGS:
            raise UsageError(f"weighting must be one of {', '.join(_WEIGHTINGS)}, got {self.weighting!r}")
        own = {ASYNCHRONOUS: "staleness_threshold", FEDERATED_AVERAGE: "rounds", GOSSIP_AVERAGE: "fanout"}
        for name in ("staleness_threshold", "rounds", "fanout"):
            value = getattr(self, name)
            if name == own.get(self.kind):
                # A threshold of 0 is meaningful (current step only); a quorum of 0 is not.
                minimum = 0 if name == "staleness_threshold" else 1
                object.__setattr__(self, name, count(name, value, minimum))
            elif value is not None:
                raise UsageError(f"{name} does not apply to the {self.kind} strategy")
        if self.kind != ASYNCHRONOUS and self.weighting != "uniform":
            raise UsageError("staleness weighting applies only to the asynchronous strategy")

    @classmethod
    def synchronous(cls) -> AggregationStrategy:
        """Wait until every active worker has submitted for the current step."""
        return cls(SYNCHRONOUS)

    @classmethod
    def asynchronous(cls, staleness_threshold: int, weighting: str = "uniform") -> AggregationStrategy:
        """Aggregate whatever is pending; refuse updates more than ``staleness_threshold`` steps old.

        ``weighting="inverse_staleness"`` weights each update by ``1 / (1 + staleness)``.
        """
        return cls(ASYNCHRONOUS, staleness_threshold=staleness_threshold, weighting=weighting)

    @classmethod
    def federated_average(cls, rounds: int) -> AggregationStrategy:
        """Aggregate once at least ``rounds`` distinct workers have an update pending."""
        return cls(FEDERATED_AVERAGE, rounds=rounds)

    @classmethod
    def gossip_average(cls, fanout: int) -> AggregationStrategy:
        """Aggregate once at least ``fanout`` distinct workers have an update pending."""
        return cls(GOSSIP_AVERAGE, fanout=fanout)

    @property
    def quorum(self) -> int | None:
        """Distinct workers needed to aggregate; ``None`` for synchronous (all active workers)."""
        if self.kind == ASYNCHRONOUS:
            return 1
        if self.kind == FEDERATED_AVERAGE:
            return self.rounds
        if self.kind == GOSSIP_AVERAGE:
            return self.fanout
        return None

    def __repr__(self) -> str:
        if self.kind == SYNCHRONOUS:
            return "AggregationStrategy.synchronous()"
        if self.kind == ASYNCHRONOUS:
            extra = "" if self.weighting == "uniform" else f", weighting={self.weighting!r}"
            return f"AggregationStrategy.asynchronous({self.staleness_threshold}{extra})"
        if self.kind == FEDERATED_AVERAGE:
            return f"AggregationStrategy.federated_average({self.rounds})"
        return f"AggregationStrategy.gossip_average({self.fanout})"


@dataclass(frozen=True, eq=False)
class AggregatedGradient:
    """The combined gradient of one layer.

    The first four fields are the original's: ``values`` is
    ``sum(weights[i] * gradients of contributions[i])``, ``contributing_workers``
    is how many workers contributed (a count), and ``step`` the global step at
    aggregation. gradcoll adds ``contributions``, the ``(worker_id, step)`` of
    every update that went into the mean, in order, and ``weights``, their
    normalised weights (``1/n`` each unless staleness weighting is on);
    ``contributors`` names each contributing worker once.
    """

    layer_id: str
    values: np.ndarray
    contributing_workers: int
    step: int
    contributions: tuple[tuple[WorkerId, int], ...] = ()
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        vals = self.values
        if not (isinstance(vals, np.ndarray) and vals.dtype == np.float64 and not vals.flags.writeable):
            vals = _frozen_f64(vals, "values")
        object.__setattr__(self, "values", vals)
        if isinstance(self.contributing_workers, (list, tuple)):
            raise UsageError("contributing_workers is the number of contributing workers (an int), as in the "
                             "original; their ids are AggregatedGradient.contributors, from contributions")
        object.__setattr__(self, "contributing_workers", count("contributing_workers", self.contributing_workers))
        object.__setattr__(self, "step", count("step", self.step))
        object.__setattr__(self, "contributions", tuple((as_worker_id(w), int(s)) for w, s in self.contributions))
        object.__setattr__(self, "weights", tuple(float(x) for x in self.weights))
        if self.contributions and len(self.contributors) != self.contributing_workers:
            raise UsageError(f"contributing_workers={self.contributing_workers} but contributions name "
                             f"{len(self.contributors)} distinct workers")
        if self.weights and len(self.weights) != len(self.contributions):
            raise UsageError(f"{len(self.weights)} weights for {len(self.contributions)} contributions")

    @property
    def contributors(self) -> tuple[WorkerId, ...]:
        """Each contributing worker once, in the order of ``contributions``."""
        return tuple(dict.fromkeys(w for w, _ in self.contributions))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AggregatedGradient):
            return NotImplemented
        return (
            (self.layer_id, self.contributing_workers, self.step, self.contributions, self.weights)
            == (other.layer_id, other.contributing_workers, other.step, other.contributions, other.weights)
            and _same_array(self.values, other.values)
        )


@dataclass(frozen=True)
class WorkerState:
    """A snapshot of what the optimizer knows about one worker.

    ``last_seen`` is the latest ``now`` at which it submitted (0 if never);
    ``latest_step`` the highest step it submitted.
    """

    worker_id: WorkerId
    latest_step: int
    last_seen: int
    active: bool
    total_updates: int


@dataclass(frozen=True)
class DistOptimizerStats:
    """A consistent snapshot of the optimizer's counters (taken under its lock).

    The first six fields are the original's; ``pending_updates`` (updates
    waiting across all layers) and ``replaced_updates`` (pending updates a
    worker superseded by resubmitting for the same layer and step) are added.
    """

    total_workers: int
    active_workers: int
    current_step: int
    total_aggregations: int
    dropped_updates: int
    pending_layers: int
    pending_updates: int = 0
    replaced_updates: int = 0

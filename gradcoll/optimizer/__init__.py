"""Distributed optimizer: aggregation bookkeeping for a parameter server.

Re-creates the ``DistributedOptimizer`` of ipfrs (pure in-memory,
float64) with its exact semantics and error texts, plus the fixes listed in
``docs/optimizer.md``: quorums count distinct workers, the synchronous mean
uses only current-step updates of active workers, unequal lengths raise
instead of zero-padding, optional staleness weighting, explicit
reactivation, NaN/Inf refusal at submit, and thread safety.
"""

from __future__ import annotations

from .distributed import DistributedOptimizer
from .errors import DimensionMismatch, NonFiniteUpdate, OptimizerDistError, OptimizerError, StaleUpdate, WorkerNotFound
from .values import AggregatedGradient, AggregationStrategy, DistOptimizerStats, GradientUpdate, WorkerId, WorkerState

__all__ = [
    "DistributedOptimizer",
    "AggregationStrategy",
    "GradientUpdate",
    "AggregatedGradient",
    "WorkerId",
    "WorkerState",
    "DistOptimizerStats",
    "OptimizerError",
    "OptimizerDistError",
    "WorkerNotFound",
    "StaleUpdate",
    "DimensionMismatch",
    "NonFiniteUpdate",
]

"""gradcoll: fast, safe gradient averaging across the workers of a data-parallel job."""

from __future__ import annotations

from . import _compat, kernels
from .coordinator import (
    AllReduceResult,
    AveragedBlockResult,
    AveragedNonBlockResult,
    AveragedResult,
    BlockAllReduceResult,
    DistributedConfig,
    GradientServer,
    NonBlockAllReduceResult,
    ShardAssignment,
    WorkerClient,
)
from .errors import (
    BackendUnavailable,
    CollectiveMismatch,
    CollectiveTimeout,
    GradcollError,
    GroupPoisoned,
    NonFiniteError,
    ProtocolError,
    ShrinkFailed,
    TransportAborted,
    TransportBroken,
    TransportClosed,
    TransportError,
    UsageError,
)
from .group import NonMember, ProcessGroup, Work, init_process_group, new_group
from .optimizer import (
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
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

_compat.install()

__all__ = [
    "kernels",
    "GradcollError",
    "UsageError",
    "NonFiniteError",
    "ProtocolError",
    "TransportError",
    "TransportClosed",
    "TransportBroken",
    "TransportAborted",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "GroupPoisoned",
    "ShrinkFailed",
    "BackendUnavailable",
    "init_process_group",
    "new_group",
    "NonMember",
    "Store",
    "HashStore",
    "PrefixStore",
    "TCPStore",
    "FileStore",
    "ProcessGroup",
    "Work",
    "DistributedConfig",
    "GradientServer",
    "WorkerClient",
    "ShardAssignment",
    "AllReduceResult",
    "BlockAllReduceResult",
    "NonBlockAllReduceResult",
    "AveragedResult",
    "AveragedBlockResult",
    "AveragedNonBlockResult",
    "DistributedOptimizer",
    "AggregationStrategy",
    "GradientUpdate",
    "AggregatedGradient",
    "WorkerId",
    "WorkerState",
    "DistOptimizerStats",
    "OptimizerError",
    "WorkerNotFound",
    "StaleUpdate",
    "DimensionMismatch",
    "NonFiniteUpdate",
    "__version__",
]

"""A coordinator and its workers, byte-compatible with entrenar's gradient server (protocol v1).

``GradientServer`` (the coordinator) and ``WorkerClient`` (a
worker) re-create entrenar's API on top of gradcoll: the wire codec is the
sans-I/O ``gradcoll.coordinator.protocol``, each collect is the star algorithm's
gather-reduce-broadcast with the reduction done by the fused
[`gradcoll.kernels.mean_reduce`][gradcoll.kernels.mean_reduce], and every wait is bounded. A Rust
entrenar worker can join a gradcoll coordinator and the reverse. See
docs/coordinator.md.
"""

from __future__ import annotations

from .config import SHARD_POLICIES, DistributedConfig, Role, shard_bounds
from .protocol import DEFAULT_MAX_FRAME, ShardAssignment
from .results import (
    BLOCK_COMPONENTS,
    NON_BLOCK_COMPONENTS,
    AllReduceResult,
    AveragedBlockResult,
    AveragedNonBlockResult,
    AveragedResult,
    BlockAllReduceResult,
    NonBlockAllReduceResult,
)
from .server import GradientServer
from .worker import WorkerClient

__all__ = [
    "DistributedConfig",
    "Role",
    "GradientServer",
    "WorkerClient",
    "ShardAssignment",
    "AllReduceResult",
    "BlockAllReduceResult",
    "NonBlockAllReduceResult",
    "AveragedResult",
    "AveragedBlockResult",
    "AveragedNonBlockResult",
    "BLOCK_COMPONENTS",
    "NON_BLOCK_COMPONENTS",
    "SHARD_POLICIES",
    "DEFAULT_MAX_FRAME",
    "shard_bounds",
]

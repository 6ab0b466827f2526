"""What the coordinator's and the worker's calls return, and the names of the model's components."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "AllReduceResult", "BlockAllReduceResult", "NonBlockAllReduceResult",
    "AveragedResult", "AveragedBlockResult", "AveragedNonBlockResult",
    "BLOCK_COMPONENTS", "NON_BLOCK_COMPONENTS",
]

#: entrenar's nine components of a transformer block, in wire order (contract C-DDP-001).
BLOCK_COMPONENTS = ("w_q", "w_k", "w_v", "w_o", "gate", "up", "down", "input_norm", "post_attn_norm")
#: Non-block components by their wire number.
NON_BLOCK_COMPONENTS = ("lm_head", "final_norm", "embedding")


@dataclass(frozen=True, eq=False)
class AllReduceResult:
    """Coordinator side of ``collect_and_reduce``: the mean gradient and the cluster's metrics."""

    avg_gradients: np.ndarray
    global_loss: float
    total_correct: int
    total_samples: int
    allreduce_ms: float


@dataclass(frozen=True, eq=False)
class BlockAllReduceResult:
    """Coordinator side of ``collect_and_reduce_block``."""

    block_idx: int
    avg_gradients: np.ndarray
    component_sizes: tuple[int, ...]
    allreduce_ms: float


@dataclass(frozen=True, eq=False)
class NonBlockAllReduceResult:
    """Coordinator side of ``collect_and_reduce_non_block``."""

    component: int
    avg_gradients: np.ndarray
    allreduce_ms: float


@dataclass(frozen=True, eq=False)
class AveragedResult:
    """Worker side of an AllReduce: the averaged gradient and the sample-weighted loss."""

    step: int
    gradients: np.ndarray
    global_loss: float


@dataclass(frozen=True, eq=False)
class AveragedBlockResult:
    """Worker side of a block AllReduce."""

    step: int
    block_idx: int
    gradients: np.ndarray
    component_sizes: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class AveragedNonBlockResult:
    """Worker side of a non-block AllReduce."""

    step: int
    component: int
    gradients: np.ndarray

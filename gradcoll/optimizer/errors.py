"""Errors raised by [`DistributedOptimizer`][gradcoll.optimizer.DistributedOptimizer].

All derive from ``OptimizerError`` (a [`GradcollError`][gradcoll.errors.GradcollError]).
The message texts of the three original errors are kept byte for byte
(``worker not found: ID`` and so on); the values they mention are also
attributes, so a handler never has to parse a message.
"""

from __future__ import annotations

from typing import Any

from ..errors import GradcollError, NonFiniteError

__all__ = ["OptimizerError", "OptimizerDistError", "WorkerNotFound", "StaleUpdate", "DimensionMismatch",
           "NonFiniteUpdate"]


class OptimizerError(GradcollError):
    """Base class of every error the distributed optimizer raises on purpose."""


#: The original's name for ``OptimizerError``.
OptimizerDistError = OptimizerError


class WorkerNotFound(OptimizerError, LookupError):
    """An update named a worker that was never registered."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker not found: {worker_id}")

    def __reduce__(self) -> tuple[Any, ...]:  # rebuild from fields, not from the message
        return (type(self), (self.worker_id,))


class StaleUpdate(OptimizerError):
    """An asynchronous update lagged the global step by more than the staleness threshold.

    Not a misuse error: slow workers produce these in normal operation. The
    update was counted in ``dropped_updates`` and discarded.
    """

    def __init__(self, worker_id: str, update_step: int, current_step: int, threshold: int | None = None) -> None:
        self.worker_id = worker_id
        self.update_step = update_step
        self.current_step = current_step
        self.threshold = threshold
        self.staleness = max(0, current_step - update_step)
        super().__init__(
            f"stale update from worker {worker_id}: update step {update_step}, current step {current_step}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.worker_id, self.update_step, self.current_step, self.threshold))


class DimensionMismatch(OptimizerError, ValueError):
    """Gradients of a layer have a different length than the ones they are averaged with."""

    def __init__(self, layer_id: str, expected: int, got: int, worker_id: str | None = None) -> None:
        self.layer_id = layer_id
        self.expected = expected
        self.got = got
        self.worker_id = worker_id
        super().__init__(f"dimension mismatch for layer {layer_id}: expected {expected}, got {got}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.layer_id, self.expected, self.got, self.worker_id))


class NonFiniteUpdate(NonFiniteError, OptimizerError):
    """A worker's update holds NaN or +/-Inf; it was refused and nothing pending changed.

    A [`NonFiniteError`][gradcoll.errors.NonFiniteError] that also names the worker, layer and
    step. ``contributor`` is the update's position when it came from
    ``DistributedOptimizer.aggregate_gradients``, else ``None``.
    """

    def __init__(
        self,
        worker_id: str,
        layer_id: str,
        step: int,
        index: int | None,
        value: float | None,
        contributor: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.layer_id = layer_id
        super().__init__(
            f"non-finite value {value!r} in update from worker {worker_id} for layer {layer_id} "
            f"(step {step}) at element {index}",
            contributor=contributor,
            index=index,
            value=value,
            step=step,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.worker_id, self.layer_id, self.step, self.index, self.value, self.contributor),
        )

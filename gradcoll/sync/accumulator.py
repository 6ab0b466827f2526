"""Gradient accumulation for one sync session: commit, collect, aggregate.

``DistributedGradientAccumulator`` keeps the local gradient and the
gradients of peers (fetched by cid from a block store) and aggregates them
with FedAvg (mean), Sum or WeightedMean through gradcoll's fused kernel
([`gradcoll.kernels.mean_reduce`][gradcoll.kernels.mean_reduce]), so a NaN/Inf or a sum overflow is
caught in the same pass and reported with the peer that sent it.

Where the original was loose, this is strict: a peer id can contribute once,
lengths must agree (the error names the peer), and contributions are reduced
in sorted peer-id order, so every member of a session that aggregates the
same gradients gets the same bits (the original iterated a hash map). The
original's WeightedMean took a list of weights matched against that
unordered map; here each contribution carries its own weight.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from ..errors import CollectiveMismatch, NonFiniteError, UsageError
from .arrow import _as_float32_vector
from .blockstore import BlockStore
from .manifest import CHUNK_ELEMENTS, get_gradient, put_gradient

__all__ = ["Aggregation", "AccumulatorConfig", "DistributedGradientAccumulator", "aggregate_gradients"]


class Aggregation(str, enum.Enum):
    """How contributions are combined."""

    FEDAVG = "fedavg"  # arithmetic mean, as in federated averaging
    MEAN = "mean"  # the same as FEDAVG (the original has both names)
    SUM = "sum"
    WEIGHTED_MEAN = "weighted_mean"  # sum(w_i * g_i) / sum(w_i)


@dataclass(frozen=True)
class AccumulatorConfig:
    """Aggregation strategy and storage settings of an accumulator."""

    strategy: Aggregation = Aggregation.FEDAVG
    chunk_elements: int = CHUNK_ELEMENTS
    check_finite: bool = True
    backend: str | None = None  # kernel backend; None lets gradcoll choose

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _as_aggregation(self.strategy))


def _as_aggregation(value: Aggregation | str) -> Aggregation:
    """``value`` as an ``Aggregation``; a UsageError naming the choices when unknown."""
    try:
        return Aggregation(value)
    except ValueError:
        names = ", ".join(a.value for a in Aggregation)
        raise UsageError(f"unknown aggregation {value!r}; choose one of {names}") from None


def aggregate_gradients(
    contributions: Mapping[str, Any],
    strategy: Aggregation | str = Aggregation.FEDAVG,
    *,
    weights: Mapping[str, float] | None = None,
    check_finite: bool = True,
    backend: str | None = None,
    session_id: str = "",
) -> np.ndarray:
    """Combine ``{peer_id: gradient}`` into one float32 vector (peers reduced in sorted-id order)."""
    strategy = _as_aggregation(strategy)
    if not contributions:
        raise UsageError("aggregate needs at least one contribution, got none")
    where = f"session {session_id!r}: " if session_id else ""
    peers = sorted(contributions)
    rows = [_as_float32_vector(contributions[p]) for p in peers]
    first = peers[0]
    for p, r in zip(peers, rows, strict=True):
        if r.size != rows[0].size:
            raise CollectiveMismatch(
                f"{where}peer {p!r} contributed {r.size} elements, peer {first!r} contributed {rows[0].size}"
            )
    if strategy is Aggregation.WEIGHTED_MEAN:
        rows = _weighted_rows(peers, rows, weights, where)
        op, acc = "sum", np.float64  # the weights already divide; sum in float64 to keep the bits honest
    else:
        op, acc = ("sum" if strategy is Aggregation.SUM else "mean"), None
    if rows[0].size == 0:
        return np.empty(0, dtype=np.float32)
    try:
        result: np.ndarray = kernels.mean_reduce(rows, op=op, check_finite=check_finite, backend=backend, accumulate_dtype=acc)
    except NonFiniteError as exc:
        raise _name_peer(exc, peers, contributions, where, strategy) from exc
    return result


def _weighted_rows(
    peers: list[str], rows: list[np.ndarray], weights: Mapping[str, float] | None, where: str
) -> list[np.ndarray]:
    if weights is None:
        raise UsageError("weighted_mean needs a weight for every contribution, got none")
    ws = []
    for p in peers:
        if p not in weights:
            raise UsageError(f"{where}weighted_mean has no weight for peer {p!r}")
        w = float(weights[p])
        if not math.isfinite(w) or w < 0:
            raise UsageError(f"{where}peer {p!r} has weight {w!r}; weights must be finite and >= 0")
        ws.append(w)
    total = math.fsum(ws)
    if total <= 0:
        raise UsageError(f"{where}weighted_mean weights sum to {total}; at least one must be positive")
    # Scaling first and summing after keeps the one fused pass (and its finite
    # check); a NaN/Inf input stays NaN/Inf after scaling, even by 0.
    return [r * np.float32(w / total) for r, w in zip(rows, ws, strict=True)]


def _name_peer(
    exc: NonFiniteError, peers: list[str], contributions: Mapping[str, Any], where: str, strategy: Aggregation
) -> NonFiniteError:
    j, i = exc.contributor, exc.index
    if j is None or i is None:
        return NonFiniteError(
            f"{where}{strategy.value} overflowed to {exc.value!r} at element {i}", index=i, value=exc.value
        )
    value = float(np.asarray(contributions[peers[j]]).reshape(-1)[i])  # the value the peer sent, before scaling
    return NonFiniteError(
        f"{where}peer {peers[j]!r} sent non-finite value {value!r} at element {i} ({strategy.value})",
        contributor=j,
        index=i,
        value=value,
    )


class DistributedGradientAccumulator:
    """Collects the local gradient and peers' gradients of one session and aggregates them.

    ``peer_id`` is the local contribution's id ("local" by default, as in the
    original); it takes part in the sorted reduction order.
    """

    def __init__(self, session_id: str, config: AccumulatorConfig | None = None, *, peer_id: str = "local") -> None:
        if not isinstance(session_id, str) or not session_id:
            raise UsageError(f"session_id must be a non-empty string, got {session_id!r}")
        self.session_id = session_id
        self.config = config if config is not None else AccumulatorConfig()
        self.peer_id = peer_id
        self.local_gradient: np.ndarray | None = None
        self.peer_gradients: dict[str, np.ndarray] = {}
        self._weights: dict[str, float] = {}

    def commit_local(self, values: Any, store: BlockStore, *, weight: float = 1.0) -> str:
        """Store the local gradient (chunked, under a manifest) and return the manifest's cid."""
        vec = _as_float32_vector(values).copy()  # ours from now on: the caller may reuse its buffer
        cid = put_gradient(store, vec, chunk_elements=self.config.chunk_elements)
        self.local_gradient = vec
        self._weights[self.peer_id] = weight
        return cid

    def add_peer_gradient(self, peer_id: str, cid: str, store: BlockStore, *, weight: float = 1.0) -> None:
        """Fetch peer ``peer_id``'s gradient by manifest cid (hash-verified) and keep it."""
        if not isinstance(peer_id, str) or not peer_id:
            raise UsageError(f"peer_id must be a non-empty string, got {peer_id!r}")
        if peer_id == self.peer_id or peer_id in self.peer_gradients:
            raise UsageError(f"session {self.session_id!r}: peer {peer_id!r} has already contributed")
        grad = get_gradient(store, cid)
        if self.local_gradient is not None and grad.size != self.local_gradient.size:
            raise CollectiveMismatch(
                f"session {self.session_id!r}: peer {peer_id!r} contributed {grad.size} elements, "
                f"the local gradient has {self.local_gradient.size}"
            )
        self.peer_gradients[peer_id] = grad
        self._weights[peer_id] = weight

    def is_ready(self, min_peers: int) -> bool:
        """True when at least ``min_peers`` peer gradients have been collected."""
        return len(self.peer_gradients) >= min_peers

    @property
    def peer_count(self) -> int:
        """Number of peer gradients collected (the local one not counted)."""
        return len(self.peer_gradients)

    def aggregate(self) -> np.ndarray:
        """Aggregate the local and peer gradients with the configured strategy."""
        if self.local_gradient is None:
            raise UsageError(f"session {self.session_id!r}: commit_local must run before aggregate")
        contributions = {self.peer_id: self.local_gradient, **self.peer_gradients}
        return aggregate_gradients(
            contributions,
            self.config.strategy,
            weights=self._weights,
            check_finite=self.config.check_finite,
            backend=self.config.backend,
            session_id=self.session_id,
        )

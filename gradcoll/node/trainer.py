"""Data-parallel training on node hardware: ``serve_trainer`` and friends.

Every rank (rank 0 included) holds one ``TrainSpec``
with its own shard; all ranks first agree, with one allgather, that every
rank accepted its spec and that shards, batch size, parameter count and
epochs are uniform (otherwise the ranks would run different numbers of
steps and the collectives would not line up). Then each step:

1. forward and backward over this rank's next batch, gradients *summed*
   over its lanes (rows);
2. ``buf = [flat gradients..., lanes]`` goes through ``group_mean``;
   both parts become means over ranks, so ``buf[:-1] / buf[-1]`` is the
   gradient averaged over every lane of the step, even when batches differ
   in length;
3. momentum SGD: ``v = momentum * v + g``, ``p -= lr[epoch] * v``.

``train_local`` runs the same steps for several shards in one process,
reducing with NumPy instead of the network: the single-process reference a
distributed run must match to float rounding.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ProtocolError, UsageError
from ..group.process_group import ProcessGroup
from . import wire
from .caps import NodeCaps, collect_caps, platform_tag, send_caps
from .errors import StageRefused
from .reduce import group_mean
from .stage import BoundOp, backward, bind, forward
from .trainspec import TrainSpec
from .weights import Resolver, WeightCache, weight_cache

__all__ = ["TrainMetrics", "TrainReport", "serve_trainer", "serve_trainer_here", "run_trainer",
           "ship_train_spec", "coordinate_trainer", "train_local"]

Log = Callable[[str], None]
#: ``log=`` of the training entry points: a function that takes each progress line, or a flag
#: (the original's form): True writes the lines to stderr, False or None drops them.
LogArg = Log | bool | None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _log_fn(log: LogArg) -> Log | None:
    if log is None or log is False:
        return None
    if log is True:
        return _stderr
    if not callable(log):
        raise UsageError(f"log must be a function taking a line, True (stderr) or False/None, got {log!r}")
    return log


@dataclass(frozen=True)
class TrainMetrics:
    """Counters of one training run (seconds are wall-clock on this rank)."""

    samples: int
    steps: int
    wall_s: float
    compute_s: float
    comm_s: float
    first_loss: float
    last_loss: float


@dataclass(frozen=True)
class TrainReport:
    """What a node did in a training run: its metrics and the final parameters by name."""

    rank: int
    platform: str
    metrics: TrainMetrics
    params: dict[str, np.ndarray] = field(compare=False)


class _Model:
    """Parameters in one flat array (views by name) and the ops bound to them."""

    def __init__(self, spec: TrainSpec, cache: WeightCache) -> None:
        inits = [(name, np.asarray(cache(uri), dtype=spec.dtype)) for name, uri in spec.params]
        self.size = sum(a.size for _, a in inits)
        self.flat = np.empty(self.size, spec.dtype)
        self.params: dict[str, np.ndarray] = {}
        self.slots: list[tuple[str, int, int]] = []
        off = 0
        for name, a in inits:
            view = self.flat[off:off + a.size].reshape(a.shape)
            view[...] = a
            self.params[name] = view
            self.slots.append((name, off, off + a.size))
            off += a.size
        # The ops hold the views themselves, so updating ``flat`` in place updates the model.
        self.bound: tuple[BoundOp, ...] = bind(spec.ops, self.params.__getitem__, spec.dtype)


class _Shard:
    """One rank's rows and the gradient of one batch of them."""

    def __init__(self, spec: TrainSpec, cache: WeightCache) -> None:
        d = spec.data
        if d.pushed_x is not None:
            x, y = d.pushed_x, d.pushed_y
        else:
            x, y = cache(d.x), cache(d.y)  # type: ignore[arg-type]
            if len(x) != len(y) or d.shard_start + d.shard_len > len(x):
                raise UsageError(f"shard [{d.shard_start}, {d.shard_start + d.shard_len}) does not fit data "
                                 f"of {len(x)} x rows and {len(y)} y rows")
            x, y = x[d.shard_start:d.shard_start + d.shard_len], y[d.shard_start:d.shard_start + d.shard_len]
        self.x = np.ascontiguousarray(x, dtype=spec.dtype)
        if spec.loss == "cross_entropy":
            labels = np.asarray(y).reshape(-1)
            if not np.all(labels == np.round(labels)) or labels.min() < 0:
                raise UsageError("cross_entropy needs y to hold class indices >= 0")
            self.y = labels.astype(np.int64)
        else:
            self.y = np.ascontiguousarray(y, dtype=spec.dtype)
        self.spec = spec

    def gradient(self, model: _Model, step: int, buf: np.ndarray, rows: int | None = None) -> float:
        """Fill ``buf`` with [summed gradients..., lanes] of batch ``step``; returns its mean loss."""
        lo = step * self.spec.batch
        hi = min(lo + (rows or self.spec.batch), len(self.x))
        out, caches = forward(model.bound, self.x[lo:hi])
        loss, g = _LOSSES[self.spec.loss](out, self.y[lo:hi])
        grads = backward(model.bound, caches, g)
        for name, a, b in model.slots:
            got = grads.get(name)
            buf[a:b] = 0 if got is None else got.reshape(-1)
        buf[-1] = hi - lo
        return loss / (hi - lo)


def _mse(out: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    diff = out - y.reshape(out.shape)
    feats = diff.shape[-1] if diff.ndim > 1 else 1
    return float((diff * diff).sum()) / feats, diff * (2.0 / feats)


def _cross_entropy(out: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    logits = out.reshape(len(y), -1)
    if y.size and y.max() >= logits.shape[1]:
        raise UsageError(f"class index {int(y.max())} out of range for {logits.shape[1]} logits")
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(np.maximum(p[rows, y], np.finfo(p.dtype).tiny)).sum())
    p[rows, y] -= 1
    return loss, p.reshape(out.shape)


_LOSSES = {"mse": _mse, "cross_entropy": _cross_entropy}


def _train(rank: int, spec: TrainSpec, model: _Model, shards: list[_Shard],
           reduce: Callable[[list[np.ndarray]], np.ndarray], log: Log | None) -> TrainMetrics:
    """The loop of the module doc; ``reduce`` turns the shards' buffers into the mean buffer."""
    bufs = [np.empty(model.size + 1, spec.dtype) for _ in shards]
    v = np.zeros(model.size, spec.dtype)
    compute = comm = 0.0
    samples = steps = 0
    first = last = float("nan")
    start = time.perf_counter()
    for epoch, lr in enumerate(spec.lr):
        for k in range(spec.steps_per_epoch):
            t0 = time.perf_counter()
            losses = [s.gradient(model, k, b) for s, b in zip(shards, bufs, strict=True)]
            samples += int(sum(b[-1] for b in bufs))
            t1 = time.perf_counter()
            mean = reduce(bufs)
            t2 = time.perf_counter()
            v *= spec.momentum
            v += mean[:-1] / mean[-1]
            model.flat -= np.asarray(lr, spec.dtype) * v
            compute += (t1 - t0) + (time.perf_counter() - t2)
            comm += t2 - t1
            last = float(np.mean(losses))
            first = last if steps == 0 else first
            steps += 1
        if log is not None:
            log(f"rank {rank}: epoch {epoch + 1}/{len(spec.lr)} lr {lr:g} loss {last:.6g}")
    return TrainMetrics(samples, steps, time.perf_counter() - start, compute, comm, first, last)


def _agree(group: ProcessGroup, spec: TrainSpec, refusal: str | None, nparams: int) -> None:
    """One allgather: every rank accepted, and shards, batch, params and epochs match (else all raise)."""
    mine = np.array([refusal is None, spec.data.shard_len, spec.batch, nparams, len(spec.lr)], np.float64)
    table = group.allgather(mine)
    refused = [r for r in range(group.size) if not table[r, 0]]
    if refusal is not None:
        raise StageRefused(refusal)
    if refused:
        raise StageRefused(f"rank {group.rank}: ranks {refused} refused the train spec (their errors say why)")
    for col, what in ((1, "shard_len"), (2, "batch"), (3, "parameter count"), (4, "epochs")):
        if len(set(table[:, col])) > 1:
            raise StageRefused(f"rank {group.rank}: train shards are not uniform across ranks: "
                               f"{what} per rank is {[int(x) for x in table[:, col]]}")


def run_trainer(group: ProcessGroup, spec: TrainSpec, resolve: Resolver | None = None, log: LogArg = None,
                caps: NodeCaps | None = None) -> TrainReport:
    """Train ``spec`` on this rank together with every other rank of ``group`` (each calls this once)."""
    say = _log_fn(log)
    caps = caps or NodeCaps.here(group.rank, device="cpu")
    refusal, cause, model, shard = None, None, None, None
    try:
        caps.can_train()
        cache = weight_cache(resolve)
        model, shard = _Model(spec, cache), _Shard(spec, cache)
        # One row forward and back now, so a shape error is a refusal every rank hears about in
        # the agreement below, not a failure halfway through the first step while the others wait.
        shard.gradient(model, 0, np.empty(model.size + 1, spec.dtype), rows=1)
    except Exception as exc:  # (a caller's resolver may raise anything) still join the agreement,
        cause = exc  # so every rank fails together instead of waiting for this one
        refusal = str(exc) if str(exc).startswith(f"rank {group.rank}") else f"rank {group.rank}: {exc}"
    try:
        _agree(group, spec, refusal, 0 if model is None else model.size)
    except StageRefused as exc:
        raise exc from cause
    assert model is not None and shard is not None
    metrics = _train(group.rank, spec, model, [shard],
                     lambda bufs: group_mean(group, bufs[0], float64_accumulate=spec.float64_accumulate), say)
    return TrainReport(group.rank, caps.platform, metrics, {k: v.copy() for k, v in model.params.items()})


def serve_trainer(group: ProcessGroup, caps: NodeCaps, resolve: Resolver | None = None,
                  log: LogArg = None) -> TrainReport:
    """Serve as a training worker: announce ``caps``, receive the TrainSpec rank 0 ships, train."""
    if group.rank == 0:
        raise UsageError("rank 0 is the coordinator: use coordinate_trainer (or ship_train_spec + run_trainer)")
    log = _log_fn(log)  # a bad log= fails here, before rank 0 waits on this rank
    send_caps(group, caps)
    doc = wire.recv_json(group, 0, "train")
    try:
        spec = TrainSpec.from_dict(doc.get("spec") if doc else None)
    except UsageError as exc:
        raise ProtocolError(f"rank {group.rank}: rank 0 shipped an invalid train spec: {exc}") from exc
    return run_trainer(group, spec, resolve, log, caps)


def serve_trainer_here(group: ProcessGroup, resolve: Resolver | None = None, log: LogArg = None) -> TrainReport:
    """``serve_trainer`` with capabilities derived from this node."""
    return serve_trainer(group, NodeCaps.here(group.rank), resolve, log)


def ship_train_spec(group: ProcessGroup, rank: int, spec: TrainSpec, timeout: float | None = None) -> None:
    """Coordinator: send ``spec`` to worker ``rank`` (refusals surface in the agreement step)."""
    if group.rank != 0 or not 0 < rank < group.size or not isinstance(spec, TrainSpec):
        raise UsageError(f"ship_train_spec runs on rank 0 with a TrainSpec and a worker rank; got rank {rank!r}")
    wire.send_json(group, rank, {"type": "train", "spec": spec.to_dict()}, timeout)


def coordinate_trainer(group: ProcessGroup, specs: Sequence[TrainSpec], resolve: Resolver | None = None,
                       log: LogArg = None) -> TrainReport:
    """Coordinator: collect caps, ship ``specs[r]`` to every worker r, and train ``specs[0]`` here."""
    if len(specs) != group.size:
        raise UsageError(f"coordinate_trainer needs one spec per rank ({group.size}), got {len(specs)}")
    say = _log_fn(log)
    caps = collect_caps(group)
    if say is not None:
        say("rank 0: workers " + ", ".join(f"{c.rank}:{c.role.kind}@{c.platform}/{c.devices[0]}" for c in caps))
    for r in range(1, group.size):
        ship_train_spec(group, r, specs[r])
    return run_trainer(group, specs[0], resolve, say)


def train_local(specs: TrainSpec | Sequence[TrainSpec], resolve: Resolver | None = None,
                log: LogArg = None) -> TrainReport:
    """Run the data-parallel loop for every spec's shard in this process (the single-process reference)."""
    specs = [specs] if isinstance(specs, TrainSpec) else list(specs)
    if not specs:
        raise UsageError("train_local needs at least one spec")
    say = _log_fn(log)
    cache = weight_cache(resolve)
    model = _Model(specs[0], cache)
    shards = [_Shard(s, cache) for s in specs]
    if len({(s.data.shard_len, s.batch, len(s.lr)) for s in specs}) > 1:
        raise StageRefused("train shards are not uniform: shard_len, batch and epochs must match")
    acc = np.float64 if specs[0].float64_accumulate else specs[0].dtype

    def reduce(bufs: list[np.ndarray]) -> np.ndarray:
        # The single-process reference stays independent of gradcoll's kernels on purpose:
        # tests compare the distributed run (which reduces through them) against this.
        return np.mean(np.stack(bufs), axis=0, dtype=acc).astype(specs[0].dtype)

    metrics = _train(0, specs[0], model, shards, reduce, say)
    return TrainReport(0, platform_tag(), metrics, {k: v.copy() for k, v in model.params.items()})

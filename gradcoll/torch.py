"""PyTorch gradient sync over a gradcoll ProcessGroup (optional extra ``torch``).

Two ways to average ``.grad`` across ranks after ``loss.backward()``:

* ``sync_gradients`` -- one call after ``backward()``: parameters are
  packed into buckets of about ``bucket_mb`` MiB, one fused, finite-checked
  allreduce per bucket.
* ``GradientSynchronizer`` -- hooks fire as each parameter's gradient is
  accumulated, and a bucket's asynchronous allreduce starts as soon as the
  bucket is complete, overlapping the rest of ``backward()`` (like
  DistributedDataParallel). Call ``GradientSynchronizer.wait`` before
  ``optimizer.step()``.

Buckets follow the reverse order of ``model.parameters()`` (the order in which
backward produces gradients) and are identical on every rank. A parameter
without a gradient on this rank contributes zeros, so unused parameters and
ranks that skip a branch still agree on the layout. A NaN or Inf in any
rank's gradient raises [`gradcoll.NonFiniteError`][gradcoll.errors.NonFiniteError] on every rank, naming
the rank and the parameter. CPU tensors are used without copies into the
reduction (their memory is viewed as NumPy arrays); the bucket copy is the
one fusion copy that DDP makes too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import NonFiniteError, UsageError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("gradcoll.torch needs PyTorch: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)") from exc

__all__ = ["sync_gradients", "GradientSynchronizer", "make_buckets"]

_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


@dataclass
class _Bucket:
    """Parameters reduced together, and the flat buffer they are packed into."""

    index: int
    params: list[tuple[str, torch.nn.Parameter]]
    offsets: list[int]
    buf: np.ndarray
    ready: set[int] = field(default_factory=set)
    work: Any = None

    def pack(self) -> None:
        """Copy every gradient (zeros where there is none) into the flat buffer."""
        for (_, p), off in zip(self.params, self.offsets, strict=True):
            n = p.numel()
            dst = self.buf[off : off + n]
            if p.grad is None:
                dst[...] = 0
            else:
                dst[...] = _as_numpy(p.grad).reshape(-1)

    def unpack(self) -> None:
        """Copy the averaged values back into every ``.grad`` (creating missing ones)."""
        for (_, p), off in zip(self.params, self.offsets, strict=True):
            n = p.numel()
            src = torch.from_numpy(self.buf[off : off + n]).view(p.shape)
            if p.grad is None:
                p.grad = src.clone()
            else:
                p.grad.copy_(src)

    def name_of(self, index: int | None) -> str:
        """The parameter holding flat element ``index`` of the bucket."""
        if index is None:
            return "?"
        for (name, p), off in zip(self.params, self.offsets, strict=True):
            if off <= index < off + p.numel():
                return f"{name}[{index - off}]"
        return "?"


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise UsageError(f"gradcoll.torch syncs CPU tensors; got a tensor on {t.device} (see docs for GPU staging)")
    if t.dtype not in _NP:
        raise UsageError(f"gradient dtype {t.dtype} is not supported (float16, float32, float64)")
    arr: np.ndarray = t.detach().numpy()  # typed here: without torch installed mypy sees Any
    return arr


def make_buckets(model: torch.nn.Module, bucket_mb: float = 25.0) -> list[_Bucket]:
    """Group trainable parameters, in reverse order, into same-dtype buckets of about ``bucket_mb`` MiB."""
    if bucket_mb <= 0:
        raise UsageError(f"bucket_mb must be positive, got {bucket_mb}")
    limit = int(bucket_mb * (1 << 20))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise UsageError("the model has no trainable parameters")
    buckets: list[_Bucket] = []
    cur: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in reversed(named):
        if p.dtype not in _NP:
            raise UsageError(f"parameter {name} has dtype {p.dtype}; supported: float16, float32, float64")
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > limit or cur[0][1].dtype != p.dtype):
            buckets.append(_new_bucket(len(buckets), cur))
            cur, size = [], 0
        cur.append((name, p))
        size += nbytes
    buckets.append(_new_bucket(len(buckets), cur))
    return buckets


def _new_bucket(index: int, params: list[tuple[str, torch.nn.Parameter]]) -> _Bucket:
    offsets, off = [], 0
    for _, p in params:
        offsets.append(off)
        off += p.numel()
    return _Bucket(index, params, offsets, np.zeros(off, _NP[params[0][1].dtype]))


def _reraise(exc: NonFiniteError, bucket: _Bucket) -> None:
    where = bucket.name_of(exc.index)
    raise NonFiniteError(
        f"{exc} -> parameter {where}", contributor=exc.contributor, index=exc.index, value=exc.value,
        rank=exc.rank, seq=exc.seq, step=exc.step,
    ) from exc


def sync_gradients(model: torch.nn.Module, group: Any, bucket_mb: float = 25.0, *, check_finite: bool = True,
                   buckets: list[_Bucket] | None = None) -> None:
    """Average every parameter's ``.grad`` across ``group`` (call after ``backward()``)."""
    for b in buckets if buckets is not None else make_buckets(model, bucket_mb):
        b.pack()
        try:
            group.allreduce(b.buf, op="mean", check_finite=check_finite)
        except NonFiniteError as exc:
            _reraise(exc, b)
        b.unpack()


class GradientSynchronizer:
    """Overlap gradient averaging with ``backward()`` through post-accumulate-grad hooks."""

    def __init__(self, model: torch.nn.Module, group: Any, bucket_mb: float = 25.0, *, check_finite: bool = True) -> None:
        self.model = model
        self.group = group
        self.check_finite = check_finite
        self.buckets = make_buckets(model, bucket_mb)
        self._next = 0  # buckets start strictly in index order, the same on every rank
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._handles = []
        for b in self.buckets:
            for i, (_, p) in enumerate(b.params):
                self._where[id(p)] = (b, i)
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        b.ready.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            self._start(b)

    def _start(self, b: _Bucket) -> None:
        b.pack()
        b.work = self.group.allreduce(b.buf, op="mean", check_finite=self.check_finite, async_op=True)
        self._next += 1

    def wait(self, timeout: float | None = None) -> None:
        """Finish every bucket (unused parameters count as zeros) and write the averages into ``.grad``."""
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        first: BaseException | None = None
        for b in self.buckets:
            try:
                b.work.wait(timeout)
                b.unpack()
            except NonFiniteError as exc:
                if first is None:
                    try:
                        _reraise(exc, b)
                    except NonFiniteError as named:
                        first = named
            except BaseException as exc:  # keep draining so no Work is left behind
                first = first or exc
            finally:
                b.ready.clear()
                b.work = None
        self._next = 0
        if first is not None:
            raise first

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "GradientSynchronizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


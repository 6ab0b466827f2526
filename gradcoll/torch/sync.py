"""Gradient sync over a gradcoll ProcessGroup, without torch.distributed.

Two ways to average ``.grad`` across ranks after ``loss.backward()``:

* ``sync_gradients`` -- one call after ``backward()``: parameters are
  packed into buckets of about ``bucket_mb`` MiB, one fused, finite-checked
  allreduce per bucket.
* ``GradientSynchronizer`` -- hooks fire as each parameter's gradient is
  accumulated, and a bucket's asynchronous allreduce starts as soon as the
  bucket is complete, overlapping the rest of ``backward()`` (like
  DistributedDataParallel). Call ``GradientSynchronizer.wait`` before
  ``optimizer.step()``. Built, it first checks that every rank built the
  same buckets and copies rank 0's parameters and buffers to every rank,
  as DDP does.

Buckets follow the reverse order of ``model.parameters()`` (the order in which
backward produces gradients) and are identical on every rank. A parameter
without a gradient on this rank contributes zeros, so unused parameters and
ranks that skip a branch still agree on the layout. A NaN or Inf in any
rank's gradient raises [`NonFiniteGradientError`][gradcoll.torch.NonFiniteGradientError]
(a `gradcoll.NonFiniteError` and a ``RuntimeError``) on every rank, naming
the rank and the parameter. CPU tensors are used without copies into the
reduction (their memory is viewed as NumPy arrays); the bucket copy is the
one fusion copy that DDP makes too. bfloat16 buckets travel as bf16 and are
accumulated in float32.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import NonFiniteError, UsageError
from ._tensors import REDUCE_DTYPES, NonFiniteGradientError, as_array

__all__ = ["sync_gradients", "GradientSynchronizer", "make_buckets", "broadcast_state", "check_same_layout"]


@dataclass
class _Bucket:
    """Parameters reduced together, and the flat buffer they are packed into."""

    index: int
    params: list[tuple[str, torch.nn.Parameter]]
    offsets: list[int]
    buf: np.ndarray
    ready: set[int] = field(default_factory=set)
    work: Any = None

    @property
    def wire(self) -> str | None:
        """``"bf16"`` for a bfloat16 bucket (its buffer holds the bits), else None."""
        return "bf16" if self.params[0][1].dtype == torch.bfloat16 else None

    def pack(self) -> None:
        """Copy every gradient (zeros where there is none) into the flat buffer."""
        for (_, p), off in zip(self.params, self.offsets, strict=True):
            n = p.numel()
            dst = self.buf[off : off + n]
            if p.grad is None:
                dst[...] = 0
            else:
                dst[...] = as_array(p.grad, "gradient").reshape(-1)

    def unpack(self) -> None:
        """Copy the averaged values back into every ``.grad`` (creating missing ones)."""
        for (_, p), off in zip(self.params, self.offsets, strict=True):
            chunk = self.buf[off : off + p.numel()]
            src = torch.from_numpy(chunk.view(np.int16)).view(p.dtype) if self.wire else torch.from_numpy(chunk)
            if p.grad is None:
                p.grad = src.view(p.shape).clone()
            else:
                p.grad.copy_(src.view(p.shape))

    def name_of(self, index: int | None) -> str:
        """The parameter holding flat element ``index`` of the bucket."""
        if index is None:
            return "?"
        for (name, p), off in zip(self.params, self.offsets, strict=True):
            if off <= index < off + p.numel():
                return f"{name}[{index - off}]"
        return "?"


def make_buckets(model: torch.nn.Module, bucket_mb: float = 25.0, *, group: Any = None) -> list[_Bucket]:
    """Group trainable parameters, in reverse order, into same-dtype buckets of about ``bucket_mb`` MiB.

    With ``group``, a bucket's buffer comes from the group's own memory
    (``group.alloc``) where the group has one.
    """
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
        if p.dtype not in REDUCE_DTYPES:
            raise UsageError(f"parameter {name} has dtype {p.dtype}; supported: float16, bfloat16, float32, float64")
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > limit or cur[0][1].dtype != p.dtype):
            buckets.append(_new_bucket(len(buckets), cur, group))
            cur, size = [], 0
        cur.append((name, p))
        size += nbytes
    buckets.append(_new_bucket(len(buckets), cur, group))
    return buckets


def _new_bucket(index: int, params: list[tuple[str, torch.nn.Parameter]], group: Any) -> _Bucket:
    offsets, off = [], 0
    for _, p in params:
        offsets.append(off)
        off += p.numel()
    dtype = np.dtype(REDUCE_DTYPES[params[0][1].dtype])
    # Where the group can give memory in a shared window (ranks that share memory), the bucket lives there and
    # is reduced where it lies; alloc is collective, and shared_memory is the same on every rank.
    alloc = getattr(group, "alloc", None)
    shared = bool(getattr(getattr(group, "transport", None), "shared_memory", False))
    if callable(alloc) and shared and dtype in (np.float32, np.float64):
        buf = np.asarray(alloc(off, dtype))
    else:
        buf = np.empty(off, dtype)
    buf[...] = 0
    return _Bucket(index, params, offsets, buf)


def _reraise(exc: NonFiniteError, bucket: _Bucket) -> None:
    where = bucket.name_of(exc.index)
    raise NonFiniteGradientError(
        f"{exc} -> parameter {where}", contributor=exc.contributor, index=exc.index, value=exc.value,
        rank=exc.rank, seq=exc.seq, step=exc.step,
    ) from exc


def sync_gradients(model: torch.nn.Module, group: Any, bucket_mb: float = 25.0, *, check_finite: bool = True,
                   buckets: list[_Bucket] | None = None) -> None:
    """Average every parameter's ``.grad`` across ``group`` (call after ``backward()``)."""
    for b in buckets if buckets is not None else make_buckets(model, bucket_mb, group=group):
        b.pack()
        try:
            group.allreduce(b.buf, op="mean", check_finite=check_finite, wire_dtype=b.wire)
        except NonFiniteError as exc:
            _reraise(exc, b)
        b.unpack()


def _layout(buckets: list[_Bucket]) -> list[list[Any]]:
    return [[b.index, name, list(p.shape), str(p.dtype)] for b in buckets for name, p in b.params]


def check_same_layout(buckets: list[_Bucket], group: Any) -> None:
    """Raise UsageError on every rank unless every rank built the same buckets (shapes and dtypes, in order).

    One allgather of a digest; only when the digests differ, a second round
    gathers the layouts themselves to name the first difference.
    """
    layout = _layout(buckets)
    digest = hashlib.sha256(repr([[i, s, d] for i, _, s, d in layout]).encode()).digest()
    digests = group.allgather(np.frombuffer(digest, np.uint8).copy())
    if (digests == digests[0]).all():
        return
    mine = json.dumps(layout).encode()
    lengths = group.allgather(np.array([len(mine)], np.int64))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(mine)] = np.frombuffer(mine, np.uint8)
    rows = group.allgather(padded)
    layouts = [json.loads(bytes(rows[r][: int(lengths[r][0])])) for r in range(group.size)]
    raise UsageError(f"rank {group.rank}: GradientSynchronizer: the ranks built different buckets; every rank needs "
                     f"the same model (parameter shapes and dtypes, in the same order): {_difference(layouts)}")


def _difference(layouts: list[list[list[Any]]]) -> str:
    ref = layouts[0]
    for r, other in enumerate(layouts[1:], start=1):
        for pos, (a, b) in enumerate(zip(ref, other, strict=False)):
            if [a[0], a[2], a[3]] != [b[0], b[2], b[3]]:
                return (f"rank {r}'s parameter {b[1]!r} is {tuple(b[2])} {b[3]} where rank 0's {a[1]!r} is "
                        f"{tuple(a[2])} {a[3]} (bucket {a[0]}, position {pos} in backward order)")
        if len(other) != len(ref):
            return f"rank {r} has {len(other)} trainable parameters, rank 0 has {len(ref)}"
    return "the layouts differ"  # unreachable: the digests differed


def broadcast_state(model: torch.nn.Module, group: Any, root: int = 0) -> None:
    """Copy ``root``'s parameters and buffers into every rank's ``model`` (one broadcast per dtype)."""
    tensors: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*model.parameters(), *model.buffers()]:
        tensors.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in tensors.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            group.broadcast(as_array(flat, "parameters").view(np.uint8), root=root)
            off = 0
            for t in ts:
                t.copy_(flat[off : off + t.numel()].view(t.shape))
                off += t.numel()


class GradientSynchronizer:
    """Overlap gradient averaging with ``backward()`` through post-accumulate-grad hooks.

    Built, it checks that every rank built the same buckets (a mismatch is
    a UsageError on every rank, naming the first different parameter) and,
    with ``broadcast_parameters`` (default), copies rank 0's parameters and
    buffers to every rank, so that the ranks start from the same model.
    """

    def __init__(self, model: torch.nn.Module, group: Any, bucket_mb: float = 25.0, *, check_finite: bool = True,
                 broadcast_parameters: bool = True) -> None:
        self.model = model
        self.group = group
        self.check_finite = check_finite
        self.buckets = make_buckets(model, bucket_mb, group=group)
        check_same_layout(self.buckets, group)
        if broadcast_parameters:
            broadcast_state(model, group)
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
        b.work = self.group.allreduce(b.buf, op="mean", check_finite=self.check_finite, async_op=True,
                                      wire_dtype=b.wire)
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

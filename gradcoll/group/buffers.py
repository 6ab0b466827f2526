"""One place that turns user objects into buffers gradcoll can work on.

Accepted, without copying: NumPy arrays, PyTorch CPU tensors, anything with
``__array_interface__`` or the buffer protocol, and CPU DLPack producers.
Device arrays (``__cuda_array_interface__``: numba device arrays, CuPy, torch
CUDA tensors) are recognised as such and handed to the CUDA path. Everything
else is a ``TypeError`` naming the object; a non-contiguous view is a
``ValueError`` (gradcoll works in place and never copies silently into the
wrong memory); so is a read-only buffer where the result must be written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms import REDUCE_DTYPES
from ..errors import UsageError

__all__ = ["Buffer", "as_buffer", "is_device_array", "is_half", "tensor_wire", "writable_array"]


@dataclass(frozen=True)
class Buffer:
    """A user object seen as an array: ``array`` shares the object's memory."""

    array: Any  # np.ndarray for host buffers, a numba device array for device buffers
    device: bool
    source: str  # what the object was, for messages: "numpy", "torch", "dlpack", "cuda", "buffer"


def _describe(obj: Any) -> str:
    t = type(obj)
    shape = getattr(obj, "shape", None)
    return f"{t.__module__}.{t.__qualname__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def is_device_array(obj: Any) -> bool:
    """True for objects living in GPU memory (CUDA array interface or numba's simulator arrays)."""
    if isinstance(obj, np.ndarray):
        return False
    if hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__cuda_ndarray__"):
        return True
    dev = getattr(obj, "device", None)
    return getattr(dev, "type", None) == "cuda"


def _torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "numpy") and hasattr(obj, "is_contiguous")


def _torch_numpy(t: Any) -> np.ndarray:
    """A CPU tensor's memory; a bfloat16 tensor's as its uint16 bits (torch's ``.numpy()`` refuses bfloat16)."""
    t = t.detach()
    if str(t.dtype) == "torch.bfloat16":
        import torch

        bits: np.ndarray = t.view(torch.int16).numpy().view(np.uint16)
        return bits
    arr: np.ndarray = t.numpy()
    return arr


def tensor_wire(obj: Any, op: str, wire: str | None) -> str | None:
    """The wire format a torch float16/bfloat16 tensor is summed or averaged in (float32 accumulation), else ``wire``.

    A bfloat16 tensor is viewed as its uint16 bits (``as_buffer``), which only
    the bf16 wire path reads as numbers: it is refused for other ops.
    """
    if isinstance(obj, np.ndarray) or not _torch_tensor(obj):
        return wire
    fmt = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}.get(str(obj.dtype))
    if fmt is None:
        return wire
    if op not in ("mean", "sum"):
        if fmt == "bf16":
            raise UsageError(f"a bfloat16 tensor is reduced with op 'mean' or 'sum' (accumulated in float32), "
                             f"not {op!r}; reduce t.float() for max or min")
        return wire
    if wire not in (None, fmt):
        raise UsageError(f"a {obj.dtype} tensor travels as {fmt}, not {wire}")
    return fmt


def as_buffer(obj: Any, *, writable: bool = True, what: str = "buf") -> Buffer:
    """View ``obj`` as an array without copying; refuse what cannot be used in place."""
    if is_device_array(obj):
        from numba import cuda

        arr = obj if hasattr(obj, "__cuda_ndarray__") else cuda.as_cuda_array(obj)
        if not arr.is_c_contiguous():
            raise UsageError(f"{what}: {_describe(obj)} is not C-contiguous; pass a contiguous device array")
        return Buffer(arr, True, "cuda")
    if isinstance(obj, np.ndarray):
        arr, source = obj, "numpy"
    elif _torch_tensor(obj):
        if not obj.is_contiguous():
            raise UsageError(f"{what}: {_describe(obj)} is not contiguous; call .contiguous() on it first")
        arr, source = _torch_numpy(obj), "torch"
    elif hasattr(obj, "__array_interface__") or hasattr(obj, "__array__") and not hasattr(obj, "__dlpack__"):
        arr, source = np.asarray(obj), "array"
    elif hasattr(obj, "__dlpack__"):
        try:
            arr, source = np.from_dlpack(obj), "dlpack"
        except (TypeError, RuntimeError, BufferError) as exc:
            raise TypeError(f"{what}: cannot read {_describe(obj)} through DLPack on the CPU: {exc}") from exc
    else:
        try:
            memoryview(obj)
        except TypeError:
            raise TypeError(
                f"{what}: unsupported object {_describe(obj)}; pass a NumPy array, a torch tensor, "
                "a DLPack or CUDA-array-interface object, or a buffer"
            ) from None
        arr, source = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, memoryview) else np.asarray(obj), "buffer"
    if not arr.flags.c_contiguous:
        raise UsageError(f"{what}: {_describe(obj)} is not C-contiguous; collectives work in place, so pass a contiguous buffer")
    if writable and not arr.flags.writeable:
        raise UsageError(f"{what}: {_describe(obj)} is read-only; collectives write the result into it")
    return Buffer(arr, False, source)


def writable_array(buf: Any, *, reduce: bool, what: str = "buf") -> tuple[np.ndarray, Callable[[], None]]:
    """A C-contiguous array to run on, and a function that copies the result back into ``buf``.

    NumPy arrays that are strided views are copied and written back (documented);
    every other object goes through [`gradcoll.group.buffers.as_buffer`][gradcoll.group.buffers.as_buffer], which views
    it without a copy or refuses it with an error naming it.
    """
    if not isinstance(buf, np.ndarray):
        if is_device_array(buf):
            raise UsageError(f"{what}: device arrays are reduced by allreduce only (see docs: GPU buffers)")
        buf = as_buffer(buf, writable=True, what=what).array
    if not buf.flags.writeable:
        raise UsageError(f"{what} is read-only; collectives work in place")
    if reduce and buf.dtype not in REDUCE_DTYPES:
        raise UsageError(f"{what} has dtype {buf.dtype}; reductions take float16, float32 or float64")
    if buf.flags.c_contiguous:
        return buf, lambda: None
    work = np.ascontiguousarray(buf)  # documented copy for strided views
    return work, lambda: np.copyto(buf, work)


def is_half(buf: Any, op: str) -> bool:
    """True for a float16/bfloat16 NumPy buffer summed or averaged: it travels as itself, accumulated in float32."""
    if not isinstance(buf, np.ndarray) or op not in ("mean", "sum") or buf.dtype.itemsize != 2:
        return False  # the itemsize first: ``dtype.name`` costs microseconds on every call
    return bool(buf.dtype == np.float16 or buf.dtype.name == "bfloat16")



def pinned_staging(cache: dict[tuple[int, str], tuple[Any, Any]], count: int, dtype: np.dtype,
                   size: int) -> tuple[Any, Any]:
    """Pinned host buffers for a device allreduce of ``count`` elements on ``size`` ranks, kept in ``cache``.

    Pinned allocations are expensive, so each shape is allocated once and
    reused; calls of one group run one at a time, so one pair is enough.
    """
    key = (count, dtype.str)
    staged = cache.get(key)
    if staged is None:
        from numba import cuda

        staged = (cuda.pinned_array(count, dtype), cuda.pinned_array((size, count), dtype))
        cache[key] = staged
    return staged

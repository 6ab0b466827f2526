"""Argument checks of the kernel facade.

Everything a backend may assume (``gradcoll.kernels.protocol``) is made true
here: float dtypes, equal shapes, C-contiguous memory, a writeable ``out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["FLOATS", "is_device", "host_contig", "acc_dtype", "host_rows", "check_out"]

FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_device(x: Any) -> bool:
    """True for a GPU array (numba's simulator arrays expose ``__cuda_ndarray__`` instead of the interface)."""
    return not isinstance(x, np.ndarray) and (
        hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__")
    )


def host_contig(x: Any, what: str) -> np.ndarray:
    """``x`` as a C-contiguous float array (a documented copy when it is not contiguous)."""
    a = np.asarray(x)
    if a.dtype not in FLOATS:
        raise UsageError(f"{what} has dtype {a.dtype}; gradcoll kernels take float16, float32 or float64")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


def acc_dtype(dtype: np.dtype[Any], accumulate_dtype: Any) -> np.dtype[Any]:
    """The accumulation dtype of a reduce of ``dtype`` inputs (float16 accumulates in float32)."""
    if accumulate_dtype is not None:
        acc = np.dtype(accumulate_dtype)
        if acc not in FLOATS[1:]:
            raise UsageError(f"accumulate_dtype must be float32 or float64, got {acc}")
        return acc if acc.itemsize >= max(dtype.itemsize, 4) else np.dtype(np.float32)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def host_rows(inputs: Any) -> tuple[list[np.ndarray] | np.ndarray, tuple[int, ...], np.dtype[Any]]:
    """Normalise ``inputs`` to rows of equal shape; returns (rows, shape, dtype)."""
    if isinstance(inputs, np.ndarray):
        if inputs.ndim < 2:
            raise UsageError(
                f"a single array input must be 2-D (one row per contributor), got shape {inputs.shape}"
            )
        arr = host_contig(inputs, "inputs")
        if arr.shape[0] == 0:
            raise UsageError("mean_reduce needs at least one contributor, got 0 rows")
        return arr.reshape(arr.shape[0], -1), arr.shape[1:], arr.dtype
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise UsageError(f"inputs must be a sequence of arrays or one 2-D array, got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise UsageError("mean_reduce needs at least one contributor, got an empty sequence")
    rows = [host_contig(x, f"input {j}") for j, x in enumerate(inputs)]
    shape, dtype = rows[0].shape, rows[0].dtype
    for j, r in enumerate(rows):
        if r.shape != shape:
            raise UsageError(f"input {j} has shape {r.shape}, input 0 has shape {shape}")
        if r.dtype != dtype:
            raise UsageError(f"input {j} has dtype {r.dtype}, input 0 has dtype {dtype}")
    return [r.reshape(-1) for r in rows], shape, dtype


def check_out(out: Any, shape: tuple[int, ...], what: str = "out") -> np.ndarray:
    """``out`` if it is a writeable C-contiguous float array of ``shape``, else UsageError."""
    if not isinstance(out, np.ndarray):
        raise UsageError(f"{what} must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        raise UsageError(f"{what} has shape {out.shape}, the result has shape {shape}")
    if out.dtype not in FLOATS:
        raise UsageError(f"{what} has dtype {out.dtype}; expected float16, float32 or float64")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"{what} must be a writeable C-contiguous array")
    return out

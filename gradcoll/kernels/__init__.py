"""Fused mean-reduce + finite-check kernels (public API).

One pass over memory averages (or sums) the contributions of several workers
and detects any NaN or +/-Inf. Every backend adds contributions in the same
fixed order (0, 1, ..., n-1 for every element), so all CPU backends give
bit-identical results for the same inputs, whatever the thread count.

Backends: ``numpy`` (reference), ``numba`` (threads for large buffers),
``cython`` (compiled, lowest per-call cost for small buffers), ``cuda`` and
``cudasim`` (numba.cuda on a GPU or under its simulator). ``backend=None``
picks the fastest for the buffer; ``GRADCOLL_KERNELS`` overrides it. One
policy, ``gradcoll.kernels.select``, decides for every kind of kernel;
``backend=`` also takes an object implementing ``gradcoll.kernels.protocol``.

Non-contiguous *inputs* are copied to contiguous memory first (an extra pass);
``out`` and the in-place buffers of [`accumulate`][gradcoll.kernels.accumulate], [`scale`][gradcoll.kernels.scale] must be
C-contiguous. float16 inputs are accumulated in float32.

The low-precision kernels ([`encode_wire`][gradcoll.kernels.encode_wire], [`decode_wire`][gradcoll.kernels.decode_wire],
[`accumulate_wire`][gradcoll.kernels.accumulate_wire]; modules ``*_lowp``) convert float32 to and from
``bf16``/``fp16`` bit patterns held in uint16 arrays and fuse the widening
into the float32 accumulation and the finite check. [`exact_reduce`][gradcoll.kernels.exact_reduce] is
the order-independent reduction of the deterministic allreduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import NonFiniteError, UsageError
from . import reference
from ._compiled import extension
from ._lowp import WIRE_DTYPES, accumulate_wire, decode_wire, encode_wire, reference_wire
from ._validate import acc_dtype, check_out, host_contig, host_rows, is_device
from .protocol import ExactKernels, ReduceKernels
from .select import _FAST_CACHE, available_backends, fast_path, load_backend, reduce_elems, resolve

__all__ = [
    "mean_reduce",
    "accumulate",
    "check_finite",
    "scale",
    "exact_reduce",
    "available_backends",
    "select_backend",
    "warmup",
    "encode_wire",
    "decode_wire",
    "accumulate_wire",
    "reference_wire",
    "WIRE_DTYPES",
    "NonFiniteError",
]

_OPS = {"mean": True, "sum": False}

Backend = str | ReduceKernels | None


def mean_reduce(
    inputs: Any,
    out: np.ndarray | None = None,
    *,
    op: str = "mean",
    check_finite: bool = True,
    backend: Backend = None,
    accumulate_dtype: Any = None,
) -> Any:
    """Element-wise mean (or sum, ``op="sum"``) of several equal-shape arrays in one pass.

    ``inputs`` is a sequence of arrays or one array whose first axis indexes
    the contributors. Raises [`NonFiniteError`][gradcoll.errors.NonFiniteError] (naming the contributor,
    element index and value) if any input holds NaN/Inf or the sum overflows.
    Inputs are never modified; ``out`` is unspecified after an error.
    """
    if op not in _OPS:
        raise UsageError(f"op must be 'mean' or 'sum', got {op!r}")
    if accumulate_dtype is None:
        fast = fast_path("reduce", backend)  # plain arrays: validated and reduced in one C call
        if fast is not None:
            res = fast[0](inputs, out, op == "mean", check_finite, fast[1])
            if res is not None and res is not False:
                return res
            # None: not a plain call; False: non-finite. Either way the full path decides and explains.
    return _reduce_rest(inputs, out, op, check_finite, backend, accumulate_dtype)


def _reduce_rest(inputs: Any, out: np.ndarray | None, op: str, check_finite: bool, backend: Backend,
                 accumulate_dtype: Any) -> Any:
    """``mean_reduce`` after its fast entry (declined, or found a non-finite value): ``op`` is checked."""
    if is_device(inputs) or (isinstance(inputs, Sequence) and len(inputs) and is_device(inputs[0])):
        be = resolve("reduce", device=True, backend=backend)
        return be.mean_reduce_device(inputs, out, op=op, check_finite=check_finite, accumulate_dtype=accumulate_dtype)
    rows, shape, dtype = host_rows(inputs)
    n = len(rows)
    if out is None:
        out = np.empty(shape, dtype=dtype)
    else:
        check_out(out, shape)
    acc = acc_dtype(dtype, accumulate_dtype)
    if dtype == np.float16:  # documented: half inputs are widened first (one extra pass)
        rows = rows.astype(np.float32) if isinstance(rows, np.ndarray) else [r.astype(np.float32) for r in rows]
    flat_out = out.reshape(-1)
    ok = resolve("reduce", reduce_elems(flat_out.size, n), backend=backend).reduce_rows(
        rows, flat_out, acc, n if _OPS[op] else 1, check_finite)
    if not ok:
        reference.raise_nonfinite(list(rows), flat_out, "mean_reduce")
    return out


def accumulate(
    acc: np.ndarray,
    x: Any,
    *,
    scale: float | None = None,
    divide_by: float | None = None,
    check_finite: bool = True,
    backend: Backend = None,
) -> np.ndarray:
    """In place ``acc += x``, then ``acc /= divide_by`` and/or ``acc *= scale``, with the finite check.

    This is the step a ring allreduce runs on every received chunk. Raises
    [`NonFiniteError`][gradcoll.errors.NonFiniteError] (contributor 0 = ``acc``, 1 = ``x``) on NaN/Inf.
    """
    fast = fast_path("accumulate", backend)
    if fast is not None:
        res = fast[0](acc, x, scale, divide_by, check_finite, fast[1])
        if res is True:
            return acc
        if res is False:
            reference.raise_accumulate(np.asarray(acc).reshape(-1), np.asarray(x).reshape(-1))
    if is_device(acc):
        resolve("accumulate", device=True, backend=backend).accumulate_device(
            acc, x, scale=scale, divide_by=divide_by, check_finite=check_finite)
        return acc  # accumulate_device works in place
    acc = check_out(acc, np.shape(acc), "acc")
    xa = host_contig(x, "x")
    if xa.shape != acc.shape and xa.size != acc.size:
        raise UsageError(f"x has shape {xa.shape}, acc has shape {acc.shape}")
    if xa.dtype != acc.dtype:
        raise UsageError(f"x has dtype {xa.dtype}, acc has dtype {acc.dtype}")
    if divide_by is not None and divide_by == 0:
        raise UsageError("divide_by must be non-zero")
    flat = acc.reshape(-1)
    be = resolve("accumulate", flat.size, backend=backend, half=acc.dtype == np.float16)
    if not be.accumulate(flat, xa.reshape(-1), scale, divide_by, check_finite):
        reference.raise_accumulate(flat, xa.reshape(-1))
    return acc


def check_finite(buf: Any, *, backend: Backend = None) -> None:
    """Raise [`NonFiniteError`][gradcoll.errors.NonFiniteError] naming the first NaN/Inf element of ``buf``."""
    if is_device(buf):
        resolve("finite", device=True, backend=backend).check_finite_device(buf)
        return
    a = host_contig(buf, "buf").reshape(-1)
    if not resolve("finite", a.size, backend=backend, half=a.dtype == np.float16).is_all_finite(a):
        reference.raise_finite(a)


def scale(buf: np.ndarray, factor: float, *, backend: Backend = None) -> np.ndarray:
    """In place ``buf *= factor``; returns ``buf``."""
    if is_device(buf):
        resolve("scale", device=True, backend=backend).scale_device(buf, factor)
        return buf
    flat = check_out(buf, np.shape(buf), "buf").reshape(-1)
    resolve("scale", flat.size, backend=backend, half=flat.dtype == np.float16).scale(flat, factor)
    return buf


def exact_reduce(own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float,
                 backend: str | ExactKernels | None = None) -> int:
    """``out = (own + sum(rows)) / divisor`` by the exact method; the first non-finite output index, or -1.

    The reduction of the deterministic allreduce: the result depends only on
    the multiset of contributions (rules in ``gradcoll.kernels.exact_reference``).
    ``own`` (m,) and ``rows`` (k, m) are contiguous float32 or float64 arrays
    of one dtype, ``out`` (m,) of the same dtype may be ``own``. The fused
    Numba kernel, or with ``backend="numpy"`` (or without Numba) the NumPy
    reference: the same bits either way.
    """
    return int(resolve("exact", own.size, backend=backend).exact_reduce(own, rows, out, divisor))


def select_backend(name: str) -> Any:
    """Load backend ``name`` now and return its module; raises BackendUnavailable with the cause."""
    return load_backend(name)


def warmup(backends: Sequence[str] | None = None) -> list[str]:
    """Compile the JIT kernels ahead of time (numba: every kernel, low-precision and exact ones included);
    returns the backends warmed."""
    names = list(backends) if backends is not None else [b for b in available_backends() if b in ("numba", "cython")]
    for name in names:
        load_backend(name).warmup()
    return names


def _compiled_facade() -> None:
    """Where the extension is built, ``mean_reduce`` is its compiled twin (``_cython_kernels.mean_reduce``).

    The common call (default backend and policy, plain arrays) then runs the fast entry with no Python frame
    in between, which saves a sizeable share of a small reduce. The twin reads the policy's
    own cache of fast entries and hands every other call to the Python function above, so both take the
    same arguments and give the same results and errors; ``mean_reduce.__wrapped__`` is the Python one.
    """
    ext = extension()
    bind = getattr(ext, "bind_mean_reduce", None)
    if bind is None:
        return
    python = mean_reduce
    bind(_FAST_CACHE["reduce"], python, _reduce_rest)
    twin = ext.mean_reduce  # type: ignore[union-attr]
    twin.__doc__, twin.__wrapped__ = python.__doc__, python
    globals()["mean_reduce"] = twin


_compiled_facade()

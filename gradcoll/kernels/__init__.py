"""Fused mean-reduce + finite-check kernels (public API).

One pass over memory averages (or sums) the contributions of several workers
and detects any NaN or +/-Inf. Every backend adds contributions in the same
fixed order (0, 1, ..., n-1 for every element), so all CPU backends give
bit-identical results for the same inputs, whatever the thread count.

Backends: ``numpy`` (reference), ``numba`` (threads for large buffers),
``cython`` (compiled, lowest per-call cost for small buffers), ``cuda`` and
``cudasim`` (numba.cuda on a GPU or under its simulator). ``backend=None``
picks the fastest for the buffer; ``GRADCOLL_KERNELS`` overrides it.

Non-contiguous *inputs* are copied to contiguous memory first (an extra pass);
``out`` and the in-place buffers of [`accumulate`][gradcoll.kernels.accumulate], [`scale`][gradcoll.kernels.scale] must be
C-contiguous. float16 inputs are accumulated in float32.

The wire kernels ([`encode_wire`][gradcoll.kernels.encode_wire], [`decode_wire`][gradcoll.kernels.decode_wire],
[`accumulate_wire`][gradcoll.kernels.accumulate_wire]) convert float32 to and from ``bf16``/``fp16`` bit
patterns held in uint16 arrays and fuse the widening into the float32
accumulation and the finite check (numba, NumPy reference, CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import NonFiniteError, UsageError
from . import reference
from .select import SMALL_ELEMS, available_backends, choose_backend, env_override, env_override_set, load_backend

__all__ = [
    "mean_reduce",
    "accumulate",
    "check_finite",
    "scale",
    "available_backends",
    "select_backend",
    "warmup",
    "encode_wire",
    "decode_wire",
    "accumulate_wire",
    "WIRE_DTYPES",
    "NonFiniteError",
]

_MAXSIZE = 1 << 62  # "no size limit" for the compiled fast path
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_OPS = {"mean": True, "sum": False}


@functools.cache
def _fast_paths() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The compiled extension's validated fast paths, or None when it is not built."""
    try:
        from . import _cython_kernels as ck  # type: ignore[attr-defined]
    except ImportError:
        return None
    return ck.reduce_fast, ck.accumulate_fast


def _is_device(x: Any) -> bool:
    # numba's simulator arrays expose __cuda_ndarray__ instead of the interface.
    return not isinstance(x, np.ndarray) and (
        hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__")
    )


def _host_contig(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype not in _FLOATS:
        raise UsageError(f"{what} has dtype {a.dtype}; gradcoll kernels take float16, float32 or float64")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)  # documented copy
    return a


def _acc_dtype(dtype: np.dtype, accumulate_dtype: Any) -> np.dtype:
    if accumulate_dtype is not None:
        acc = np.dtype(accumulate_dtype)
        if acc not in _FLOATS[1:]:
            raise UsageError(f"accumulate_dtype must be float32 or float64, got {acc}")
        return acc if acc.itemsize >= max(dtype.itemsize, 4) else np.dtype(np.float32)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _rows(inputs: Any) -> tuple[list[np.ndarray] | np.ndarray, tuple[int, ...], np.dtype]:
    """Normalise ``inputs`` to rows of equal shape; returns (rows, shape, dtype)."""
    if isinstance(inputs, np.ndarray):
        if inputs.ndim < 2:
            raise UsageError(
                f"a single array input must be 2-D (one row per contributor), got shape {inputs.shape}"
            )
        arr = _host_contig(inputs, "inputs")
        if arr.shape[0] == 0:
            raise UsageError("mean_reduce needs at least one contributor, got 0 rows")
        return arr.reshape(arr.shape[0], -1), arr.shape[1:], arr.dtype
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise UsageError(f"inputs must be a sequence of arrays or one 2-D array, got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise UsageError("mean_reduce needs at least one contributor, got an empty sequence")
    rows = [_host_contig(x, f"input {j}") for j, x in enumerate(inputs)]
    shape, dtype = rows[0].shape, rows[0].dtype
    for j, r in enumerate(rows):
        if r.shape != shape:
            raise UsageError(f"input {j} has shape {r.shape}, input 0 has shape {shape}")
        if r.dtype != dtype:
            raise UsageError(f"input {j} has dtype {r.dtype}, input 0 has dtype {dtype}")
    return [r.reshape(-1) for r in rows], shape, dtype


def _check_out(out: Any, shape: tuple[int, ...], what: str = "out") -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise UsageError(f"{what} must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        raise UsageError(f"{what} has shape {out.shape}, the result has shape {shape}")
    if out.dtype not in _FLOATS:
        raise UsageError(f"{what} has dtype {out.dtype}; expected float16, float32 or float64")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"{what} must be a writeable C-contiguous array")
    return out


def mean_reduce(
    inputs: Any,
    out: np.ndarray | None = None,
    *,
    op: str = "mean",
    check_finite: bool = True,
    backend: str | None = None,
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
    if accumulate_dtype is None and (backend == "cython" or (backend is None and not env_override_set())):
        # Plain arrays: validated and reduced in C in one call (~1 us); small ones
        # only when choosing automatically, any size when cython was asked for.
        fast = _fast_paths()
        if fast is not None:
            res = fast[0](inputs, out, op == "mean", check_finite, _MAXSIZE if backend else SMALL_ELEMS)
            if res is not None:
                if res is not False:
                    return res
                # Non-finite: fall through; the full path recomputes and explains.
    if _is_device(inputs) or (isinstance(inputs, Sequence) and len(inputs) and _is_device(inputs[0])):
        be = choose_backend(0, device=True, backend=backend)
        return be.mean_reduce_device(inputs, out, op=op, check_finite=check_finite, accumulate_dtype=accumulate_dtype)
    rows, shape, dtype = _rows(inputs)
    n = len(rows)
    if out is None:
        out = np.empty(shape, dtype=dtype)
    else:
        _check_out(out, shape)
    acc = _acc_dtype(dtype, accumulate_dtype)
    if dtype == np.float16:  # documented: half inputs are widened first (one extra pass)
        rows = rows.astype(np.float32) if isinstance(rows, np.ndarray) else [r.astype(np.float32) for r in rows]
    flat_out = out.reshape(-1)
    be = choose_backend(flat_out.size, backend=backend)
    ok = be.reduce_rows(rows, flat_out, acc, n if _OPS[op] else 1, check_finite)
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
    backend: str | None = None,
) -> np.ndarray:
    """In place ``acc += x``, then ``acc /= divide_by`` and/or ``acc *= scale``, with the finite check.

    This is the step a ring allreduce runs on every received chunk. Raises
    [`NonFiniteError`][gradcoll.errors.NonFiniteError] (contributor 0 = ``acc``, 1 = ``x``) on NaN/Inf.
    """
    if backend == "cython" or (backend is None and not env_override_set()):
        fast = _fast_paths()
        if fast is not None:
            res = fast[1](acc, x, scale, divide_by, check_finite, _MAXSIZE if backend else SMALL_ELEMS)
            if res is True:
                return acc
            if res is False:
                _explain_accumulate(np.asarray(acc).reshape(-1), np.asarray(x).reshape(-1))
    if _is_device(acc):
        be = choose_backend(0, device=True, backend=backend)
        be.accumulate_device(acc, x, scale=scale, divide_by=divide_by, check_finite=check_finite)
        return acc  # accumulate_device works in place and returns ``acc`` itself
    acc = _check_out(acc, np.shape(acc), "acc")
    xa = _host_contig(x, "x")
    if xa.shape != acc.shape and xa.size != acc.size:
        raise UsageError(f"x has shape {xa.shape}, acc has shape {acc.shape}")
    if xa.dtype != acc.dtype:
        raise UsageError(f"x has dtype {xa.dtype}, acc has dtype {acc.dtype}")
    if divide_by is not None and divide_by == 0:
        raise UsageError("divide_by must be non-zero")
    flat = acc.reshape(-1)
    be = choose_backend(flat.size, backend="numpy" if acc.dtype == np.float16 else backend)
    if not be.accumulate(flat, xa.reshape(-1), scale, divide_by, check_finite):
        _explain_accumulate(flat, xa.reshape(-1))
    return acc


def _explain_accumulate(acc: np.ndarray, x: np.ndarray) -> None:
    """Error path of [`accumulate`][gradcoll.kernels.accumulate]: raise NonFiniteError naming the culprit.

    NaN/Inf in ``x`` survives into ``acc``, so ``x`` is looked at first;
    otherwise ``acc`` was already non-finite or the sum overflowed.
    """
    if not reference.is_all_finite(x):
        i = _first_bad(x)
        raise NonFiniteError(
            f"accumulate: non-finite value {float(x[i])!r} in input 1 at element {i}",
            contributor=1,
            index=i,
            value=float(x[i]),
        )
    i = _first_bad(acc)
    raise NonFiniteError(
        f"accumulate: acc holds {float(acc[i])!r} at element {i} (non-finite before the add, or overflow)",
        contributor=0,
        index=i,
        value=float(acc[i]),
    )


def _first_bad(a: np.ndarray) -> int:
    return int(np.flatnonzero(~np.isfinite(a))[0])


def check_finite(buf: Any, *, backend: str | None = None) -> None:
    """Raise [`NonFiniteError`][gradcoll.errors.NonFiniteError] naming the first NaN/Inf element of ``buf``."""
    if _is_device(buf):
        be = choose_backend(0, device=True, backend=backend)
        be.check_finite_device(buf)
        return
    a = _host_contig(buf, "buf").reshape(-1)
    # The compiled kernels take float32/float64 only; half buffers use the reference.
    be = choose_backend(a.size, backend="numpy" if a.dtype == np.float16 else backend)
    if not be.is_all_finite(a):
        i = _first_bad(a)
        raise NonFiniteError(
            f"check_finite: non-finite value {float(a[i])!r} at element {i}", contributor=0, index=i, value=float(a[i])
        )


def scale(buf: np.ndarray, factor: float, *, backend: str | None = None) -> np.ndarray:
    """In place ``buf *= factor``; returns ``buf``."""
    if _is_device(buf):
        be = choose_backend(0, device=True, backend=backend)
        be.scale_device(buf, factor)
        return buf
    a = _check_out(buf, np.shape(buf), "buf")
    flat = a.reshape(-1)
    choose_backend(flat.size, backend="numpy" if flat.dtype == np.float16 else backend).scale(flat, factor)
    return buf


def select_backend(name: str) -> Any:
    """Load backend ``name`` now and return its module; raises BackendUnavailable with the cause."""
    return load_backend(name)


def warmup(backends: Sequence[str] | None = None) -> list[str]:
    """Compile the JIT kernels ahead of time; returns the backends warmed."""
    names = list(backends) if backends is not None else [b for b in available_backends() if b in ("numba", "cython")]
    for name in names:
        load_backend(name).warmup()
    return names


# -- low-precision wire (bf16 / fp16 transfer, float32 accumulation) -----------------
#: Wire formats of ``encode_wire`` / ``accumulate_wire``.
WIRE_DTYPES = ("bf16", "fp16")


def _wire_backend(backend: str | None, device: bool = False) -> Any:
    """The module implementing the wire kernels: numba (default), cython (serial), the NumPy reference, or CUDA."""
    if device:
        return choose_backend(0, device=True, backend=backend)
    name = backend or env_override()
    if name in ("numpy", "cuda", "cudasim"):
        return reference_wire() if name == "numpy" else load_backend(name).WIRE
    if name == "cython":  # what a group uses: one thread per rank
        try:
            from . import cython_lowp

            return cython_lowp
        except ImportError:
            pass  # not built: Numba, below
    try:
        load_backend("numba")  # the registry keeps the original error if it fails
    except Exception:  # noqa: BLE001 - no JIT here: the reference is correct, only slower
        return reference_wire()
    from . import numba_lowp

    return numba_lowp


def reference_wire() -> Any:
    """The NumPy oracle of the wire kernels."""
    from . import lowp_reference

    return lowp_reference


def _check_wire(wire: str) -> str:
    if wire not in WIRE_DTYPES:
        raise UsageError(f"wire must be one of {', '.join(WIRE_DTYPES)}; got {wire!r}")
    return wire


def _wire_arrays(f32: Any, u16: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, w = np.asarray(f32), np.asarray(u16)
    if a.dtype != np.float32 or w.dtype != np.uint16:
        raise UsageError(f"{what}: needs a float32 and a uint16 array, got {a.dtype} and {w.dtype}")
    if a.size != w.size:
        raise UsageError(f"{what}: {a.size} float32 elements but {w.size} wire elements")
    if not (a.flags.c_contiguous and w.flags.c_contiguous):
        raise UsageError(f"{what}: buffers must be C-contiguous")
    return a.reshape(-1), w.reshape(-1)


def encode_wire(src: Any, dst: Any = None, wire: str = "bf16", *, check_finite: bool = True,
                backend: str | None = None) -> Any:
    """Round float32 ``src`` to ``wire`` (nearest even) into uint16 ``dst`` in one pass; returns ``dst``.

    Raises [`NonFiniteError`][gradcoll.errors.NonFiniteError] if an encoded value is Inf/NaN, including
    a finite float32 that overflows the wire format (never sent as Inf).
    """
    _check_wire(wire)
    if _is_device(src):
        be = _wire_backend(backend, device=True)
        return be.encode_wire_device(src, dst, wire, check_finite)
    if dst is None:
        dst = np.empty(np.shape(src), np.uint16)
    a, w = _wire_arrays(src, dst, "encode_wire")
    if not w.flags.writeable:
        raise UsageError("encode_wire: dst must be writeable")
    if not _wire_backend(backend).encode(a, w, wire, check_finite):
        _explain_wire(a, w, wire, "encode_wire")
    return dst


def decode_wire(src: Any, dst: Any = None, wire: str = "bf16", *, backend: str | None = None) -> Any:
    """Widen uint16 ``src`` in ``wire`` to float32 ``dst`` (exact); returns ``dst``."""
    _check_wire(wire)
    if _is_device(src):
        return _wire_backend(backend, device=True).decode_wire_device(src, dst, wire)
    if dst is None:
        dst = np.empty(np.shape(src), np.float32)
    a, w = _wire_arrays(dst, src, "decode_wire")
    _wire_backend(backend).decode(w, a, wire)
    return dst


def accumulate_wire(acc: Any, x: Any, wire: str, *, divide_by: float | None = None, check_finite: bool = True,
                    backend: str | None = None) -> Any:
    """Fused ``acc += decode(x)`` in float32, then ``acc /= divide_by``, with the finite check; returns ``acc``."""
    _check_wire(wire)
    if divide_by is not None and divide_by == 0:
        raise UsageError("divide_by must be non-zero")
    if _is_device(acc):
        be = _wire_backend(backend, device=True)
        if not be.accumulate_wire_device(acc, x, wire, divide_by, check_finite):
            raise NonFiniteError("accumulate_wire (cuda): the float32 accumulator holds NaN/Inf", contributor=None)
        return acc
    a, w = _wire_arrays(acc, x, "accumulate_wire")
    if not a.flags.writeable:
        raise UsageError("accumulate_wire: acc must be writeable")
    if not _wire_backend(backend).accumulate(a, w, wire, divide_by, check_finite):
        dec = np.empty(w.size, np.float32)
        reference_wire().decode(w, dec, wire)
        _explain_accumulate(a, dec)
    return acc


def _explain_wire(a: np.ndarray, w: np.ndarray, wire: str, what: str) -> None:
    mask = reference_wire().WIRES[wire]
    i = int(np.flatnonzero((w & mask) == mask)[0])
    value = float(a[i])
    why = "overflows the wire format" if np.isfinite(value) else "is not finite"
    raise NonFiniteError(f"{what}: value {value!r} at element {i} {why} ({wire})", contributor=0, index=i,
                         value=value)

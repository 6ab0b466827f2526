"""The ``cuda`` and ``cudasim`` backends: numba.cuda kernels.

The same kernels serve a real GPU (``cuda``) and numba's CUDA simulator
(``cudasim``, ``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported); the
two are reported as different backends because the simulator has no warp
shuffles and no real timing. The reduction is portable: one thread per
element (grid-stride), contributions added in order 0..n-1 (the same bits
as the CPU backends, IEEE division since fastmath is off), and a per-block
non-finite flag in shared memory, published with one atomic per block.

Device arrays (anything with ``__cuda_array_interface__``) stay on the device;
host arrays given to this backend are copied in and out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import config, cuda

from ..errors import BackendUnavailable, UsageError
from . import reference
from ._cuda_kernels import _accumulate_kernel, _finite_kernel, _lowp_accumulate_kernel, _lowp_encode_kernel, _reduce_kernel, _scale_kernel

NAME = "cuda"
THREADS = 256


def probe(name: str) -> None:
    """Raise unless this process can run backend ``name`` (``cuda`` or ``cudasim``)."""
    sim = bool(config.ENABLE_CUDASIM)
    if name == "cudasim" and not sim:
        raise BackendUnavailable("the CUDA simulator is off (set NUMBA_ENABLE_CUDASIM=1 before numba is imported)")
    if name == "cuda":
        if sim:
            raise BackendUnavailable("NUMBA_ENABLE_CUDASIM=1 is set: only the 'cudasim' backend is available")
        if not cuda.is_available():
            raise BackendUnavailable("no CUDA GPU or driver found (numba.cuda.is_available() is False)")


#: The simulator runs one kernel at a time ("concurrent simulated kernel not
#: supported"); ranks running as threads serialise their launches on this lock.
_SIM_LAUNCH = threading.Lock()


def _launching() -> Any:
    return _SIM_LAUNCH if config.ENABLE_CUDASIM else contextlib.nullcontext()


def _threads() -> int:
    # The simulator runs every CUDA thread as a Python thread: keep blocks small there.
    return 16 if config.ENABLE_CUDASIM else THREADS


def _blocks(m: int) -> int:
    # Enough blocks to fill the GPU; grid-stride loops cover the rest.
    cap = 4 if config.ENABLE_CUDASIM else 4096
    t = _threads()
    return max(1, min(cap, (m + t - 1) // t))


def _flag() -> Any:
    return cuda.to_device(np.zeros(1, np.int32))


def _is_device(x: Any) -> bool:
    return not isinstance(x, np.ndarray) and (
        hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__")
    )


def _dev(x: Any) -> Any:
    """A numba device array for ``x`` (already one, or anything with the CUDA array interface)."""
    return x if hasattr(x, "__cuda_ndarray__") else cuda.as_cuda_array(x)


def _as_device(x: Any) -> Any:
    return _dev(x) if _is_device(x) else cuda.to_device(np.ascontiguousarray(x))


def _launch_reduce(x2d: Any, out1d: Any, divisor: float, check: bool) -> bool:
    m = out1d.shape[0]
    if m == 0:
        return True
    flag = _flag()
    d = out1d.dtype.type(divisor)
    with _launching():
        _reduce_kernel[_blocks(m), _threads()](x2d, out1d, d, divisor != 1, check, flag)
    return int(flag.copy_to_host()[0]) == 0


# -- host-array interface (the common backend contract) ------------------------
def reduce_rows(rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool) -> bool:
    """Host arrays: copy to the device, reduce there, copy the result back."""
    x = rows if isinstance(rows, np.ndarray) else np.stack(list(rows))
    dx = cuda.to_device(np.ascontiguousarray(x))
    dout = cuda.device_array(out.shape[0], dtype=acc_dtype)
    ok = _launch_reduce(dx, dout, divisor, check)
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, dout.copy_to_host(), casting="unsafe")
    if check and ok and out.dtype != acc_dtype:
        ok = reference.is_all_finite(out)
    return ok


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """Host arrays: in-place accumulate through the device."""
    da = cuda.to_device(acc)
    ok = _accumulate_device_raw(da, cuda.to_device(x), scale, divisor, check)
    da.copy_to_host(acc)
    return ok


def is_all_finite(buf: np.ndarray) -> bool:
    """Host arrays: finite check on the device."""
    return _finite_device_raw(cuda.to_device(buf))


def scale(buf: np.ndarray, factor: float) -> None:
    """Host arrays: in-place multiply on the device."""
    d = cuda.to_device(buf)
    scale_device(d, factor)
    d.copy_to_host(buf)


def warmup() -> None:
    """Compile the float32 kernels once."""
    x = np.ones((2, 4), np.float32)
    reduce_rows(x, np.empty(4, np.float32), np.dtype(np.float32), 2, True)


# -- device-array interface ------------------------------------------------------
def _accumulate_device_raw(acc: Any, x: Any, scale: float | None, divisor: float | None, check: bool) -> bool:
    m = acc.shape[0]
    if m == 0:
        return True
    flag = _flag()
    t = acc.dtype.type
    with _launching():
        _accumulate_kernel[_blocks(m), _threads()](
            acc, x, t(scale if scale is not None else 1), scale is not None,
            t(divisor if divisor else 1), bool(divisor) and divisor != 1, check, flag,
        )
    return int(flag.copy_to_host()[0]) == 0


def _finite_device_raw(buf: Any) -> bool:
    if buf.shape[0] == 0:
        return True
    flag = _flag()
    with _launching():
        _finite_kernel[_blocks(buf.shape[0]), _threads()](buf, flag)
    return int(flag.copy_to_host()[0]) == 0


def _check_dtype(dt: np.dtype, what: str) -> None:
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise UsageError(f"{what} has dtype {dt}; the CUDA kernels take float32 or float64")


def mean_reduce_device(inputs: Any, out: Any, *, op: str, check_finite: bool, accumulate_dtype: Any) -> Any:
    """Reduce device (or host) arrays on the GPU; returns a device array."""
    if _is_device(inputs):
        x = _dev(inputs)
        if x.ndim < 2:
            raise UsageError(f"a single array input must be 2-D (one row per contributor), got shape {x.shape}")
        shape = x.shape[1:]
        x = x.reshape(x.shape[0], -1)
    else:
        if len(inputs) == 0:
            raise UsageError("mean_reduce needs at least one contributor, got an empty sequence")
        parts = [_as_device(a) for a in inputs]
        shape = parts[0].shape
        for j, p in enumerate(parts):
            if p.shape != shape or p.dtype != parts[0].dtype:
                raise UsageError(f"input {j} has shape {p.shape}/{p.dtype}, input 0 has {shape}/{parts[0].dtype}")
        m = int(np.prod(shape)) if shape else 1
        x = cuda.device_array((len(parts), m), dtype=parts[0].dtype)
        for j, p in enumerate(parts):  # documented: a list is packed into one 2-D device buffer
            x[j].copy_to_device(p.reshape(m))
    _check_dtype(np.dtype(x.dtype), "inputs")
    acc = np.dtype(accumulate_dtype) if accumulate_dtype is not None else np.dtype(x.dtype)
    n, m = x.shape
    if n == 0:
        raise UsageError("mean_reduce needs at least one contributor, got 0 rows")
    if out is None:
        out = cuda.device_array(shape, dtype=x.dtype)
    dout = _dev(out) if _is_device(out) else None
    if dout is None:
        raise UsageError("out must be a device array for device inputs")
    if dout.size != m:
        raise UsageError(f"out has shape {dout.shape}, the result has shape {shape}")
    flat_out = dout.reshape(m)
    target = flat_out if np.dtype(dout.dtype) == acc else cuda.device_array(m, dtype=acc)
    ok = _launch_reduce(x, target, n if op == "mean" else 1, check_finite)
    if target is not flat_out:
        flat_out.copy_to_device(target.copy_to_host().astype(dout.dtype))
        if check_finite and ok:
            ok = _finite_device_raw(flat_out)
    if not ok:
        host = x.copy_to_host()
        reference.raise_nonfinite(list(host), flat_out.copy_to_host(), "mean_reduce (cuda)")
    return out


def accumulate_device(acc: Any, x: Any, *, scale: float | None, divide_by: float | None, check_finite: bool) -> Any:
    """In place ``acc += x`` on the device with the finite check."""
    da = _dev(acc)
    dx = _as_device(x)
    if dx.size != da.size or dx.dtype != da.dtype:
        raise UsageError(f"x has shape {dx.shape}/{dx.dtype}, acc has {da.shape}/{da.dtype}")
    _check_dtype(np.dtype(da.dtype), "acc")
    fa = da.reshape(da.size)
    if not _accumulate_device_raw(fa, dx.reshape(dx.size), scale, divide_by, check_finite):
        hx = dx.copy_to_host().reshape(-1)
        reference.raise_accumulate(fa.copy_to_host(), hx)
    return acc


def check_finite_device(buf: Any) -> None:
    """Raise NonFiniteError naming the first NaN/Inf of a device buffer."""
    d = _dev(buf)
    if not _finite_device_raw(d.reshape(d.size)):
        reference.raise_nonfinite([d.copy_to_host().reshape(-1)], None, "check_finite (cuda)")


def scale_device(buf: Any, factor: float) -> None:
    """In place ``buf *= factor`` on the device."""
    d = _dev(buf)
    f = d.reshape(d.size)
    if f.shape[0]:
        with _launching():
            _scale_kernel[_blocks(f.shape[0]), _threads()](f, f.dtype.type(factor))



# -- low-precision kernels: device arrays (and host arrays through the device) -------------
_WIRE_TABLES: dict[tuple[str, int], tuple[Any, Any]] = {}
_TABLE_LOCK = threading.Lock()  # (wire, context) -> the 256 KiB decode table on that device


def _wire_table(wire: str) -> Any:
    """The float32 value of every uint16 pattern of ``wire``, on the current device: copied once per context."""
    from .lowp_reference import fp16_table

    ctx = None if config.ENABLE_CUDASIM else cuda.current_context()  # the simulator has one (fresh-object) context
    key = (wire, id(ctx))
    with _TABLE_LOCK:
        cached = _WIRE_TABLES.get(key)
        if cached is not None and cached[0] is ctx:
            return cached[1]
        host = fp16_table() if wire == "fp16" else (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
        table = cuda.to_device(host)
        _WIRE_TABLES[key] = (ctx, table)  # the context is kept with it: an id is never reused while cached
        return table


def lowp_encode_device(src: Any, dst: Any, wire: str, check: bool) -> Any:
    """float32 device ``src`` -> uint16 device ``dst`` (allocated when None); raises NonFiniteError."""
    d = _dev(src)
    flat = d.reshape(d.size)
    out = cuda.device_array(d.size, np.uint16) if dst is None else _dev(dst).reshape(d.size)
    if not _lowp_encode_raw(flat, out, wire) and check:
        from .lowp_reference import raise_nonfinite

        raise_nonfinite(flat.copy_to_host(), out.copy_to_host(), wire, "encode_wire (cuda)")
    return out if dst is None else dst


def _lowp_encode_raw(flat: Any, out: Any, wire: str) -> bool:
    m = flat.shape[0]
    if m == 0:
        return True
    flag = _flag()
    with _launching():
        _lowp_encode_kernel[_blocks(m), _threads()](flat.view(np.uint32), out, wire == "fp16", flag)
    return int(flag.copy_to_host()[0]) == 0


def _lowp_accumulate_raw(acc: Any, w: Any, wire: str, divisor: float | None, decode_only: bool, check: bool) -> bool:
    m = acc.shape[0]
    if m == 0:
        return True
    flag = _flag()
    dodiv = divisor is not None and divisor != 1
    with _launching(), np.errstate(over="ignore", invalid="ignore"):  # the simulator computes in NumPy scalars
        _lowp_accumulate_kernel[_blocks(m), _threads()](
            acc, w, _wire_table(wire), np.float32(divisor if dodiv else 1), dodiv, decode_only, check, flag)
    return int(flag.copy_to_host()[0]) == 0


def lowp_decode_device(src: Any, dst: Any, wire: str) -> Any:
    """uint16 device ``src`` -> float32 device ``dst`` (allocated when None)."""
    d = _dev(src)
    out = cuda.device_array(d.size, np.float32) if dst is None else _dev(dst).reshape(d.size)
    _lowp_accumulate_raw(out, d.reshape(d.size), wire, None, True, False)
    return out if dst is None else dst


def lowp_accumulate_device(acc: Any, x: Any, wire: str, divisor: float | None, check: bool) -> bool:
    """In place ``acc += decode(x)`` (then divide) on the device; True when finite."""
    da = _dev(acc)
    return _lowp_accumulate_raw(da.reshape(da.size), _as_device(x).reshape(da.size), wire, divisor, False, check)


# Host arrays through the device, with the contract of numba_lowp / lowp_reference.
def lowp_encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst`` on the device; True when finite (or unchecked)."""
    out = cuda.device_array(src.size, np.uint16)
    ok = _lowp_encode_raw(cuda.to_device(src), out, wire)
    out.copy_to_host(dst)
    return ok or not check


def lowp_decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` -> float32 ``dst`` on the device."""
    d = cuda.device_array(dst.size, np.float32)
    _lowp_accumulate_raw(d, cuda.to_device(src), wire, None, True, False)
    d.copy_to_host(dst)


def lowp_accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """``acc += decode(x)`` then ``acc /= divisor`` on the device; True when finite."""
    d = cuda.to_device(acc)
    ok = _lowp_accumulate_raw(d, cuda.to_device(x), wire, divisor, False, check)
    d.copy_to_host(acc)
    return ok

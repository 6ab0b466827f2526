"""The low-precision kernels of the facade: float32 to and from bf16/fp16 bit patterns (re-exported by
``gradcoll.kernels``).

A low-precision allreduce sends its values in a 16-bit *wire format*,
``bf16`` or ``fp16``, held as uint16 arrays of bit patterns, and accumulates
in float32. The implementations are the ``*_lowp`` modules (numba, cython),
the NumPy oracle ``lowp_reference`` and the CUDA backend, chosen by the
``lowp`` row of ``gradcoll.kernels.select.POLICY``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from ..errors import NonFiniteError, UsageError
from . import lowp_reference, reference
from ._validate import is_device
from .protocol import LowpKernels
from .select import fast_path, resolve

__all__ = ["WIRE_DTYPES", "encode_wire", "decode_wire", "accumulate_wire", "reference_wire"]

#: Wire formats of ``encode_wire`` / ``accumulate_wire``.
WIRE_DTYPES = ("bf16", "fp16")


def reference_wire() -> ModuleType:
    """The NumPy oracle of the low-precision kernels (``gradcoll.kernels.lowp_reference``)."""
    return lowp_reference


def _check_wire(wire: str) -> str:
    if wire not in WIRE_DTYPES:
        raise UsageError(f"wire must be one of {', '.join(WIRE_DTYPES)}; got {wire!r}")
    return wire


def _arrays(f32: Any, u16: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, w = np.asarray(f32), np.asarray(u16)
    if a.dtype != np.float32 or w.dtype != np.uint16:
        raise UsageError(f"{what}: needs a float32 and a uint16 array, got {a.dtype} and {w.dtype}")
    if a.size != w.size:
        raise UsageError(f"{what}: {a.size} float32 elements but {w.size} wire elements")
    if not (a.flags.c_contiguous and w.flags.c_contiguous):
        raise UsageError(f"{what}: buffers must be C-contiguous")
    return a.reshape(-1), w.reshape(-1)


def encode_wire(src: Any, dst: Any = None, wire: str = "bf16", *, check_finite: bool = True,
                backend: str | LowpKernels | None = None) -> Any:
    """Round float32 ``src`` to ``wire`` (nearest even) into uint16 ``dst`` in one pass; returns ``dst``.

    Raises [`NonFiniteError`][gradcoll.errors.NonFiniteError] if an encoded value is Inf/NaN, including
    a finite float32 that overflows the wire format (never sent as Inf).
    """
    fast = fast_path("lowp", backend)
    if fast is not None:  # plain arrays: validated and encoded in one C call
        res = fast[0](src, dst, wire, check_finite, fast[2] if wire == "bf16" else fast[3])
        if res is not None and res is not False:
            return res
    _check_wire(wire)
    if is_device(src):
        return resolve("lowp", device=True, backend=backend).lowp_encode_device(src, dst, wire, check_finite)
    if dst is None:
        dst = np.empty(np.shape(src), np.uint16)
    a, w = _arrays(src, dst, "encode_wire")
    if not w.flags.writeable:
        raise UsageError("encode_wire: dst must be writeable")
    if not resolve("lowp", a.size, backend=backend, half=wire == "fp16").lowp_encode(a, w, wire, check_finite):
        lowp_reference.raise_nonfinite(a, w, wire, "encode_wire")
    return dst


def decode_wire(src: Any, dst: Any = None, wire: str = "bf16", *, backend: str | LowpKernels | None = None) -> Any:
    """Widen uint16 ``src`` in ``wire`` to float32 ``dst`` (exact); returns ``dst``."""
    _check_wire(wire)
    if is_device(src):
        return resolve("lowp", device=True, backend=backend).lowp_decode_device(src, dst, wire)
    if dst is None:
        dst = np.empty(np.shape(src), np.float32)
    a, w = _arrays(dst, src, "decode_wire")
    resolve("lowp", a.size, backend=backend, half=wire == "fp16").lowp_decode(w, a, wire)
    return dst


def accumulate_wire(acc: Any, x: Any, wire: str, *, divide_by: float | None = None, check_finite: bool = True,
                    backend: str | LowpKernels | None = None) -> Any:
    """Fused ``acc += decode(x)`` in float32, then ``acc /= divide_by``, with the finite check; returns ``acc``."""
    fast = fast_path("lowp", backend)
    if fast is not None:
        res = fast[1](acc, x, wire, divide_by, check_finite, fast[2] if wire == "bf16" else fast[3])
        if res is True:
            return acc
        if res is False:  # acc already holds the sum: explain, do not add again
            _raise_accumulate(acc.reshape(-1), x.reshape(-1), wire)
    _check_wire(wire)
    if divide_by is not None and divide_by == 0:
        raise UsageError("divide_by must be non-zero")
    if is_device(acc):
        be = resolve("lowp", device=True, backend=backend)
        if not be.lowp_accumulate_device(acc, x, wire, divide_by, check_finite):
            raise NonFiniteError("accumulate_wire (cuda): the float32 accumulator holds NaN/Inf", contributor=None)
        return acc
    a, w = _arrays(acc, x, "accumulate_wire")
    if not a.flags.writeable:
        raise UsageError("accumulate_wire: acc must be writeable")
    if not resolve("lowp", a.size, backend=backend, half=wire == "fp16").lowp_accumulate(a, w, wire, divide_by, check_finite):
        _raise_accumulate(a, w, wire)
    return acc


def _raise_accumulate(a: np.ndarray, w: np.ndarray, wire: str) -> None:
    dec = np.empty(w.size, np.float32)
    lowp_reference.lowp_decode(w, dec, wire)
    reference.raise_accumulate(a, dec)

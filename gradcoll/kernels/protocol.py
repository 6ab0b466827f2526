"""What a kernel backend implements: the calls the facade makes once it has validated the arguments.

The facade functions of [`gradcoll.kernels`][gradcoll.kernels] check shapes, dtypes and
contiguity, pick an implementation (``gradcoll.kernels.select``) and call it
with plain, flat, C-contiguous arrays. The backends gradcoll ships are modules
(``numpy_backend``, ``numba_cpu``, ``cython_backend``, ``cuda``; ``*_lowp``;
``*_exact``), each with the methods of the kinds it serves. ``backend=`` also
takes an object with these methods: every call of the facade then goes to it,
whatever the buffer's size, dtype or ``GRADCOLL_KERNELS``. It needs only the
methods of the kinds it is used for; the facade names a missing one. This is
the seam the simulator uses to charge virtual time instead of computing
(``gradcoll.model.sim.SimKernels``).

Conventions shared by every method: arrays are 1-D (``rows`` is a 2-D array or
a sequence of 1-D arrays of one length), ``check`` asks for the finite check,
and a ``bool`` result is True when the result (or the encoded buffer) is
finite or was not checked. On False the facade finds the culprit itself and
raises [`NonFiniteError`][gradcoll.errors.NonFiniteError]; a backend never has
to say where the NaN was. Summation order is contributors 0..n-1 for every
element, so that every backend gives the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["ReduceKernels", "LowpKernels", "ExactKernels", "DeviceKernels", "KernelBackend", "KIND_METHODS"]


class ReduceKernels(Protocol):
    """The kinds ``reduce`` ([`mean_reduce`][gradcoll.kernels.mean_reduce]), ``accumulate``,
    ``finite`` ([`check_finite`][gradcoll.kernels.check_finite]) and ``scale``."""

    def reduce_rows(self, rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype[Any],
                    divisor: float, check: bool) -> bool:
        """``out = sum(rows) / divisor``, summed in ``acc_dtype`` in row order (``out`` may be another dtype)."""
        ...

    def accumulate(self, acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None,
                   check: bool) -> bool:
        """In place ``acc += x``, then ``acc /= divisor`` and ``acc *= scale`` where given."""
        ...

    def is_all_finite(self, buf: np.ndarray) -> bool:
        """True when no element of ``buf`` is NaN or +/-Inf."""
        ...

    def scale(self, buf: np.ndarray, factor: float) -> None:
        """In place ``buf *= factor``."""
        ...


class LowpKernels(Protocol):
    """The kind ``lowp``: float32 to and from bf16/fp16 bit patterns in uint16 arrays
    ([`encode_wire`][gradcoll.kernels.encode_wire], [`decode_wire`][gradcoll.kernels.decode_wire],
    [`accumulate_wire`][gradcoll.kernels.accumulate_wire]); ``wire`` is ``"bf16"`` or ``"fp16"``."""

    def lowp_encode(self, src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
        """float32 ``src`` rounded to nearest even into uint16 ``dst``; False when an encoded value is Inf/NaN."""
        ...

    def lowp_decode(self, src: np.ndarray, dst: np.ndarray, wire: str) -> None:
        """uint16 ``src`` widened exactly into float32 ``dst``."""
        ...

    def lowp_accumulate(self, acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
        """In place float32 ``acc += decode(x)``, then ``acc /= divisor`` where given."""
        ...


class ExactKernels(Protocol):
    """The kind ``exact``: the order-independent reduction of the deterministic allreduce
    ([`exact_reduce`][gradcoll.kernels.exact_reduce]; the rules are in ``gradcoll.kernels.exact_reference``)."""

    def exact_reduce(self, own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float) -> int:
        """``out = (own + sum(rows)) / divisor`` exactly; the first non-finite output index, or -1."""
        ...


class DeviceKernels(Protocol):
    """Device arrays (``__cuda_array_interface__``): the facade hands them over unvalidated, and these methods
    validate, compute on the device and raise [`NonFiniteError`][gradcoll.errors.NonFiniteError] themselves."""

    def mean_reduce_device(self, inputs: Any, out: Any, *, op: str, check_finite: bool, accumulate_dtype: Any) -> Any:
        """[`mean_reduce`][gradcoll.kernels.mean_reduce] of device arrays; returns the device result."""
        ...

    def accumulate_device(self, acc: Any, x: Any, *, scale: float | None, divide_by: float | None,
                          check_finite: bool) -> Any:
        """[`accumulate`][gradcoll.kernels.accumulate] in place on the device."""
        ...

    def check_finite_device(self, buf: Any) -> None:
        """[`check_finite`][gradcoll.kernels.check_finite] on the device."""
        ...

    def scale_device(self, buf: Any, factor: float) -> None:
        """[`scale`][gradcoll.kernels.scale] in place on the device."""
        ...

    def lowp_encode_device(self, src: Any, dst: Any, wire: str, check: bool) -> Any:
        """[`encode_wire`][gradcoll.kernels.encode_wire] on the device; returns ``dst`` (allocated when None)."""
        ...

    def lowp_decode_device(self, src: Any, dst: Any, wire: str) -> Any:
        """[`decode_wire`][gradcoll.kernels.decode_wire] on the device; returns ``dst`` (allocated when None)."""
        ...

    def lowp_accumulate_device(self, acc: Any, x: Any, wire: str, divisor: float | None, check: bool) -> bool:
        """[`accumulate_wire`][gradcoll.kernels.accumulate_wire] in place on the device; True when finite."""
        ...


class KernelBackend(ReduceKernels, LowpKernels, ExactKernels, Protocol):
    """A backend serving every host kind."""


#: The methods the facade calls for each kind, on host arrays and on device arrays.
KIND_METHODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "reduce": (("reduce_rows",), ("mean_reduce_device",)),
    "accumulate": (("accumulate",), ("accumulate_device",)),
    "finite": (("is_all_finite",), ("check_finite_device",)),
    "scale": (("scale",), ("scale_device",)),
    "lowp": (("lowp_encode", "lowp_decode", "lowp_accumulate"),
             ("lowp_encode_device", "lowp_decode_device", "lowp_accumulate_device")),
    "exact": (("exact_reduce",), ()),
}

"""torch tensors as the NumPy arrays gradcoll reduces, and the errors the torch front end raises.

A CPU tensor's memory is viewed, never copied, except where the reduction
needs another type: bfloat16, which NumPy does not know, is viewed as its
uint16 bits and reduced on gradcoll's bf16 wire path (accumulated in
float32); float16 takes the fp16 path for sums and means. Integer and bool
tensors (DDP reduces its unused-parameter map and join counters this way)
are staged through float64, exact up to 2**53.

Every error a collective raises through the front end is also a
``RuntimeError``, which is what torch code catches around
``torch.distributed``: gradcoll's class is kept (``except
gradcoll.CollectiveTimeout`` still works) and ``RuntimeError`` is added to
it ([`as_runtime_error`][gradcoll.torch._tensors.as_runtime_error]).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GradcollError, NonFiniteError, UsageError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("gradcoll.torch needs PyTorch: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)") from exc

__all__ = ["NonFiniteGradientError", "UnsupportedError", "as_runtime_error", "as_array", "Staged", "REDUCE_DTYPES"]


class NonFiniteGradientError(NonFiniteError, RuntimeError):
    """A NaN or Inf in some rank's tensor: raised on every rank, naming the rank (and the parameter where known)."""


class UnsupportedError(UsageError, NotImplementedError):
    """An operation, reduce op or dtype the gradcoll backend does not serve; the message lists what it does."""


_RUNTIME: dict[type, type] = {NonFiniteError: NonFiniteGradientError}


def as_runtime_error(exc: BaseException, note: str = "") -> BaseException:
    """``exc`` made a ``RuntimeError`` too (same object, same attributes), with ``note`` appended to its message."""
    if note and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({note})", *exc.args[1:])
    cls = type(exc)
    if not isinstance(exc, GradcollError) or isinstance(exc, RuntimeError):
        return exc
    sub = _RUNTIME.get(cls)
    if sub is None:  # the same layout plus RuntimeError, so the instance can take the class in place
        sub = _RUNTIME[cls] = type(cls.__name__, (cls, RuntimeError), {"__module__": __name__, "__doc__": cls.__doc__})
    exc.__class__ = sub
    return exc


#: Reductions take these (torch dtype -> NumPy dtype of the view).
REDUCE_DTYPES: dict[Any, Any] = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                                 torch.bfloat16: np.uint16}
_EXACT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
SUPPORTED = "float32, float64, float16, bfloat16 (and integer or bool tensors, exact up to 2**53)"


def as_array(t: Any, what: str = "tensor") -> np.ndarray:
    """The memory of CPU tensor ``t`` as a NumPy array (bfloat16 as its uint16 bits), without a copy."""
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise UsageError(f"{what} is on {t.device}: the gradcoll backend reduces CPU tensors "
                         "(keep nccl for CUDA tensors, or use gradcoll.torch.comm_hook)")
    src = t.detach()
    bits = src.dtype == torch.bfloat16  # torch's .numpy() refuses bfloat16: its bits are viewed instead
    arr: np.ndarray = (src.view(torch.int16) if bits else src).numpy()  # typed: without torch mypy sees Any
    return arr.view(np.uint16) if bits else arr


class Staged:
    """The array a reduction of ``t`` runs on, its wire format, and how the result gets back into ``t``.

    float32/float64 are reduced in place; float16 in place (``"fp16"`` wire
    for sum and mean); bfloat16 sums and means in place as uint16 bits
    (``"bf16"`` wire), its max and min through a float32 copy; integer and
    bool tensors through a float64 copy. ``check_finite`` is False for the
    exact types (they cannot hold a NaN).
    """

    def __init__(self, t: Any, op: str, what: str = "tensor") -> None:
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise UsageError(f"{what} is not contiguous; call .contiguous() on it first")
        self.tensor, self.wire, self.exact = t, None, t.dtype in _EXACT
        self.copy: Any = None
        if t.dtype in (torch.float32, torch.float64, torch.float16):
            self.array = as_array(t, what)
            self.wire = "fp16" if t.dtype == torch.float16 and op in ("mean", "sum") else None
        elif t.dtype == torch.bfloat16 and op in ("mean", "sum"):
            self.array, self.wire = as_array(t, what), "bf16"
        elif t.dtype == torch.bfloat16 or self.exact:
            if self.exact and op == "mean":
                raise UnsupportedError(f"{what}: AVG of a {t.dtype} tensor is not supported (use SUM, or a float tensor)")
            self.copy = t.detach().to(torch.float32 if t.dtype == torch.bfloat16 else torch.float64)
            self.array = as_array(self.copy, what)
        else:
            raise UnsupportedError(f"{what} has dtype {t.dtype}; the gradcoll backend reduces {SUPPORTED}")

    def scale(self, factor: float) -> None:
        """Multiply the input by ``factor`` before the sum (PREMUL_SUM)."""
        if self.wire == "bf16":
            self.tensor.mul_(factor)
        else:
            self.array *= factor

    def finish(self) -> None:
        """Write a staged result back into the tensor (checked to be exact for integers)."""
        if self.copy is None:
            return
        if self.exact and self.array.size and float(np.abs(self.array).max()) >= 2.0 ** 53:
            raise UsageError(f"an integer reduction result exceeds 2**53 and is not exact; reduce {self.tensor.dtype} "
                             "tensors with smaller values, or split them")
        self.tensor.copy_(self.copy.round() if self.exact else self.copy)

"""The low-precision wire kernels of the ``cython`` backend: serial, compiled, no JIT warm-up.

Same interface and bits as ``gradcoll.kernels.numba_lowp`` (and the oracle
``gradcoll.kernels.lowp_reference``). A process group uses the ``cython`` kernels by
default, so its wire allreduce runs these: one thread per rank, where the
threaded Numba kernels of every rank would compete for the same cores.
Importing this module raises ImportError when the extension was not built.
"""

from __future__ import annotations

import numpy as np

from . import _cython_kernels as _ck  # type: ignore[attr-defined]
from .lowp_reference import fp16_table

NAME = "cython"

if not hasattr(_ck, "wire_encode"):  # an extension built before the wire kernels existed
    raise ImportError("the compiled extension has no wire kernels: rebuild it (pip install -e .)")


def encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst``; True when finite (or unchecked)."""
    ok = bool(_ck.wire_encode(src, dst, wire == "fp16"))
    return ok or not check


def decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` -> float32 ``dst``."""
    _ck.wire_accumulate(dst, src, fp16_table(), wire == "fp16", 1.0, False, True)


def accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """Fused ``acc += decode(x)`` then ``acc /= divisor``, with the finite check."""
    d = 1.0 if divisor is None else float(divisor)
    ok = bool(_ck.wire_accumulate(acc, x, fp16_table(), wire == "fp16", d, d != 1.0, False))
    return ok or not check


def warmup() -> None:
    """Nothing to compile: the extension is built at install time."""

"""The low-precision kernels of the ``cython`` backend: serial, compiled, no JIT warm-up.

Same interface and bits as ``gradcoll.kernels.numba_lowp`` (and the oracle
``gradcoll.kernels.lowp_reference``). A process group uses the ``cython`` kernels by
default, so its low-precision allreduce runs these: one thread per rank, where the
threaded Numba kernels of every rank would compete for the same cores.
Importing this module raises ImportError when the extension was not built.
"""

from __future__ import annotations

import numpy as np

from ._compiled import load
from .lowp_reference import fp16_table

NAME = "cython"

_ck = load()
if not hasattr(_ck, "lowp_encode_fast"):  # an extension built before these kernels existed
    raise ImportError("the compiled extension has no low-precision kernels: rebuild it (pip install -e .)")
_ck.set_fp16_table(fp16_table())  # for the validating entries of the fast path (gradcoll.kernels.select)


def lowp_encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst``; True when finite (or unchecked)."""
    ok = bool(_ck.lowp_encode(src, dst, wire == "fp16"))
    return ok or not check


def lowp_decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` -> float32 ``dst``."""
    _ck.lowp_accumulate(dst, src, fp16_table(), wire == "fp16", 1.0, False, True)


def lowp_accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """Fused ``acc += decode(x)`` then ``acc /= divisor``, with the finite check."""
    d = 1.0 if divisor is None else float(divisor)
    ok = bool(_ck.lowp_accumulate(acc, x, fp16_table(), wire == "fp16", d, d != 1.0, False))
    return ok or not check


def warmup() -> None:
    """Nothing to compile: the extension is built at install time."""

"""The ``cython`` backend: compiled kernels with the lowest per-call cost.

Imports the extension built from ``_cython_kernels.pyx``; if it was not built
(no compiler at install time), importing this module raises ImportError and
the selector falls back to Numba or NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import reference
from ._compiled import load

_ck = load()

NAME = "cython"


def reduce_rows(rows: Sequence[np.ndarray] | np.ndarray, out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool) -> bool:
    """Fixed-order reduce of ``rows`` into ``out`` (accumulating in ``acc_dtype``)."""
    target = reference.accumulator(out, acc_dtype)
    if isinstance(rows, np.ndarray):
        ok = _ck.reduce_2d(rows, target, divisor, check)
    else:
        ok = _ck.reduce_list(list(rows), target, divisor, check)
    return reference.store(out, target, ok, check)


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """In place ``acc += x`` with optional divide/scale; True when finite."""
    return bool(_ck.accumulate(acc, x, scale, divisor, check))


def is_all_finite(buf: np.ndarray) -> bool:
    """True when every element is finite."""
    return bool(_ck.is_all_finite(buf))


def scale(buf: np.ndarray, factor: float) -> None:
    """In-place ``buf *= factor``."""
    np.multiply(buf, buf.dtype.type(factor), out=buf)


def warmup() -> None:
    """Nothing to compile: the extension is built at install time."""

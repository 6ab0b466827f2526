"""The ``numpy`` backend: the reference kernels behind the common backend interface."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import reference

NAME = "numpy"


def reduce_rows(rows: Sequence[np.ndarray], out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool) -> bool:
    """Fixed-order sum of ``rows`` into ``out``; True when the result is all finite."""
    return reference.reduce_rows(rows, out, acc_dtype, divisor, check)


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """In-place ``acc += x`` with optional scaling; True when all finite."""
    return reference.accumulate(acc, x, scale, divisor, check)


def is_all_finite(buf: np.ndarray) -> bool:
    """True when every element is finite."""
    return reference.is_all_finite(buf)


def scale(buf: np.ndarray, factor: float) -> None:
    """In-place ``buf *= factor``."""
    np.multiply(buf, buf.dtype.type(factor), out=buf)


def warmup() -> None:
    """Nothing to compile."""

"""NumPy reference kernels: the oracle every other backend is tested against.

Summation order is fixed: ``acc = x[0]; acc += x[1]; ...; acc += x[n-1]``,
element by element, in the accumulation dtype; a mean then divides by ``n``.
The finite check looks at the result: any NaN/Inf input makes the sum
non-finite (NaN and Inf propagate through addition), and so does an overflow.
The exact culprit is located afterwards, on the error path only
(``locate_nonfinite``), and the ``raise_*`` functions build the error that
names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import NonFiniteError

__all__ = ["reduce_rows", "accumulator", "store", "accumulate", "is_all_finite", "locate_nonfinite", "raise_nonfinite", "raise_accumulate",
           "raise_finite", "first_bad", "finish", "NONE", "MUL", "DIV"]

#: How a compiled kernel finishes a result (``finish``): as it is, times an exact reciprocal, or divided.
NONE, MUL, DIV = 0, 1, 2


def reduce_rows(
    rows: Sequence[np.ndarray], out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool
) -> bool:
    """Sum ``rows`` in order into ``out`` (divided by ``divisor``); return True if all finite."""
    with np.errstate(over="ignore", invalid="ignore"):  # reported through the finite check
        return _reduce_rows(rows, out, acc_dtype, divisor, check)


def _reduce_rows(rows: Sequence[np.ndarray], out: np.ndarray, acc_dtype: np.dtype, divisor: float, check: bool) -> bool:
    acc = np.array(rows[0], dtype=acc_dtype, copy=True)
    for r in rows[1:]:
        if r.dtype == acc_dtype:
            np.add(acc, r, out=acc)
        else:
            np.add(acc, r.astype(acc_dtype), out=acc)
    if divisor != 1:
        np.divide(acc, acc_dtype.type(divisor), out=acc)
    np.copyto(out, acc, casting="unsafe")
    if check:
        return bool(np.isfinite(out).all())
    return True


def accumulator(out: np.ndarray, acc_dtype: np.dtype) -> np.ndarray:
    """Where a compiled reduce into ``out`` accumulates: ``out`` itself, or a buffer of ``acc_dtype``."""
    return out if out.dtype == acc_dtype else np.empty(out.shape, acc_dtype)


def store(out: np.ndarray, target: np.ndarray, ok: bool, check: bool) -> bool:
    """Finish a reduce accumulated in ``target`` (from ``accumulator``): the result in ``out``; True when finite.

    A result accumulated in another dtype is stored with a cast and checked again (a float16 ``out`` may overflow).
    """
    if target is not out:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out, target, casting="unsafe")
        if check and ok:
            ok = bool(np.isfinite(out).all())
    return bool(ok)


def accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    """``acc += x`` then optional ``*= scale`` or ``/= divisor``; return True if all finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _accumulate(acc, x, scale, divisor, check)


def _accumulate(acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None, check: bool) -> bool:
    np.add(acc, x, out=acc, casting="unsafe")
    if divisor is not None and divisor != 1:
        np.divide(acc, acc.dtype.type(divisor), out=acc)
    if scale is not None:
        np.multiply(acc, acc.dtype.type(scale), out=acc)
    if check:
        return bool(np.isfinite(acc).all())
    return True


def is_all_finite(buf: np.ndarray) -> bool:
    """True when every element of ``buf`` is finite."""
    return bool(np.isfinite(buf).all())


def locate_nonfinite(rows: Sequence[np.ndarray]) -> tuple[int | None, int | None, float | None]:
    """Return (contributor, element, value) of the first non-finite input, scanning
    element-major (lowest element first, then lowest contributor), or Nones."""
    best: tuple[int, int, float] | None = None
    for j, r in enumerate(rows):
        flat = np.asarray(r).reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat))
        if bad.size:
            i = int(bad[0])
            if best is None or i < best[1]:
                best = (j, i, float(flat[i]))
    if best is None:
        return None, None, None
    return best


def raise_nonfinite(rows: Sequence[np.ndarray], result: np.ndarray | None = None, what: str = "mean_reduce") -> None:
    """Build and raise the precise NonFiniteError after the fast path flagged a problem."""
    contributor, index, value = locate_nonfinite(rows)
    if contributor is not None:
        raise NonFiniteError(
            f"{what}: non-finite value {value!r} in input {contributor} at element {index}",
            contributor=contributor,
            index=index,
            value=value,
        )
    # Every input was finite: the result overflowed.
    idx = None
    val = None
    if result is not None:
        flat = result.reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat))
        if bad.size:
            idx = int(bad[0])
            val = float(flat[idx])
    raise NonFiniteError(
        f"{what}: result overflowed to {val!r} at element {idx} although every input is finite",
        contributor=None,
        index=idx,
        value=val,
    )


def first_bad(a: np.ndarray) -> int:
    """Index of the first NaN/Inf of ``a`` (there is one)."""
    return int(np.flatnonzero(~np.isfinite(a))[0])


def raise_accumulate(acc: np.ndarray, x: np.ndarray, what: str = "accumulate") -> None:
    """Error path of an accumulate: raise NonFiniteError naming the culprit.

    NaN/Inf in ``x`` survives into ``acc``, so ``x`` is looked at first;
    otherwise ``acc`` was already non-finite or the sum overflowed.
    """
    if not is_all_finite(x):
        i = first_bad(x)
        raise NonFiniteError(f"{what}: non-finite value {float(x[i])!r} in input 1 at element {i}",
                             contributor=1, index=i, value=float(x[i]))
    i = first_bad(acc)
    raise NonFiniteError(
        f"{what}: acc holds {float(acc[i])!r} at element {i} (non-finite before the add, or overflow)",
        contributor=0, index=i, value=float(acc[i]))


def raise_finite(a: np.ndarray) -> None:
    """Error path of check_finite: raise NonFiniteError naming the first bad element of ``a``."""
    i = first_bad(a)
    raise NonFiniteError(f"check_finite: non-finite value {float(a[i])!r} at element {i}", contributor=0, index=i,
                         value=float(a[i]))


def finish(divisor: float | None, dtype: np.dtype) -> tuple[int, float]:
    """How a compiled kernel divides by ``divisor`` in ``dtype``: (mode, factor), a multiplication when exact.

    x * 2**-k and x / 2**k are the same correctly rounded number, subnormal results included; any other
    divisor is divided by, as the NumPy reference does.
    """
    if divisor is None or divisor == 1:
        return NONE, 1.0
    mant, exp = math.frexp(divisor)  # math.frexp: np.frexp's per-call cost is many times larger
    lim = 126 if dtype == np.float32 else 1022
    if mant == 0.5 and -lim < exp <= lim:
        return MUL, 1.0 / float(divisor)
    return DIV, float(divisor)

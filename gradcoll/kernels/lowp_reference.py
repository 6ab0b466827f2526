"""NumPy reference of the low-precision kernels: the oracle for the Numba, Cython and CUDA ones.

A *wire* format is how a float32 gradient travels: ``bf16`` (the top 16 bits
of the float32, rounded to nearest even) or ``fp16`` (IEEE half, rounded to
nearest even by the IEEE conversion). Wire buffers are ``uint16`` arrays of
those bit patterns, so no framework dtype is needed. Accumulation is always
in float32: a received wire value is widened exactly (both formats are
subsets of float32) and added.

Bit rules shared by every backend:

* bf16 encode: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on the float32 bits
  ``u`` (round to nearest even); a NaN keeps its sign and top payload bits and
  is quieted (``| 0x0040``) so rounding can never turn it into an infinity.
* fp16 encode: IEEE round to nearest even, subnormals included; a NaN is
  quieted (``0x7E00 | payload >> 13``).
* The finite check looks at the *encoded* value: an exponent field of all
  ones (Inf or NaN) fails it. So a finite float32 that overflows the wire
  format (|x| >= 65520 in fp16, just below float32 max in bf16) is caught at
  encode time and never sent as an infinity.
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import NonFiniteError

__all__ = ["NAME", "WIRES", "lowp_encode", "lowp_decode", "lowp_accumulate", "encode", "decode", "accumulate",
           "wire_finite", "raise_nonfinite", "fp16_table"]

NAME = "numpy"

#: Wire formats by name; the value is the exponent mask of the encoded bits.
WIRES = {"bf16": 0x7F80, "fp16": 0x7C00}


def lowp_encode(src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
    """float32 ``src`` -> uint16 ``dst`` in ``wire``; True when every encoded value is finite."""
    if wire == "bf16":
        u = src.view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        np.copyto(dst, np.where(nan, (u >> 16) | 0x0040, rounded).astype(np.uint16))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            h = src.astype(np.float16).view(np.uint16)
        u32 = src.view(np.uint32)
        nan = (u32 & 0x7FFFFFFF) > 0x7F800000  # quieted, top payload bits kept (CPU conversions differ here)
        quiet = ((u32 >> 16) & 0x8000) | 0x7E00 | ((u32 & 0x007FFFFF) >> 13)
        np.copyto(dst, np.where(nan, quiet, h).astype(np.uint16))
    return wire_finite(dst, wire) if check else True


def lowp_decode(src: np.ndarray, dst: np.ndarray, wire: str) -> None:
    """uint16 ``src`` in ``wire`` -> float32 ``dst`` (exact)."""
    if wire == "bf16":
        np.copyto(dst, (src.astype(np.uint32) << 16).view(np.float32))
    else:
        np.copyto(dst, src.view(np.float16).astype(np.float32))


def lowp_accumulate(acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
    """``acc += decode(x)`` in float32, then ``acc /= divisor``; True when ``acc`` is all finite."""
    tmp = np.empty(acc.shape, np.float32)
    lowp_decode(x, tmp, wire)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(acc, tmp, out=acc)
        if divisor is not None and divisor != 1:
            np.divide(acc, np.float32(divisor), out=acc)
    return bool(np.isfinite(acc).all()) if check else True


def wire_finite(w: np.ndarray, wire: str) -> bool:
    """True when no encoded value has an all-ones exponent (Inf/NaN)."""
    mask = WIRES[wire]
    return not bool(((w & mask) == mask).any())


def raise_nonfinite(src: np.ndarray, w: np.ndarray, wire: str, what: str) -> None:
    """Raise the NonFiniteError of an encode that flagged a problem: the first value of ``src`` encoded as Inf/NaN."""
    mask = WIRES[wire]
    i = int(np.flatnonzero((w & mask) == mask)[0])
    value = float(src[i])
    why = "overflows the wire format" if np.isfinite(value) else "is not finite"
    raise NonFiniteError(f"{what}: value {value!r} at element {i} {why} ({wire})", contributor=0, index=i,
                         value=value)


#: The oracle's short names, as the tests know them.
encode, decode, accumulate = lowp_encode, lowp_decode, lowp_accumulate


@functools.cache
def fp16_table() -> np.ndarray:
    """float32 value of every fp16 bit pattern (256 KiB; the decode table of the JIT kernels)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

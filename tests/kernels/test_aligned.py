"""The compiled loops' head (elements up to a 64-byte aligned output) and their two-vector finite check.

The loops of ``_fused.h`` run the elements before the output's first 64-byte boundary one by one, then the
vector loop, then the tail; the vector loop checks ``t - t`` of sums of result vectors, which is also NaN
when that sum overflows with every result finite, and then rescans what it wrote. Each case is compared bit
for bit with the NumPy reference, at every offset of the output and the inputs within a cache line, serial
(``backend="cython"``) and threaded (the automatic choice runs the C loop on each thread's blocks).
"""

from __future__ import annotations

import numpy as np
import pytest

import gradcoll
from gradcoll import kernels as K
from gradcoll.kernels import reference
from tests.helpers import simd_widths

pytestmark = pytest.mark.skipif("cython" not in K.available_backends(),
                                reason="needs the compiled extension (pip install -e . with a C compiler)")


def at(offset: int, m: int, dtype: type, fill: np.ndarray | None = None) -> np.ndarray:
    """A 1-D array of ``m`` elements starting ``offset`` elements past a 64-byte boundary."""
    size = np.dtype(dtype).itemsize
    buf = np.zeros(m + 64 // size + offset + 16, dtype)
    skip = (-buf.ctypes.data % 64) // size + offset
    a = buf[skip:skip + m]
    assert m == 0 or (a.ctypes.data - offset * size) % 64 == 0
    if fill is not None:
        a[:] = fill
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_and_reduce_at_every_offset(dtype: type) -> None:
    rng = np.random.default_rng(21)
    per_line = 64 // np.dtype(dtype).itemsize
    for level in simd_widths("gradcoll.kernels._cython_kernels"):
        for m in (0, 1, 5, 17, 40, 100, 1000):
            for off_out in range(per_line):
                off_x = (off_out * 7 + 3) % per_line
                a0 = rng.standard_normal(m).astype(dtype)
                x0 = rng.standard_normal(m).astype(dtype)
                for d in (None, 4, 3):
                    want = a0.copy()
                    reference.accumulate(want, x0, None, d, False)
                    got = at(off_out, m, dtype, a0)
                    K.accumulate(got, at(off_x, m, dtype, x0), divide_by=d, backend="cython")
                    assert got.tobytes() == want.tobytes(), (level, m, off_out, d)
                rows = [at((off_x + k) % per_line, m, dtype, rng.standard_normal(m)) for k in range(3)]
                want = np.empty(m, dtype)
                reference.reduce_rows(rows, want, np.dtype(dtype), 3, False)
                out = at(off_out, m, dtype)
                K.mean_reduce(rows, out=out, backend="cython")
                assert out.tobytes() == want.tobytes(), (level, m, off_out)


@pytest.mark.parametrize("backend", ["cython", None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nonfinite_value_in_the_head_body_or_tail_is_caught(backend: str | None, dtype: type) -> None:
    m = 200_003 if backend is None else 1003  # None: threaded, each thread's blocks through the C loop
    for off in (0, 3, 5):
        for where in (0, 2, 7, 8, 500, m - 2, m - 1):
            for bad in (np.nan, np.inf, -np.inf):
                x = at(5, m, dtype, 1.0)
                x[where] = bad
                with pytest.raises(gradcoll.NonFiniteError) as ei:
                    K.accumulate(at(off, m, dtype, 1.0), x, divide_by=2, backend=backend)
                assert ei.value.index == where, (off, where)
                with pytest.raises(gradcoll.NonFiniteError) as ei:
                    K.mean_reduce([at(off, m, dtype, 1.0), x], out=at(off, m, dtype), backend=backend)
                assert (ei.value.contributor, ei.value.index) == (1, where), (off, where)


@pytest.mark.parametrize("backend", ["cython", None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_whose_sum_overflows_are_finite(backend: str | None, dtype: type) -> None:
    """Every result is finite, but two (accumulate) or four (reduce) neighbouring vectors of them add up to
    infinity: the check's sum overflows, the rescan finds nothing, and the call succeeds."""
    m = 200_003 if backend is None else 1003
    big = np.finfo(dtype).max / 1.5
    for off in (0, 3):
        acc = at(off, m, dtype, big)
        K.accumulate(acc, at(1, m, dtype, 0.0), backend=backend)
        assert np.all(acc == dtype(big))
        out = at(off, m, dtype)
        K.mean_reduce([at(2, m, dtype, big), at(0, m, dtype, 0.0)], out=out, op="sum", backend=backend)
        assert np.all(out == dtype(big))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_check_of_a_buffer(dtype: type) -> None:
    """The compiled check adds four vectors before testing them: a NaN or an Inf anywhere (vector body, a
    later 64 KiB block, the tail) is found, and finite values whose sum overflows are not reported."""
    for m in (0, 1, 31, 33, 16384 * 2 + 77, 100_003):
        for off in (0, 3):
            big = at(off, m, dtype, np.finfo(dtype).max / 1.5)
            assert _finite(big)
            for where in sorted({0, 7, 31, m // 2, m - 1} & set(range(m))):
                for bad in (np.nan, np.inf, -np.inf):
                    x = at(off, m, dtype, 0.5)
                    x[where] = bad
                    with pytest.raises(gradcoll.NonFiniteError) as ei:
                        K.check_finite(x, backend="cython")
                    assert ei.value.index == where, (m, off, where)


def _finite(buf: np.ndarray) -> bool:
    K.check_finite(buf, backend="cython")  # raises NonFiniteError when it finds one
    return True

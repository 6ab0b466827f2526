"""The blocks a threaded Numba kernel splits its elements into (``numba_cpu.split``): every element in exactly
one block, as many elements for every thread, and every block's finite flag counted."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the Numba kernels need numba (pip install numba)")

from gradcoll.kernels import numba_cpu, numba_lowp  # noqa: E402

SIZES = [0, 1, 15, 16, 17, 4095, 65_535, 65_536, 70_000, 100_000, 100_003, 3 * numba_cpu.BLOCK + 5, 1_000_007]


@pytest.mark.parametrize("m", SIZES)
def test_blocks_cover_every_element_once_and_give_every_thread_the_same_share(m: int) -> None:
    t = numba_cpu.THREADS
    nb, blk = numba_cpu.split(m)
    assert nb % t == 0 and nb >= t and blk % 16 == 0
    bounds = [(min(m, b * blk), min(m, b * blk + blk)) for b in range(nb)]
    assert bounds[0][0] == 0 and bounds[-1][1] == m
    assert all(lo == prev_hi for (lo, _), (_, prev_hi) in zip(bounds[1:], bounds[:-1], strict=True))  # no gap, no overlap
    per = nb // t  # prange hands each thread one contiguous run of per blocks
    shares = [bounds[(k + 1) * per - 1][1] - bounds[k * per][0] for k in range(t)]
    assert sum(shares) == m
    assert max(shares) <= m / t + 16 * per  # within one 16-element rounding per block of an even split


@pytest.mark.parametrize("m", [70_000, 100_003])
def test_a_non_finite_value_in_any_block_is_counted_by_the_threaded_kernels(m: int) -> None:
    rng = np.random.default_rng(m)
    a, b = rng.standard_normal((2, m)).astype(np.float32)
    big = np.float32(np.finfo(np.float32).max)
    nb, blk = numba_cpu.split(m)
    serial = np.empty(m, np.float32)
    assert numba_cpu.sum_serial((a, b), serial, np.float32(0.5), numba_cpu.MUL, big) == 0
    for at in sorted({0, blk - 1, blk, m // 2, (nb - 1) * blk - 1, m - 1} & set(range(m))):
        x = b.copy()
        x[at] = np.inf
        out = np.empty(m, np.float32)
        assert numba_cpu.sum_parallel((a, x), out, np.float32(0.5), numba_cpu.MUL, big) == 1, at
        keep = np.arange(m) != at
        assert out[keep].tobytes() == serial[keep].tobytes()
        acc = a.copy()
        assert numba_cpu.accumulate_parallel(acc, x, np.float32(1), numba_cpu.NONE, np.float32(1), False, big) == 1
        w = np.empty(m, np.uint16)
        assert numba_lowp.encode_parallel(x.view(np.uint32), w, numba_lowp.BF16) == 1, at
        assert numba_cpu.finite_parallel(x, big) == 1

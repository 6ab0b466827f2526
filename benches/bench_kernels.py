"""Kernel throughput against the anchors measured in the same run.

Anchors: the best NumPy baseline (``np.add(..., out=)`` chain, multiply,
``np.isfinite(...).all()``), a plain one-loop Numba kernel (``parallel=True``,
sum then scale, ``np.isfinite`` per element) and the machine's streaming
limit: a plain copy of the same number of bytes that the reduction reads and
writes ((n+1) x size x 4 bytes). Run with ``make bench``; the table at the
end gives time per call and ratios.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit, prange

from gradcoll import kernels as K

SIZES = [1_000, 10_000, 100_000, 1_000_000, 10_000_000]
CONTRIBUTORS = [2, 4, 8]
VARIANTS = ["copy", "numpy", "plain_numba", "gradcoll_auto", "gradcoll_numba", "gradcoll_cython"]


@njit(parallel=True)
def plain_numba(x, out):
    """The anchor: the obvious Numba loop, one branch per element."""
    n, m = x.shape
    bad = 0
    for i in prange(m):
        s = x[0, i]
        for j in range(1, n):
            s += x[j, i]
        s = s / n
        out[i] = s
        if not np.isfinite(s):
            bad += 1
    return bad


def numpy_baseline(rows, out):
    np.add(rows[0], rows[1], out=out)
    for r in rows[2:]:
        np.add(out, r, out=out)
    np.multiply(out, np.float32(1.0 / len(rows)), out=out)
    return bool(np.isfinite(out).all())


@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("n", CONTRIBUTORS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel(record, variant, n, m):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, m)).astype(np.float32)
    rows = list(x)
    out = np.empty(m, np.float32)
    if variant == "copy":
        half = (n + 1) * m // 2  # copying `half` floats reads and writes (n+1)*m floats
        src = np.ones(half, np.float32)
        dst = np.ones(half, np.float32)
        fn = lambda: np.copyto(dst, src)  # noqa: E731
    elif variant == "numpy":
        fn = lambda: numpy_baseline(rows, out)  # noqa: E731
    elif variant == "plain_numba":
        plain_numba(x, out)
        fn = lambda: plain_numba(x, out)  # noqa: E731
    elif variant == "gradcoll_auto":
        fn = lambda: K.mean_reduce(rows, out=out)  # noqa: E731
    else:
        be = variant.split("_", 1)[1]
        if be not in K.available_backends():
            pytest.skip(f"backend {be} not available")
        fn = lambda: K.mean_reduce(x, out=out, backend=be)  # noqa: E731
    fn()
    record(("kernels", variant, n, m), fn)


def bench_summary(results: dict[tuple, float]) -> str:
    """Ratios per (n, m): best gradcoll backend vs the anchors."""
    rows = []
    for n in CONTRIBUTORS:
        for m in SIZES:
            get = lambda v: results.get(("kernels", v, n, m))  # noqa: E731
            ours = {v: get(v) for v in VARIANTS if v.startswith("gradcoll") and get(v)}
            if not ours or not get("copy"):
                continue
            best_v, best_t = min(ours.items(), key=lambda kv: kv[1])
            rows.append(
                f"{n:>3} {m:>10,} {get('gradcoll_auto') * 1e6:>10.2f} {best_v:>16} {best_t * 1e6:>10.2f}"
                f" {get('numpy') / best_t:>8.2f} {get('plain_numba') / best_t:>8.2f} {get('copy') / best_t:>8.2f}"
            )
    if not rows:
        return ""
    head = (
        "kernel summary (float32, mean + finite check; median per call)\n"
        "  n       size    auto_us     best_backend    best_us  xNumPy  xPlainNB  ofStream"
    )
    return "\n".join([head, *rows])


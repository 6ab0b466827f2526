"""Per-call cost of the kernel facade on small buffers, against a plain Numba kernel measured in the same run.

At 1,000 float32 elements a call is mostly dispatch: argument checks, the
selection policy (``gradcoll.kernels.select``, including the read of
``GRADCOLL_KERNELS``) and the call into compiled code. The anchor is what a
user would write for the same job: a serial ``@njit`` loop over 1-D float32
arrays (the mean of the rows, with an ``isfinite`` test per element; serial,
because at this size ``parallel=True`` only adds the thread pool's wake-up).

    python benches/bench_dispatch.py            # best of 7 runs of 20,000 calls each, in microseconds

Run it under the CPU lock on a shared machine. The table gives time per call
and the ratio to the anchor.
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

import numpy as np
from numba import njit

from gradcoll import kernels as K

M = 1_000
CALLS = 20_000


@njit(cache=True)
def plain_mean2(a, b, out):
    """The anchor: mean of two rows, finite check per element."""
    bad = 0
    for i in range(out.shape[0]):
        s = (a[i] + b[i]) / np.float32(2.0)
        out[i] = s
        if not np.isfinite(s):
            bad += 1
    return bad


def best_us(fn: Callable[[], object]) -> float:
    fn()
    return min(timeit.repeat(fn, number=CALLS, repeat=7)) / CALLS * 1e6


def main() -> int:
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(M).astype(np.float32) for _ in range(4)]
    out = np.empty(M, np.float32)
    acc = np.ones(M, np.float32)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("anchor: plain @njit mean of 2 rows", lambda: plain_mean2(rows[0], rows[1], out)),
        ("mean_reduce(2 rows, out=)", lambda: K.mean_reduce(rows[:2], out=out)),
        ("mean_reduce(4 rows, out=)", lambda: K.mean_reduce(rows, out=out)),
        ("mean_reduce(2 rows, out=, backend='cython')", lambda: K.mean_reduce(rows[:2], out=out, backend="cython")),
        ("accumulate(acc, x, check_finite=False)", lambda: K.accumulate(acc, rows[0], check_finite=False)),
        ("check_finite(buf)", lambda: K.check_finite(acc)),
    ]
    anchor = best_us(cases[0][1])
    print(f"gradcoll.kernels from {K.__file__}")
    print(f"{'call (' + str(M) + ' float32)':<48} {'us/call':>8} {'x anchor':>9}")
    for name, fn in cases:
        t = anchor if fn is cases[0][1] else best_us(fn)
        print(f"{name:<48} {t:8.3f} {t / anchor:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

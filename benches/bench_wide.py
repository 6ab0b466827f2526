"""The extension's 512-bit loops against its AVX2 ones, back to back and after a pause, in one run.

    python benches/bench_wide.py                     # every kernel, 1e3-1e5 elements: about a minute
    python benches/bench_wide.py --kinds acc --sizes 1e3 1e4 --gap 200 1000

For each kernel and size, the call is timed at SIMD level 2 (the 512-bit
loops forced on, ``fp512(1)``) and at level 1 (AVX2), the two taking turns,
in batches of calls that each follow a stretch of pure Python work (``--gap``:
a loop of that many additions; 0 means back to back). The Python work's own
time, measured in the same turn, is taken off, so a figure is what the call
cost there. What it shows on Intel CPUs: the floating-point 512-bit loops
pay a few microseconds on a call that follows a pause, whatever the call's
size, and are no faster warm (docs/kernels.md, "512-bit floating point on
Intel CPUs"); the extension leaves them out there (``fp512()`` is False).
Needs the extension built and a CPU with AVX-512 (it says so otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

KINDS = ("acc", "acc_bf16", "acc_fp16", "enc_bf16", "enc_fp16")


def _case(kind: str, m: int) -> Callable[[], object]:
    from gradcoll.kernels import lowp_reference
    from gradcoll.kernels._compiled import load

    C = load()

    rng = np.random.default_rng(m)
    x = rng.standard_normal(m).astype(np.float32)
    acc = np.zeros(m, np.float32)
    w = np.empty(m, np.uint16)
    fp16 = kind.endswith("fp16")
    C.lowp_encode(x, w, fp16)
    table = lowp_reference.fp16_table() if fp16 else None
    if kind == "acc":
        return lambda: C.accumulate(acc, x, None, None, True)
    if kind.startswith("enc"):
        return lambda: C.lowp_encode(x, w, fp16)
    return lambda: C.lowp_accumulate(acc, w, table, fp16, 2.0, True, False)


def _work(k: int) -> int:
    s = 0
    for i in range(k):
        s += i
    return s


def _cost(fn: Callable[[], object], gap: int, calls: int) -> float:
    """us per call of ``fn`` when each follows ``gap`` additions of Python work (that work's time taken off)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        _work(gap)
    both = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(calls):
        _work(gap)
    alone = time.perf_counter() - t0
    return (both - alone) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--sizes", nargs="+", type=lambda t: int(float(t)), default=[1_000, 10_000, 100_000])
    p.add_argument("--gap", nargs="+", type=int, default=[0, 1000], help="Python additions between calls")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    from gradcoll.kernels._compiled import extension

    C = extension()
    if C is None:
        print("needs the compiled extension: make install", file=sys.stderr)
        return 2
    if C.simd_level() < 2:
        print("this CPU has no AVX-512: there is nothing to compare", file=sys.stderr)
        return 2
    default = C.fp512()
    print(f"fp512 by default here: {default}; us per call, median of {a.rounds} turns")
    print(f"{'kernel':9} {'elements':>9} {'gap':>5} {'AVX-512':>9} {'AVX2':>9} {'512/AVX2':>9}")
    try:
        C.fp512(1)
        for kind in a.kinds:
            for m in a.sizes:
                fn = _case(kind, m)
                calls = max(30, 300_000 // m)
                for gap in a.gap:
                    got: dict[int, list[float]] = {2: [], 1: []}
                    for _ in range(a.rounds):
                        for level in (2, 1):
                            C.simd_level(level)
                            for _ in range(3):
                                fn()
                            got[level].append(_cost(fn, gap, calls))
                    w, n = float(np.median(got[2])), float(np.median(got[1]))
                    print(f"{kind:9} {m:>9,} {gap:>5} {w:9.2f} {n:9.2f} {w / n if n > 0 else float('nan'):9.2f}",
                          flush=True)
    finally:
        C.simd_level(2)
        C.fp512(int(default))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One-shot GPU check: build the CUDA kernels, check them against the NumPy reference, time them.

On a machine with a CUDA GPU:

    python benches/gpu_check.py              # sizes up to 2**26 elements, 50 timed runs each
    python benches/gpu_check.py --sim        # tiny sizes under numba's CUDA simulator (a smoke test)

It compiles every CUDA kernel (reduce, accumulate, low-precision encode and
accumulate), checks their bits against the NumPy reference on fresh random
float32 data, plants NaN/+Inf/-Inf and checks that the error names the
contributor and element, then times each kernel with CUDA events (median of
the runs) against a device-to-device copy moving the same number of bytes.
The table gives the kernel's bandwidth (bytes read + written per second) and
``of_copy``, the copy's time over the kernel's: the target is at least 0.9.
Exit status 0 when every check passes (timings are reported, not judged),
1 on a mismatch, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def _timed(cuda: Any, fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of ``fn`` between two CUDA events."""
    start, stop = cuda.event(), cuda.event()
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ts.append(start.elapsed_time(stop) * 1e3)  # milliseconds
    return float(np.median(ts))


def check(cuda: Any, sizes: tuple[int, ...]) -> int:
    """Bits and NaN locations against the NumPy reference; the number of failures (each one printed)."""
    from gradcoll import NonFiniteError
    from gradcoll import kernels as K

    rng = np.random.default_rng(0)
    failures = 0

    def same(what: str, got: np.ndarray, want: np.ndarray) -> None:
        nonlocal failures
        if got.tobytes() != want.tobytes():
            failures += 1
            print(f"MISMATCH {what}")

    for n in (2, 4, 8):
        for m in sizes:
            x = rng.standard_normal((n, m)).astype(np.float32)
            same(f"mean_reduce n={n} m={m}", K.mean_reduce(cuda.to_device(x)).copy_to_host(), K.mean_reduce(x, backend="numpy"))
            for bad in (np.nan, np.inf, -np.inf):
                y = x.copy()
                j, i = n - 1, m // 2
                y[j, i] = bad
                try:
                    K.mean_reduce(cuda.to_device(y))
                    failures += 1
                    print(f"MISSED {bad} n={n} m={m}")
                except NonFiniteError as e:
                    if (e.contributor, e.index) != (j, i):
                        failures += 1
                        print(f"WRONG LOCATION {bad} n={n} m={m}: {e}")
    for m in sizes:
        a, b = rng.standard_normal((2, m)).astype(np.float32)
        d = cuda.to_device(a)
        K.accumulate(d, cuda.to_device(b), divide_by=3)
        want = a.copy()
        K.accumulate(want, b, divide_by=3, backend="numpy")
        same(f"accumulate m={m}", d.copy_to_host(), want)
        for wire in ("bf16", "fp16"):
            w = K.encode_wire(cuda.to_device(a), wire=wire, check_finite=False).copy_to_host()
            same(f"encode_wire {wire} m={m}", w, K.encode_wire(a, wire=wire, check_finite=False, backend="numpy"))
            acc = cuda.to_device(b)
            K.accumulate_wire(acc, cuda.to_device(w), wire, divide_by=2)
            ref = b.copy()
            K.accumulate_wire(ref, w, wire, divide_by=2, backend="numpy")
            same(f"accumulate_wire {wire} m={m}", acc.copy_to_host(), ref)
    return failures


def timings(cuda: Any, sizes: tuple[int, ...], reps: int) -> list[str]:
    """One line per kernel and size: its time, a same-bytes device-to-device copy's, bandwidth, of_copy."""
    from gradcoll.kernels import _cuda_kernels as ck
    from gradcoll.kernels import cuda as gk

    rng = np.random.default_rng(1)
    lines = [f"{'kernel':<16} {'n':>2} {'elements':>12} {'kernel_us':>10} {'copy_us':>10} {'GB/s':>8} {'of_copy':>8}"]
    flag = cuda.to_device(np.zeros(1, np.int32))
    for m in sizes:
        blocks, threads = gk._blocks(m), gk._threads()
        cases: list[tuple[str, int, int, Callable[[], object]]] = []
        for n in (2, 4, 8):
            dx = cuda.to_device(rng.standard_normal((n, m)).astype(np.float32))
            dout = cuda.device_array(m, np.float32)
            cases.append(("mean_reduce", n, (n + 1) * m * 4,
                          lambda dx=dx, dout=dout, n=n: ck._reduce_kernel[blocks, threads](dx, dout, np.float32(n), True, True, flag)))
        acc = cuda.to_device(rng.standard_normal(m).astype(np.float32))
        x = cuda.to_device(rng.standard_normal(m).astype(np.float32))
        w = cuda.device_array(m, np.uint16)
        one, u = np.float32(1), x.view(np.uint32)
        cases.append(("accumulate", 0, 3 * m * 4,
                      lambda: ck._accumulate_kernel[blocks, threads](acc, x, one, False, one, False, True, flag)))
        for wire in ("bf16", "fp16"):
            table, fp16 = gk._wire_table(wire), wire == "fp16"
            cases.append((f"encode {wire}", 0, m * 6,
                          lambda fp16=fp16: ck._lowp_encode_kernel[blocks, threads](u, w, fp16, flag)))
            cases.append((f"acc_wire {wire}", 0, m * 10, lambda table=table: ck._lowp_accumulate_kernel[blocks, threads](
                acc, w, table, one, False, False, True, flag)))
        for name, n, nbytes, fn in cases:
            src = cuda.device_array(nbytes // 8, np.float32)  # a copy reads and writes: half the bytes each way
            dst = cuda.device_array(nbytes // 8, np.float32)
            fn()  # compiles on first use
            tk = _timed(cuda, fn, reps)
            tc = _timed(cuda, lambda: dst.copy_to_device(src), reps)
            lines.append(f"{name:<16} {n or '':>2} {m:>12,} {tk:>10.1f} {tc:>10.1f} {nbytes / (tk * 1e-6) / 1e9:>8.1f} "
                         f"{tc / tk:>8.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", action="store_true", help="tiny sizes under the CUDA simulator (checks the script itself)")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args(argv)
    if a.sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is imported
    else:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    from numba import cuda

    if not a.sim and not cuda.is_available():
        print("no CUDA GPU available")
        return 2
    name = getattr(cuda.get_current_device(), "name", "the CUDA simulator")
    print("device:", name.decode() if isinstance(name, bytes) else name)
    check_sizes = (37,) if a.sim else (1, 1000, 1 << 20, 10_000_000)
    failures = check(cuda, check_sizes)
    print("correctness:", "OK" if failures == 0 else f"{failures} failures")
    for line in timings(cuda, (64,) if a.sim else (1 << 16, 1 << 20, 1 << 24, 1 << 26), 2 if a.sim else a.reps):
        print(line)
    print("target: of_copy >= 0.9 (the kernel moves its bytes at least 0.9 times as fast as a copy)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

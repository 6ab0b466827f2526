"""One-shot GPU check: correctness against the NumPy reference, then timings.

Run on a machine with a CUDA GPU (not under the simulator):

    python benches/gpu_check.py

It reduces fresh random float32 data on the device, checks the bits against
the NumPy reference, plants NaN/+Inf/-Inf and checks they are located, then
times the fused kernel with CUDA events (median of many runs) against a
device-to-device copy of the same bytes, and prints a short table.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def main() -> int:
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    from numba import cuda

    from gradcoll import NonFiniteError
    from gradcoll import kernels as K
    from gradcoll.kernels import cuda as gk

    if not cuda.is_available():
        print("no CUDA GPU available")
        return 2
    print("device:", cuda.get_current_device().name.decode() if hasattr(cuda.get_current_device().name, "decode") else cuda.get_current_device().name)
    rng = np.random.default_rng(0)
    failures = 0
    for n in (2, 4, 8):
        for m in (1, 1000, 1 << 20, 10_000_000):
            x = rng.standard_normal((n, m)).astype(np.float32)
            want = K.mean_reduce(x, backend="numpy")
            got = K.mean_reduce(cuda.to_device(x)).copy_to_host()
            if got.tobytes() != want.tobytes():
                failures += 1
                print(f"MISMATCH n={n} m={m}: max diff {np.max(np.abs(got - want))}")
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
                        print(f"WRONG LOCATION {bad}: {e}")
    print("correctness:", "OK" if failures == 0 else f"{failures} failures")

    print(f"{'n':>3} {'elems':>12} {'kernel_us':>10} {'copy_us':>10} {'GB/s':>8} {'ofCopy':>7}")
    for n in (2, 4, 8):
        for m in (1 << 16, 1 << 20, 1 << 24, 1 << 26):
            dx = cuda.to_device(rng.standard_normal((n, m)).astype(np.float32))
            dout = cuda.device_array(m, np.float32)
            half = (n + 1) * m // 2
            src = cuda.device_array(half, np.float32)
            dst = cuda.device_array(half, np.float32)

            def timed(fn, reps=50):
                start, stop = cuda.event(), cuda.event()
                ts = []
                for _ in range(reps):
                    start.record()
                    fn()
                    stop.record()
                    stop.synchronize()
                    ts.append(cuda.event_elapsed_time(start, stop) * 1e3)
                return float(np.median(ts))

            flag = cuda.to_device(np.zeros(1, np.int32))
            blocks = gk._blocks(m)

            def run_kernel():
                gk._reduce_kernel[blocks, gk.THREADS](dx, dout, np.float32(n), True, True, flag)

            run_kernel()
            tk = timed(run_kernel)
            tc = timed(lambda: dst.copy_to_device(src))
            gbs = (n + 1) * m * 4 / (tk * 1e-6) / 1e9
            print(f"{n:>3} {m:>12,} {tk:>10.1f} {tc:>10.1f} {gbs:>8.1f} {tc / tk:>7.2f}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

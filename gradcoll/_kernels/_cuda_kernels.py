"""numba.cuda kernels of the ``cuda``/``cudasim`` backends (device code only).

They live apart from the host code in :mod:`gradcoll._kernels.cuda` because
numba's simulator swaps the ``cuda`` global of a kernel's module while the
kernel runs: host code in the same module, called from another thread at that
moment, would see the simulator's fake module.
"""

import math

from numba import cuda, int32


@cuda.jit(cache=False)
def _reduce_kernel(x, out, divisor, dodiv, check, flag):
    bad = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    n = x.shape[0]
    m = out.shape[0]
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, m, stride):
        out[i] = x[0, i]  # the store converts to out's dtype (float64 accumulation when asked)
        acc = out[i]
        for j in range(1, n):
            acc += x[j, i]
        if dodiv:
            acc = acc / divisor
        out[i] = acc
        if check and (math.isnan(out[i]) or math.isinf(out[i])):
            bad[0] = 1
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and bad[0] != 0:
        cuda.atomic.max(flag, 0, 1)


@cuda.jit(cache=False)
def _accumulate_kernel(acc, x, scale, doscale, divisor, dodiv, check, flag):
    bad = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    for i in range(cuda.grid(1), acc.shape[0], cuda.gridsize(1)):
        v = acc[i] + x[i]
        if dodiv:
            v = v / divisor
        if doscale:
            v = v * scale
        acc[i] = v
        if check and (math.isnan(v) or math.isinf(v)):
            bad[0] = 1
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and bad[0] != 0:
        cuda.atomic.max(flag, 0, 1)


@cuda.jit(cache=False)
def _finite_kernel(buf, flag):
    bad = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    for i in range(cuda.grid(1), buf.shape[0], cuda.gridsize(1)):
        if math.isnan(buf[i]) or math.isinf(buf[i]):
            bad[0] = 1
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and bad[0] != 0:
        cuda.atomic.max(flag, 0, 1)


@cuda.jit(cache=False)
def _scale_kernel(buf, factor):
    for i in range(cuda.grid(1), buf.shape[0], cuda.gridsize(1)):
        buf[i] = buf[i] * factor

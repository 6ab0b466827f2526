"""numba.cuda kernels of the ``cuda``/``cudasim`` backends (device code only).

They live apart from the host code in ``gradcoll.kernels.cuda`` because
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


# -- low-precision kernels (see lowp_reference.py for the bit rules) --------------------
# Float bits are reached through uint32 views made on the host, and widening
# reads a 65,536-entry float32 table (bf16 or fp16), so no bit-cast intrinsic
# is needed and the simulator runs the same code.
@cuda.jit(device=True, inline=True)
def _enc_bf16(u):
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x0040
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


@cuda.jit(device=True, inline=True)
def _enc_fp16(u):
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x47800000:
        if a > 0x7F800000:
            return sign | 0x7E00 | ((a & 0x007FFFFF) >> 13)
        return sign | 0x7C00
    if a < 0x38800000:
        if a <= 0x33000000:
            return sign
        shift = 126 - (a >> 23)
        mant = (a & 0x007FFFFF) | 0x00800000
        r = mant >> shift
        rem = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (r & 1) != 0):
            r += 1
        return sign | r
    a = a - 0x38000000 + 0xFFF + ((a >> 13) & 1)
    return sign | (a >> 13)


@cuda.jit(cache=False)
def _lowp_encode_kernel(u, w, fp16, flag):
    bad = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    mask = 0x7C00 if fp16 else 0x7F80
    for i in range(cuda.grid(1), u.shape[0], cuda.gridsize(1)):
        v = _enc_fp16(u[i]) if fp16 else _enc_bf16(u[i])
        w[i] = v
        if (v & mask) == mask:
            bad[0] = 1
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and bad[0] != 0:
        cuda.atomic.max(flag, 0, 1)


@cuda.jit(cache=False)
def _lowp_accumulate_kernel(acc, w, table, divisor, dodiv, decode_only, check, flag):
    bad = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    for i in range(cuda.grid(1), acc.shape[0], cuda.gridsize(1)):
        v = table[w[i]]
        if not decode_only:
            v = acc[i] + v
        if dodiv:
            v = v / divisor
        acc[i] = v
        if check and (math.isnan(v) or math.isinf(v)):
            bad[0] = 1
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and bad[0] != 0:
        cuda.atomic.max(flag, 0, 1)

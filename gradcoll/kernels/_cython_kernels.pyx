# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled CPU kernels: the low-overhead path for small buffers.

Same contract and summation order as the NumPy reference: for every element,
contributions are added in order 0..n-1 in the accumulation type, then
divided once. The finite check is branch-free: it ORs the exponent bits of
each result block and tests the flag once per block; a NaN/Inf in any input
always reaches the sum (NaN and Inf propagate through addition), as does an
overflow. The caller locates the culprit on the error path only.
"""

cimport numpy as cnp
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, getenv, malloc
from libc.string cimport memcpy

cnp.import_array()

ctypedef fused src_t:
    float
    double

ctypedef fused acc_t:
    float
    double

cdef enum:
    BLOCK = 2048
    STACK_PTRS = 64


cdef inline bint _block_finite(acc_t* p, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint32_t b32, m32 = 0
    cdef uint64_t b64, m64 = 0
    if acc_t is float:
        for i in range(k):
            memcpy(&b32, &p[i], 4)
            m32 |= ((b32 & 0x7f800000u) + 0x00800000u)
        return (m32 & 0x80000000u) == 0
    else:
        for i in range(k):
            memcpy(&b64, &p[i], 8)
            m64 |= ((b64 & 0x7ff0000000000000ull) + 0x0010000000000000ull)
        return (m64 & 0x8000000000000000ull) == 0


cdef bint _reduce(src_t** xs, Py_ssize_t n, Py_ssize_t m, acc_t* out, acc_t divisor, bint dodiv, bint check) noexcept nogil:
    cdef Py_ssize_t lo, hi, i, j, k
    cdef bint ok = True
    cdef acc_t* o
    cdef src_t* x
    lo = 0
    while lo < m:
        hi = lo + BLOCK
        if hi > m:
            hi = m
        k = hi - lo
        o = out + lo
        x = xs[0] + lo
        for i in range(k):
            o[i] = <acc_t>x[i]
        for j in range(1, n):
            x = xs[j] + lo
            for i in range(k):
                o[i] = o[i] + <acc_t>x[i]
        if dodiv:
            for i in range(k):
                o[i] = o[i] / divisor
        if check and not _block_finite(o, k):
            ok = False
        lo = hi
    return ok


cdef bint _accumulate(acc_t* acc, acc_t* x, Py_ssize_t m, acc_t scale, bint doscale, acc_t divisor, bint dodiv, bint check) noexcept nogil:
    cdef Py_ssize_t lo, hi, i, k
    cdef bint ok = True
    cdef acc_t* a
    cdef acc_t* b
    lo = 0
    while lo < m:
        hi = lo + BLOCK
        if hi > m:
            hi = m
        k = hi - lo
        a = acc + lo
        b = x + lo
        for i in range(k):
            a[i] = a[i] + b[i]
        if dodiv:
            for i in range(k):
                a[i] = a[i] / divisor
        if doscale:
            for i in range(k):
                a[i] = a[i] * scale
        if check and not _block_finite(a, k):
            ok = False
        lo = hi
    return ok


cdef bint _run_reduce(void** ptrs, Py_ssize_t n, Py_ssize_t m, cnp.ndarray out, int src64, double divisor, bint check):
    cdef bint dodiv = divisor != 1.0
    cdef bint ok
    cdef int acc64 = cnp.PyArray_TYPE(out) == cnp.NPY_DOUBLE
    cdef void* po = cnp.PyArray_DATA(out)
    with nogil:
        if src64:
            ok = _reduce[double, double](<double**>ptrs, n, m, <double*>po, divisor, dodiv, check)
        elif acc64:
            ok = _reduce[float, double](<float**>ptrs, n, m, <double*>po, divisor, dodiv, check)
        else:
            ok = _reduce[float, float](<float**>ptrs, n, m, <float*>po, <float>divisor, dodiv, check)
    return ok


def reduce_list(list rows, cnp.ndarray out, double divisor, bint check):
    """Fixed-order reduce of a list of contiguous 1-D float arrays into ``out``."""
    cdef Py_ssize_t n = len(rows), j
    cdef void* stack[STACK_PTRS]
    cdef void** ptrs = stack
    cdef cnp.ndarray r
    cdef int src64 = 0
    if n > STACK_PTRS:
        ptrs = <void**>malloc(n * sizeof(void*))
        if ptrs == NULL:
            raise MemoryError()
    try:
        for j in range(n):
            r = <cnp.ndarray>rows[j]
            ptrs[j] = cnp.PyArray_DATA(r)
        src64 = cnp.PyArray_TYPE(<cnp.ndarray>rows[0]) == cnp.NPY_DOUBLE
        return _run_reduce(ptrs, n, cnp.PyArray_SIZE(out), out, src64, divisor, check)
    finally:
        if ptrs != stack:
            free(ptrs)


def reduce_2d(cnp.ndarray x, cnp.ndarray out, double divisor, bint check):
    """Fixed-order reduce of the rows of a C-contiguous 2-D float array into ``out``."""
    cdef Py_ssize_t n = x.shape[0], m = x.shape[1], j
    cdef void* stack[STACK_PTRS]
    cdef void** ptrs = stack
    cdef char* base = <char*>cnp.PyArray_DATA(x)
    cdef Py_ssize_t rowbytes = m * cnp.PyArray_ITEMSIZE(x)
    if n > STACK_PTRS:
        ptrs = <void**>malloc(n * sizeof(void*))
        if ptrs == NULL:
            raise MemoryError()
    try:
        for j in range(n):
            ptrs[j] = base + j * rowbytes
        return _run_reduce(ptrs, n, m, out, cnp.PyArray_TYPE(x) == cnp.NPY_DOUBLE, divisor, check)
    finally:
        if ptrs != stack:
            free(ptrs)


def accumulate(cnp.ndarray acc, cnp.ndarray x, scale, divisor, bint check):
    """In place ``acc += x`` (then ``/= divisor``, ``*= scale``); True when all finite."""
    cdef Py_ssize_t m = cnp.PyArray_SIZE(acc)
    cdef bint doscale = scale is not None
    cdef bint dodiv = divisor is not None and divisor != 1
    cdef double s = scale if doscale else 1.0
    cdef double d = divisor if dodiv else 1.0
    cdef bint ok
    cdef void* pa = cnp.PyArray_DATA(acc)
    cdef void* px = cnp.PyArray_DATA(x)
    with nogil:
        if cnp.PyArray_TYPE(acc) == cnp.NPY_DOUBLE:
            ok = _accumulate[double](<double*>pa, <double*>px, m, s, doscale, d, dodiv, check)
        else:
            ok = _accumulate[float](<float*>pa, <float*>px, m, <float>s, doscale, <float>d, dodiv, check)
    return ok


def is_all_finite(cnp.ndarray buf):
    """True when every element of the contiguous float buffer is finite."""
    cdef Py_ssize_t m = cnp.PyArray_SIZE(buf), lo = 0, k
    cdef bint ok = True
    cdef void* p = cnp.PyArray_DATA(buf)
    cdef int is64 = cnp.PyArray_TYPE(buf) == cnp.NPY_DOUBLE
    with nogil:
        while lo < m and ok:
            k = m - lo
            if k > BLOCK:
                k = BLOCK
            if is64:
                ok = _block_finite[double](<double*>p + lo, k)
            else:
                ok = _block_finite[float](<float*>p + lo, k)
            lo += k
    return ok


cdef inline bint _same_shape(cnp.ndarray a, cnp.ndarray b):
    cdef int k, nd = cnp.PyArray_NDIM(a)
    cdef cnp.npy_intp* da
    cdef cnp.npy_intp* db
    if nd != cnp.PyArray_NDIM(b):
        return False
    da = cnp.PyArray_DIMS(a)
    db = cnp.PyArray_DIMS(b)
    for k in range(nd):
        if da[k] != db[k]:
            return False
    return True


cdef inline bint _plain_float_array(object o, int typenum, Py_ssize_t size):
    """True when ``o`` is an exact, aligned, C-contiguous ndarray of ``typenum`` with ``size`` elements."""
    cdef cnp.ndarray a
    if not cnp.PyArray_CheckExact(o):
        return False
    a = <cnp.ndarray>o
    return (cnp.PyArray_TYPE(a) == typenum and cnp.PyArray_ISCARRAY_RO(a)
            and cnp.PyArray_SIZE(a) == size)


def reduce_fast(object inputs, object out, bint mean, bint check, Py_ssize_t limit):
    """Fast path of ``mean_reduce`` for the common small case, validated in C.

    Applies to a list or tuple of plain C-contiguous float32/float64 arrays of
    one shape (and an ``out`` of that shape and dtype, or None) with at most
    ``limit`` elements. Returns the output array when every value is finite,
    False when the finite check failed (``out`` filled), or None when the fast
    path does not apply (the caller then validates and explains).
    """
    cdef Py_ssize_t n, m, j
    cdef cnp.ndarray first, r, o
    cdef void* stack[STACK_PTRS]
    cdef int typenum
    cdef bint ok
    if type(inputs) is not list and type(inputs) is not tuple:
        return None
    n = len(inputs)
    if n == 0 or n > STACK_PTRS:
        return None
    if not cnp.PyArray_CheckExact(inputs[0]):
        return None
    first = <cnp.ndarray>inputs[0]
    typenum = cnp.PyArray_TYPE(first)
    if typenum != cnp.NPY_FLOAT and typenum != cnp.NPY_DOUBLE:
        return None
    m = cnp.PyArray_SIZE(first)
    if m > limit or not cnp.PyArray_ISCARRAY_RO(first):
        return None
    for j in range(n):
        if not _plain_float_array(inputs[j], typenum, m):
            return None
        r = <cnp.ndarray>inputs[j]
        if not _same_shape(r, first):
            return None
        stack[j] = cnp.PyArray_DATA(r)
    if out is None:
        o = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(first), cnp.PyArray_DIMS(first), typenum, 0)
    else:
        if not _plain_float_array(out, typenum, m) or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
            return None
        o = <cnp.ndarray>out
        if not _same_shape(o, first):
            return None
    ok = _run_reduce(stack, n, m, o, typenum == cnp.NPY_DOUBLE, <double>n if mean else 1.0, check)
    return o if ok else False


def accumulate_fast(object acc, object x, object scale, object divisor, bint check, Py_ssize_t limit):
    """Fast path of ``accumulate`` (same-dtype plain arrays up to ``limit`` elements).

    Returns True/False (finite or not) or None when it does not apply.
    """
    cdef cnp.ndarray a
    cdef int typenum
    cdef Py_ssize_t m
    if not cnp.PyArray_CheckExact(acc):
        return None
    a = <cnp.ndarray>acc
    typenum = cnp.PyArray_TYPE(a)
    m = cnp.PyArray_SIZE(a)
    if (typenum != cnp.NPY_FLOAT and typenum != cnp.NPY_DOUBLE) or m > limit:
        return None
    if not cnp.PyArray_ISCARRAY(a) or not _plain_float_array(x, typenum, m):
        return None
    if divisor is not None and divisor == 0:
        return None
    return accumulate(a, <cnp.ndarray>x, scale, divisor, check)


# -- low-precision kernels (same bits as lowp_reference.py; see numba_lowp.py for the rules) --------

cdef inline uint16_t _enc_bf16(uint32_t u) noexcept nogil:
    if (u & 0x7FFFFFFFu) > 0x7F800000u:
        return <uint16_t>((u >> 16) | 0x0040u)  # NaN: keep sign and top payload, quiet it
    return <uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)


cdef inline uint16_t _enc_fp16(uint32_t u) noexcept nogil:
    cdef uint32_t sign = (u >> 16) & 0x8000u
    cdef uint32_t a = u & 0x7FFFFFFFu
    cdef uint32_t shift, mant, r, rem, half, odd
    if a >= 0x47800000u:  # >= 65536, Inf or NaN
        if a > 0x7F800000u:
            return <uint16_t>(sign | 0x7E00u | ((a & 0x007FFFFFu) >> 13))
        return <uint16_t>(sign | 0x7C00u)
    if a < 0x38800000u:  # half subnormal (or zero): shift the significand, round half to even
        if a <= 0x33000000u:
            return <uint16_t>sign
        shift = 126u - (a >> 23)
        mant = (a & 0x007FFFFFu) | 0x00800000u
        r = mant >> shift
        rem = mant & ((1u << shift) - 1u)
        half = 1u << (shift - 1u)
        if rem > half or (rem == half and (r & 1u) != 0):
            r += 1u
        return <uint16_t>(sign | r)
    odd = (a >> 13) & 1u
    a = a - 0x38000000u + 0xFFFu + odd  # rebias 127 -> 15, round half to even
    return <uint16_t>(sign | (a >> 13))  # a carry into the exponent gives Inf at 65520


def lowp_encode(cnp.ndarray src, cnp.ndarray dst, bint fp16):
    """float32 ``src`` -> uint16 ``dst``; True when every encoded value is finite."""
    cdef Py_ssize_t m = cnp.PyArray_SIZE(src), i
    cdef uint32_t* u = <uint32_t*>cnp.PyArray_DATA(src)
    cdef uint16_t* w = <uint16_t*>cnp.PyArray_DATA(dst)
    cdef uint32_t flag = 0
    cdef uint16_t v
    with nogil:
        if fp16:
            for i in range(m):
                v = _enc_fp16(u[i])
                w[i] = v
                flag |= (<uint32_t>v & 0x7C00u) + 0x0400u
        else:
            for i in range(m):
                v = _enc_bf16(u[i])
                w[i] = v
                flag |= (<uint32_t>v & 0x7F80u) + 0x0080u
    return (flag & 0x8000u) == 0


def lowp_accumulate(cnp.ndarray acc, cnp.ndarray src, cnp.ndarray table, bint fp16, double divisor, bint dodiv,
                    bint decode_only):
    """``acc += decode(src)`` (``acc = decode(src)`` with ``decode_only``), then ``/= divisor``; True when finite."""
    cdef Py_ssize_t m = cnp.PyArray_SIZE(acc), lo = 0, hi, i, k
    cdef float* a = <float*>cnp.PyArray_DATA(acc)
    cdef uint16_t* w = <uint16_t*>cnp.PyArray_DATA(src)
    cdef float* t = <float*>cnp.PyArray_DATA(table)
    cdef float d = <float>divisor
    cdef float x
    cdef uint32_t b
    cdef bint ok = True
    with nogil:
        while lo < m:
            hi = lo + BLOCK
            if hi > m:
                hi = m
            k = hi - lo
            for i in range(lo, hi):
                if fp16:
                    x = t[w[i]]
                else:
                    b = (<uint32_t>w[i]) << 16
                    memcpy(&x, &b, 4)
                if decode_only:
                    a[i] = x
                else:
                    a[i] = a[i] + x
            if dodiv:
                for i in range(lo, hi):
                    a[i] = a[i] / d
            if not _block_finite[float](a + lo, k):
                ok = False
            lo = hi
    return ok


# -- the selection policy's view of GRADCOLL_KERNELS (gradcoll/kernels/select.py) ---------------------------

def kernels_env():
    """``GRADCOLL_KERNELS`` stripped and lower-cased, or None when unset or empty.

    C ``getenv`` costs about 50 ns; ``os.environ.get`` of an unset name costs
    about 1 us (a KeyError raised and caught), as much as a whole small
    reduce. ``os.environ`` writes through ``putenv``/``unsetenv``, so every
    change made through it is seen here.
    """
    cdef const char* v = getenv(b"GRADCOLL_KERNELS")
    if v == NULL or v[0] == 0:
        return None
    return (<bytes>v).decode("utf-8", "surrogateescape").strip().lower() or None

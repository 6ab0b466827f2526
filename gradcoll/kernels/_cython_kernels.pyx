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
from libc.float cimport DBL_MAX, FLT_MAX
from libc.math cimport frexp
from libc.stdint cimport uint16_t, uint32_t
from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdlib cimport free, getenv, malloc
from libc.string cimport memcmp

cnp.import_array()

cdef extern from "_fused.h" nogil:
    ctypedef Py_ssize_t gc_ssize
    enum:
        GC_NONE
        GC_MUL
        GC_DIV
    int gc_reduce_ff(const float* const* xs, gc_ssize n, gc_ssize m, float* out, float f, int mode, int nt)
    int gc_reduce_dd(const double* const* xs, gc_ssize n, gc_ssize m, double* out, double f, int mode, int nt)
    int gc_reduce_fd(const float* const* xs, gc_ssize n, gc_ssize m, double* out, double f, int mode, int nt)
    int gc_acc_f(float* acc, const float* x, gc_ssize m, float d, int mode, float sc, int doscale)
    int gc_acc_d(double* acc, const double* x, gc_ssize m, double d, int mode, double sc, int doscale)
    int gc_finite_f(const float* p, gc_ssize m)
    int gc_finite_d(const double* p, gc_ssize m)
    int gc_encode_bf16(const uint32_t* u, uint16_t* w, gc_ssize m)
    int gc_encode_fp16(const uint32_t* u, uint16_t* w, gc_ssize m)
    int gc_acc_bf16(float* acc, const uint16_t* w, gc_ssize m, float d, int mode, int decode_only)
    int gc_acc_fp16(float* acc, const uint16_t* w, const float* table, gc_ssize m, float d, int mode, int decode_only)
    int gc_set_simd_cap(int cap)
    int gc_set_fp512(int on)

cdef enum:
    STACK_PTRS = 64
    # Below this many elements moved the GIL is kept: releasing and taking it back costs more than the work.
    NOGIL_ELEMS = 32768

def _last_level_cache_bytes():
    """The largest cache the kernel reports for CPU 0 (``/sys/devices/system/cpu/cpu0/cache``), or 0."""
    import glob

    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(d + "/size") as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


#: Outputs of at least this many bytes are written with non-temporal stores: the last-level cache's size
#: (at least 32 MiB, the CI machine's L3). An output as large cannot stay in it anyway, and these stores skip
#: reading every output line before it is overwritten. A smaller one is better written through the cache: the
#: next reader finds it there, and a non-temporal store must first evict a line that is already cached (on a
#: machine with a large L3, an output that fits in it was slower and far noisier written that way than
#: through the cache: docs/kernels.md, "Non-temporal stores").
#: ``set_stream_bytes`` changes it (benches/bench_kernels.py --stream-bytes).
STREAM_BYTES = max(32 << 20, _last_level_cache_bytes())
cdef Py_ssize_t _stream_bytes = STREAM_BYTES


def simd_level(int cap=-1):
    """The widest vector loops this module's kernels run (2 AVX-512, 1 AVX2, 0 neither), after lowering
    them to at most ``cap`` when it is given (the tests run every level the CPU has; 2 restores them)."""
    return gc_set_simd_cap(cap)


def fp512(int on=-1):
    """Whether the 512-bit floating-point loops run (the CPU's default: not on Intel CPUs, see ``_fused.h``'s
    ``gc_fp512``), after setting it to ``on`` (0 or 1) when it is given."""
    return bool(gc_set_fp512(on))


def set_stream_bytes(Py_ssize_t nbytes):
    """Set the output size from which reduces write with non-temporal stores (see ``cython_backend``)."""
    global _stream_bytes, STREAM_BYTES
    _stream_bytes = nbytes
    STREAM_BYTES = nbytes


cdef inline int _finish(double divisor, double* f) noexcept nogil:
    """How a result is divided: not at all, by multiplying with an exact reciprocal (a power of two), or dividing."""
    cdef int e
    if divisor == 1.0:
        f[0] = 1.0
        return GC_NONE
    if frexp(divisor, &e) == 0.5 and -1000 < e < 1000:
        f[0] = 1.0 / divisor  # exact: the product has the same bits as the quotient
        return GC_MUL
    f[0] = divisor
    return GC_DIV


cdef bint _run_reduce(void** ptrs, Py_ssize_t n, Py_ssize_t m, cnp.ndarray out, int src64, double divisor, bint check):
    cdef double f
    cdef int mode = _finish(divisor, &f)
    cdef int ok
    cdef int acc64 = cnp.PyArray_TYPE(out) == cnp.NPY_DOUBLE
    cdef void* po = cnp.PyArray_DATA(out)
    cdef int nt = m * (8 if acc64 else 4) >= _stream_bytes
    if mode == GC_MUL and not acc64 and not (1.1754943508222875e-38 <= f <= 1.7014118346046923e+38):
        mode, f = GC_DIV, divisor  # the float32 reciprocal would not be exact
    if m * n < NOGIL_ELEMS:
        ok = _reduce_c(ptrs, n, m, po, src64, acc64, f, mode, nt)
    else:
        with nogil:
            ok = _reduce_c(ptrs, n, m, po, src64, acc64, f, mode, nt)
    return ok or not check


cdef inline int _reduce_c(void** ptrs, Py_ssize_t n, Py_ssize_t m, void* po, int src64, int acc64, double f,
                          int mode, int nt) noexcept nogil:
    if src64:
        return gc_reduce_dd(<const double**>ptrs, n, m, <double*>po, f, mode, nt)
    if acc64:
        return gc_reduce_fd(<const float**>ptrs, n, m, <double*>po, f, mode, nt)
    return gc_reduce_ff(<const float**>ptrs, n, m, <float*>po, <float>f, mode, nt)


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


cdef bint _run_accumulate(cnp.ndarray acc, cnp.ndarray x, double scale, bint doscale, double divisor, bint check):
    cdef Py_ssize_t m = cnp.PyArray_SIZE(acc)
    cdef double f
    cdef int mode = _finish(divisor, &f)
    cdef int ok
    cdef void* pa = cnp.PyArray_DATA(acc)
    cdef void* px = cnp.PyArray_DATA(x)
    cdef int is64 = cnp.PyArray_TYPE(acc) == cnp.NPY_DOUBLE
    if mode == GC_MUL and not is64 and not (1.1754943508222875e-38 <= f <= 1.7014118346046923e+38):
        mode, f = GC_DIV, divisor
    if m < NOGIL_ELEMS:
        if is64:
            ok = gc_acc_d(<double*>pa, <double*>px, m, f, mode, scale, doscale)
        else:
            ok = gc_acc_f(<float*>pa, <float*>px, m, <float>f, mode, <float>scale, doscale)
    else:
        with nogil:
            if is64:
                ok = gc_acc_d(<double*>pa, <double*>px, m, f, mode, scale, doscale)
            else:
                ok = gc_acc_f(<float*>pa, <float*>px, m, <float>f, mode, <float>scale, doscale)
    return ok or not check


def accumulate(cnp.ndarray acc, cnp.ndarray x, scale, divisor, bint check):
    """In place ``acc += x`` (then ``/= divisor``, ``*= scale``); True when all finite."""
    cdef bint doscale = scale is not None
    return _run_accumulate(acc, x, scale if doscale else 1.0, doscale,
                           divisor if divisor is not None else 1.0, check)


def is_all_finite(cnp.ndarray buf):
    """True when every element of the contiguous float buffer is finite."""
    cdef Py_ssize_t m = cnp.PyArray_SIZE(buf)
    cdef void* p = cnp.PyArray_DATA(buf)
    cdef int ok
    with nogil:
        if cnp.PyArray_TYPE(buf) == cnp.NPY_DOUBLE:
            ok = gc_finite_d(<double*>p, m)
        else:
            ok = gc_finite_f(<float*>p, m)
    return ok != 0


# -- the threaded kernels behind the fast entries (gradcoll.kernels.select registers them) -------------------
# Above its limit a fast entry still validates the call in C and then hands it to these Python callables (the
# threaded Numba kernels of the automatic choice): the facade's Python validation of a large call ran at the
# speed of a cold cache (the kernel had just streamed megabytes through it), a noticeable share of the call.
cdef object _threaded_reduce = None
cdef Py_ssize_t _threaded_max_inputs = 0
cdef object _threaded_accumulate = None
cdef object _threaded_encode = None
cdef object _threaded_lowp_accumulate = None


def set_threaded(object reduce, Py_ssize_t max_inputs, object accumulate, object encode, object lowp_accumulate):
    """Register the kernels that take a validated call of 1-D arrays above a fast entry's limit (None: none).

    ``reduce(xs, out, divisor, check)`` gets a tuple of at most ``max_inputs`` writeable arrays,
    ``accumulate(acc, x, scale, divisor, check)``, ``encode(src, dst, wire, check)`` and
    ``lowp_accumulate(acc, x, wire, divisor, check)`` the arguments of the facade; each returns True when finite.
    """
    global _threaded_reduce, _threaded_max_inputs, _threaded_accumulate, _threaded_encode, _threaded_lowp_accumulate
    _threaded_reduce, _threaded_max_inputs = reduce, max_inputs
    _threaded_accumulate, _threaded_encode, _threaded_lowp_accumulate = accumulate, encode, lowp_accumulate


# The threaded reduce of 1 to 8 inputs as C functions (``numba_cpu.reduce_entry``, registered after its first
# call through ``_threaded_reduce``), by float64 or not and the count of inputs: a large call then runs with no
# Python between this entry and the threads (docs/kernels.md, "The threaded kernels without Python").
ctypedef long long (*_entry_f)(float**, float*, long long, float, long long, float) noexcept nogil
ctypedef long long (*_entry_d)(double**, double*, long long, double, long long, double) noexcept nogil
cdef enum:
    ENTRY_INPUTS = 8
cdef void* _entries[2][ENTRY_INPUTS + 1]
cdef double _entry_min = 0.0  # from this many outputs for 2 inputs (scaled by the bytes moved) the entries run


def set_threaded_reduce(bint double, Py_ssize_t n, size_t address, Py_ssize_t parallel_elems):
    """Register the address of the threaded reduce of ``n`` inputs (float64 when ``double``, else float32),
    ``int64 f(T** xs, T* out, int64 m, T factor, int64 mode, T big)``, for the calls of at least
    ``parallel_elems`` outputs of 2 inputs (``3 / (n + 1)`` of that for n); address 0 removes it."""
    global _entry_min
    if not 1 <= n <= ENTRY_INPUTS:
        raise ValueError(f"an entry takes 1 to {ENTRY_INPUTS} inputs, not {n}")
    _entries[1 if double else 0][n] = <void*>address
    _entry_min = 3.0 * <double>parallel_elems


def threaded_reduce_entries():
    """The (float64, count of inputs) pairs whose threaded reduce runs from C (``set_threaded_reduce``)."""
    return [(bool(d), k) for d in range(2) for k in range(1, ENTRY_INPUTS + 1) if _entries[d][k] != NULL]


# The threaded accumulate and low-precision kernels as C functions (``numba_cpu.accumulate_entry``,
# ``numba_lowp.entry``), by name, each from its own count of elements.
ctypedef long long (*_acc_entry_f)(float*, float*, long long, float, long long, float, long long, float,
                                   long long) noexcept nogil
ctypedef long long (*_acc_entry_d)(double*, double*, long long, double, long long, double, long long,
                                   double, long long) noexcept nogil
ctypedef long long (*_enc_entry)(uint32_t*, uint16_t*, long long) noexcept nogil
ctypedef long long (*_lacc_entry)(float*, uint16_t*, float*, long long, float, long long) noexcept nogil
cdef enum:
    E_ACC_F32 = 0
    E_ACC_F64 = 1
    E_ENC_BF16 = 2
    E_ENC_FP16 = 3
    E_ACC_BF16 = 4
    E_ACC_FP16 = 5
    E_COUNT = 6
ENTRY_NAMES = ("accumulate_f32", "accumulate_f64", "encode_bf16", "encode_fp16", "accumulate_bf16", "accumulate_fp16")
cdef void* _named[E_COUNT]
cdef Py_ssize_t _named_from[E_COUNT]


def set_threaded_entry(str name, size_t address, Py_ssize_t parallel_elems):
    """Register the address of a threaded kernel (one of ``ENTRY_NAMES``, the signatures of
    ``numba_cpu.accumulate_entry`` and ``numba_lowp.entry``) for calls of at least ``parallel_elems`` elements
    above a fast entry's limit; address 0 removes it."""
    if name not in ENTRY_NAMES:
        raise ValueError(f"unknown threaded entry {name!r}; one of {', '.join(ENTRY_NAMES)}")
    k = ENTRY_NAMES.index(name)
    _named[k] = <void*>address
    _named_from[k] = parallel_elems


def threaded_entries():
    """The names of the threaded kernels that run from C (``set_threaded_entry``)."""
    return [name for k, name in enumerate(ENTRY_NAMES) if _named[k] != NULL]


cdef inline int _f32_finish(double divisor, double* f) noexcept nogil:
    """``_finish`` for a float32 result: a reciprocal float32 cannot hold exactly is divided by instead."""
    cdef int mode = _finish(divisor, f)
    if mode == GC_MUL and not (1.1754943508222875e-38 <= f[0] <= 1.7014118346046923e+38):
        f[0] = divisor
        return GC_DIV
    return mode


cdef bint _run_acc_entry(void* e, cnp.ndarray a, cnp.ndarray x, Py_ssize_t m, bint dbl, double sc, bint doscale,
                         double divisor, bint check):
    cdef double f
    cdef int mode = _finish(divisor, &f) if dbl else _f32_finish(divisor, &f)
    cdef long long bad
    cdef void* pa = cnp.PyArray_DATA(a)
    cdef void* px = cnp.PyArray_DATA(x)
    with nogil:
        if dbl:
            bad = (<_acc_entry_d>e)(<double*>pa, <double*>px, m, f, mode, sc, doscale, DBL_MAX,
                                    <long long><size_t><void*>gc_acc_d)  # the entry runs this loop on each block
        else:
            bad = (<_acc_entry_f>e)(<float*>pa, <float*>px, m, <float>f, mode, <float>sc, doscale, FLT_MAX,
                                    <long long><size_t><void*>gc_acc_f)
    return bad == 0 or not check


cdef inline int _run_entry(void* e, void** ptrs, Py_ssize_t m, void* po, bint dbl, double divisor) noexcept nogil:
    """Run a registered entry; the number of blocks holding a non-finite result."""
    cdef double f
    cdef int mode = _finish(divisor, &f)
    if mode == GC_MUL and not dbl and not (1.1754943508222875e-38 <= f <= 1.7014118346046923e+38):
        mode, f = GC_DIV, divisor  # the float32 reciprocal would not be exact
    if dbl:
        return <int>(<_entry_d>e)(<double**>ptrs, <double*>po, m, f, mode, DBL_MAX)
    return <int>(<_entry_f>e)(<float**>ptrs, <float*>po, m, <float>f, mode, FLT_MAX)


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
    one shape (and an ``out`` of that shape and dtype, or None). It reduces
    them itself up to ``limit`` elements for 2 inputs, and ``3 / (n + 1)`` of
    that for n (the same bytes moved); above it, writeable 1-D arrays go to
    the registered threaded kernel (``set_threaded``). Returns the output array when every value is finite,
    False when the finite check failed (``out`` filled), or None when the fast
    path does not apply (the caller then validates and explains).
    """
    return _reduce_fast(inputs, out, mean, check, limit)


cdef object _reduce_fast(object inputs, object out, bint mean, bint check, Py_ssize_t limit):
    cdef Py_ssize_t n, m, j
    cdef cnp.ndarray first, o
    cdef PyObject* item
    cdef cnp.ndarray r
    cdef cnp.npy_intp* dims
    cdef int nd
    cdef void* stack[STACK_PTRS]
    cdef int typenum, bad
    cdef bint ok, big, dbl
    cdef void* e
    cdef void* po
    cdef double divisor
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
    big = <double>m * (n + 1) > 3.0 * <double>limit  # by the bytes it moves: limit is a 2-input call's
    if big and (_threaded_reduce is None or n > _threaded_max_inputs or cnp.PyArray_NDIM(first) != 1):
        return None
    if not cnp.PyArray_ISCARRAY_RO(first):
        return None
    nd = cnp.PyArray_NDIM(first)
    dims = cnp.PyArray_DIMS(first)
    for j in range(n):  # borrowed items, and the shape compared without a size product per input
        item = PyList_GET_ITEM(inputs, j) if type(inputs) is list else PyTuple_GET_ITEM(inputs, j)
        if not cnp.PyArray_CheckExact(<object>item):
            return None
        r = <cnp.ndarray><object>item
        if (cnp.PyArray_TYPE(r) != typenum or not cnp.PyArray_ISCARRAY_RO(r) or cnp.PyArray_NDIM(r) != nd
                or memcmp(cnp.PyArray_DIMS(r), dims, nd * sizeof(cnp.npy_intp)) != 0
                or (big and not cnp.PyArray_ISWRITEABLE(r))):  # one array type for Numba
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
    if big:
        e = _entries[typenum == cnp.NPY_DOUBLE][n] if n <= ENTRY_INPUTS else NULL
        if e != NULL and <double>m * (n + 1) >= _entry_min:
            po = cnp.PyArray_DATA(o)
            dbl = typenum == cnp.NPY_DOUBLE
            divisor = <double>n if mean else 1.0
            with nogil:
                bad = _run_entry(e, stack, m, po, dbl, divisor)
            ok = bad == 0 or not check
        else:
            ok = _threaded_reduce(tuple(inputs), o, <double>n if mean else 1.0, check)
    else:
        ok = _run_reduce(stack, n, m, o, typenum == cnp.NPY_DOUBLE, <double>n if mean else 1.0, check)
    return o if ok else False


# -- the compiled twin of gradcoll.kernels.mean_reduce -----------------------------------------------------

cdef dict _facade_cache = None  # select's fast entries of "reduce", by request (select._FAST_CACHE["reduce"])
cdef object _facade_python = None  # the Python facade: every call this one does not take
cdef object _facade_rest = None  # its path after the fast entry: validation, the policy, the error's message


def bind_mean_reduce(dict cache, object python, object rest):
    """Give ``mean_reduce`` the policy's cache of reduce entries, the Python facade and that facade's rest."""
    global _facade_cache, _facade_python, _facade_rest
    _facade_cache, _facade_python, _facade_rest = cache, python, rest


def mean_reduce(inputs, out=None, *, op="mean", check_finite=True, backend=None, accumulate_dtype=None):
    """``gradcoll.kernels.mean_reduce`` without a Python frame for the common call.

    A call with the default backend, no ``GRADCOLL_KERNELS``, no ``accumulate_dtype`` and ``op`` "mean" or
    "sum" runs the fast entry the policy chose for it (``select.fast_path``, read from the same cache), and
    the Python facade's rest where that entry declines or finds a non-finite value. Every other call is the
    Python facade's. Same arguments, results and errors.
    """
    cdef const char* env
    cdef object entry, res
    cdef bint mean
    if backend is None and accumulate_dtype is None and _facade_cache is not None and type(op) is str:
        env = getenv(b"GRADCOLL_KERNELS")
        if env == NULL or env[0] == 0:
            entry = _facade_cache.get(None)
            if entry is not None and (op == "mean" or op == "sum"):
                mean = op == "mean"
                res = _reduce_fast(inputs, out, mean, check_finite, <Py_ssize_t>(<tuple>entry)[1])
                if res is not None and res is not False:
                    return res
                return _facade_rest(inputs, out, op, check_finite, backend, accumulate_dtype)
    return _facade_python(inputs, out, op=op, check_finite=check_finite, backend=backend,
                          accumulate_dtype=accumulate_dtype)


def accumulate_fast(object acc, object x, object scale, object divisor, bint check, Py_ssize_t limit):
    """Fast path of ``accumulate`` (same-dtype plain arrays up to ``limit`` elements).

    Above ``limit``, 1-D arrays go to the registered threaded kernel (``set_threaded``). Returns True/False
    (finite or not) or None when it does not apply.
    """
    cdef cnp.ndarray a
    cdef int typenum, k
    cdef Py_ssize_t m
    cdef bint doscale = scale is not None
    if not cnp.PyArray_CheckExact(acc):
        return None
    a = <cnp.ndarray>acc
    typenum = cnp.PyArray_TYPE(a)
    m = cnp.PyArray_SIZE(a)
    if (typenum != cnp.NPY_FLOAT and typenum != cnp.NPY_DOUBLE) or (m > limit and _threaded_accumulate is None):
        return None
    if not cnp.PyArray_ISCARRAY(a) or not _plain_float_array(x, typenum, m):
        return None
    if divisor is not None and divisor == 0:
        return None
    if m > limit:
        if cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_NDIM(<cnp.ndarray>x) != 1:
            return None
        k = E_ACC_F64 if typenum == cnp.NPY_DOUBLE else E_ACC_F32
        if _named[k] != NULL and m >= _named_from[k]:
            return _run_acc_entry(_named[k], a, <cnp.ndarray>x, m, typenum == cnp.NPY_DOUBLE,
                                  scale if doscale else 1.0, doscale, divisor if divisor is not None else 1.0, check)
        return bool(_threaded_accumulate(a, x, scale, divisor, check))
    return _run_accumulate(a, <cnp.ndarray>x, scale if doscale else 1.0, doscale,
                           divisor if divisor is not None else 1.0, check)


# -- low-precision kernels (same bits as lowp_reference.py; the loops are in _fused.h) -----------------------

cdef bint _encode(cnp.ndarray src, cnp.ndarray dst, bint fp16):
    cdef Py_ssize_t m = cnp.PyArray_SIZE(src)
    cdef uint32_t* u = <uint32_t*>cnp.PyArray_DATA(src)
    cdef uint16_t* w = <uint16_t*>cnp.PyArray_DATA(dst)
    cdef int ok
    if m < NOGIL_ELEMS:
        ok = gc_encode_fp16(u, w, m) if fp16 else gc_encode_bf16(u, w, m)
    else:
        with nogil:
            ok = gc_encode_fp16(u, w, m) if fp16 else gc_encode_bf16(u, w, m)
    return ok != 0


cdef bint _lowp_acc(cnp.ndarray acc, cnp.ndarray src, cnp.ndarray table, bint fp16, double divisor, bint dodiv,
                    bint decode_only):
    cdef Py_ssize_t m = cnp.PyArray_SIZE(acc)
    cdef float* a = <float*>cnp.PyArray_DATA(acc)
    cdef uint16_t* w = <uint16_t*>cnp.PyArray_DATA(src)
    cdef float* t = <float*>cnp.PyArray_DATA(table)
    cdef double f
    cdef int mode = _finish(divisor if dodiv else 1.0, &f)
    cdef int ok
    if mode == GC_MUL and not (1.1754943508222875e-38 <= f <= 1.7014118346046923e+38):
        mode, f = GC_DIV, divisor
    if m < NOGIL_ELEMS:
        ok = gc_acc_fp16(a, w, t, m, <float>f, mode, decode_only) if fp16 else gc_acc_bf16(a, w, m, <float>f, mode, decode_only)
    else:
        with nogil:
            ok = (gc_acc_fp16(a, w, t, m, <float>f, mode, decode_only) if fp16
                  else gc_acc_bf16(a, w, m, <float>f, mode, decode_only))
    return ok != 0


def lowp_encode(cnp.ndarray src, cnp.ndarray dst, bint fp16):
    """float32 ``src`` -> uint16 ``dst``; True when every encoded value is finite."""
    return _encode(src, dst, fp16)


def lowp_accumulate(cnp.ndarray acc, cnp.ndarray src, cnp.ndarray table, bint fp16, double divisor, bint dodiv,
                    bint decode_only):
    """``acc += decode(src)`` (``acc = decode(src)`` with ``decode_only``), then ``/= divisor``; True when finite."""
    return _lowp_acc(acc, src, table, fp16, divisor, dodiv, decode_only)


cdef object _fp16_table = None


def set_fp16_table(cnp.ndarray table):
    """Keep the float32 value of every fp16 bit pattern (``lowp_reference.fp16_table``) for the fast entries."""
    global _fp16_table
    _fp16_table = table


cdef inline int _wire_code(object wire):
    """0 for bf16, 1 for fp16, -1 for anything else (the facade then explains)."""
    if wire == "bf16":
        return 0
    if wire == "fp16":
        return 1
    return -1


def lowp_encode_fast(object src, object dst, object wire, bint check, Py_ssize_t limit):
    """Fast path of ``encode_wire``: a plain float32 ``src`` of at most ``limit`` elements (above it, 1-D arrays
    go to the registered threaded kernel), a plain writeable uint16 ``dst`` of the same size (or None). Returns ``dst``, False when an encoded value is Inf/NaN
    (``dst`` filled), or None when the fast path does not apply."""
    cdef cnp.ndarray a, w
    cdef Py_ssize_t m
    cdef int code = _wire_code(wire), k
    cdef void* e
    cdef uint32_t* pu
    cdef uint16_t* pw
    cdef long long bad
    if code < 0 or not cnp.PyArray_CheckExact(src):
        return None
    a = <cnp.ndarray>src
    m = cnp.PyArray_SIZE(a)
    if (m > limit and (_threaded_encode is None or cnp.PyArray_NDIM(a) != 1)) or not _plain_float_array(a, cnp.NPY_FLOAT, m):
        return None
    if dst is None:
        w = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(a), cnp.PyArray_DIMS(a), cnp.NPY_UINT16, 0)
    elif not (cnp.PyArray_CheckExact(dst) and cnp.PyArray_TYPE(<cnp.ndarray>dst) == cnp.NPY_UINT16
              and cnp.PyArray_ISCARRAY(<cnp.ndarray>dst) and cnp.PyArray_SIZE(<cnp.ndarray>dst) == m):
        return None
    else:
        w = <cnp.ndarray>dst
    if m > limit:
        if cnp.PyArray_NDIM(w) != 1:
            return None
        k = E_ENC_FP16 if code == 1 else E_ENC_BF16
        e = _named[k]
        if e != NULL and m >= _named_from[k]:
            pu = <uint32_t*>cnp.PyArray_DATA(a)
            pw = <uint16_t*>cnp.PyArray_DATA(w)
            with nogil:
                bad = (<_enc_entry>e)(pu, pw, m)
            return w if bad == 0 or not check else False
        return w if _threaded_encode(a, w, wire, check) else False
    return w if _encode(a, w, code == 1) or not check else False


def lowp_accumulate_fast(object acc, object x, object wire, object divisor, bint check, Py_ssize_t limit):
    """Fast path of ``accumulate_wire``: a plain writeable float32 ``acc`` of at most ``limit`` elements (above
    it, 1-D arrays go to the registered threaded kernel) and a
    plain uint16 ``x`` of the same size. Returns True/False (finite or not) or None when it does not apply."""
    cdef cnp.ndarray a, w
    cdef Py_ssize_t m
    cdef double d, f
    cdef int code = _wire_code(wire), k, mode
    cdef void* e
    cdef float* pa
    cdef float* pt
    cdef uint16_t* pw
    cdef long long bad
    if code < 0 or _fp16_table is None or not cnp.PyArray_CheckExact(acc) or not cnp.PyArray_CheckExact(x):
        return None
    if divisor is not None and divisor == 0:
        return None
    a = <cnp.ndarray>acc
    w = <cnp.ndarray>x
    m = cnp.PyArray_SIZE(a)
    if (cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT or not cnp.PyArray_ISCARRAY(a)
            or cnp.PyArray_TYPE(w) != cnp.NPY_UINT16 or not cnp.PyArray_ISCARRAY_RO(w) or cnp.PyArray_SIZE(w) != m):
        return None
    if m > limit:
        if _threaded_lowp_accumulate is None or cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_NDIM(w) != 1:
            return None
        k = E_ACC_FP16 if code == 1 else E_ACC_BF16
        e = _named[k]
        if e != NULL and m >= _named_from[k]:
            mode = _f32_finish(1.0 if divisor is None else <double>divisor, &f)
            pa = <float*>cnp.PyArray_DATA(a)
            pw = <uint16_t*>cnp.PyArray_DATA(w)
            pt = <float*>cnp.PyArray_DATA(<cnp.ndarray>_fp16_table)
            with nogil:
                bad = (<_lacc_entry>e)(pa, pw, pt, m, <float>f, mode)
            return bad == 0 or not check
        return bool(_threaded_lowp_accumulate(a, w, wire, divisor, check))
    d = 1.0 if divisor is None else <double>divisor
    return _lowp_acc(a, w, <cnp.ndarray>_fp16_table, code == 1, d, d != 1.0, False) or not check


def kernel_addresses():
    """The addresses of the C loops that a threaded caller runs block by block (``numba_lowp``, under
    ``prange``): ``encode_bf16(u, w, m)``, ``encode_fp16(u, w, m)``, ``acc_bf16(acc, w, m, d, mode,
    decode_only)``, ``acc_fp16(acc, w, table, m, d, mode, decode_only)``, and ``acc_f32``/``acc_f64(acc, x, m, d,
    mode, scale, doscale)`` (``numba_cpu``), the signatures of ``_fused.h``;
    each returns 1 when every result is finite."""
    return {"encode_bf16": <size_t><void*>gc_encode_bf16, "encode_fp16": <size_t><void*>gc_encode_fp16,
            "acc_bf16": <size_t><void*>gc_acc_bf16, "acc_fp16": <size_t><void*>gc_acc_fp16,
            "acc_f32": <size_t><void*>gc_acc_f, "acc_f64": <size_t><void*>gc_acc_d}


# -- the selection policy's view of GRADCOLL_KERNELS (gradcoll/kernels/select.py) ---------------------------

def kernels_env():
    """``GRADCOLL_KERNELS`` stripped and lower-cased, or None when unset or empty.

    C ``getenv`` is cheap; ``os.environ.get`` of an unset name raises and
    catches a KeyError, which costs as much as a whole small reduce.
    ``os.environ`` writes through ``putenv``/``unsetenv``, so every change
    made through it is seen here.
    """
    cdef const char* v = getenv(b"GRADCOLL_KERNELS")
    if v == NULL or v[0] == 0:
        return None
    return (<bytes>v).decode("utf-8", "surrogateescape").strip().lower() or None

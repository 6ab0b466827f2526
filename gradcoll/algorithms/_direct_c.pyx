# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The direct allreduce over a shared window, compiled: a whole batch of pieces in one ``nogil`` call.

``gradcoll.algorithms.direct`` plans the collective (one-shot or two-shot,
the pieces, the descriptor) and calls ``Plan.run`` once per batch of
pieces; everything between, copying in, publishing, waiting, reducing,
publishing and copying out, runs here without the interpreter. The waiting
protocol is the transport's (``gradcoll.transport._window_c``, cimported).
Counters: 0 arrived (a piece is in this rank's slot), 1 reduced (its share
is in its result ring), 2 done (it no longer reads anyone's slot for that
piece). A piece of tick ``t`` sits in ring buffer ``t % depth`` of every
slot; before overwriting one, a rank waits until every rank is done with
tick ``t - depth``.

Kernels, all in ``gradcoll/kernels`` headers: the sums are the n-input
fused sum (``_fused.h``: the ranks' slots added in rank order 0..n-1 in
registers, then divided once, the finite check folded in); ``exact`` is the
reduction of ``gradcoll.kernels.exact_reference`` (same bits as
``exact_reduce``), and ``bf16``/``fp16`` widen the wire values, sum in
float32 and round the result to the wire format once (the rules of
``lowp_reference``): ``_window_kernels.h``. Max and min go in 2,048-element
blocks with the same branch-free finite check, here.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from gradcoll.transport._window_c cimport (
    H_COUNTERS, H_DESCRIPTORS, H_REPORT, HEADER_BYTES, N_DESCRIPTORS, W_OK, WinC,
    win_fill, win_now, win_publish, win_wait_all,
)

cnp.import_array()

# The kernels of gradcoll.kernels (_fused.h): the n-input fused sum (one pass, every input summed in registers)
# and the bf16/fp16 encode and widening loops (vectorised; F16C for fp16), AVX2 where the CPU has it.
cdef extern from "../kernels/_fused.h" nogil:
    ctypedef Py_ssize_t gc_ssize
    int gc_reduce_ff(const float* const* xs, gc_ssize n, gc_ssize m, float* out, float f, int mode, int nt)
    int gc_reduce_dd(const double* const* xs, gc_ssize n, gc_ssize m, double* out, double f, int mode, int nt)
    int GC_NONE, GC_MUL, GC_DIV
    int gc_set_simd_cap(int cap)
    int gc_set_fp512(int on)

cdef extern from "../kernels/_window_kernels.h":
    int GCD_BLOCK
    void gcd_copy(char* d, const char* s, size_t n) nogil
    int gcd_exact32(const float* const* xs, int n, int64_t m, float* out, double div, double recip,
                    double limit, int64_t hi, int64_t lo, int64_t bmin) nogil
    int gcd_exact_f64(const double* const* xs, int n, int64_t m, double* out, double div, double recip,
                      double limit, int64_t hi, int64_t lo, int64_t bmin) nogil
    void gcd_encode(const float* src, uint16_t* dst, int64_t m, int fp16) nogil
    void gcd_decode(const uint16_t* src, float* dst, int64_t m, int fp16, const float* table) nogil
    int gcd_wire_reduce(const uint16_t* const* xs, int n, int64_t m, uint16_t* enc, float* dec, float div,
                        int dodiv, int fp16, const float* table, const float* mine, int me) nogil

ctypedef fused real:
    float
    double

cdef enum:
    ARRIVED = 0
    REDUCED = 1
    DONE = 2
    MAXN = 64
    # ops and variants (gradcoll.algorithms.direct names the same numbers)
    OP_MEAN = 0
    OP_SUM = 1
    OP_MAX = 2
    OP_MIN = 3
    OP_GATHER = 4
    OP_BCAST = 5
    V_PLAIN = 0
    V_EXACT = 1
    V_BF16 = 2
    V_FP16 = 3
    # results of run() beyond the window's wait codes (1..5)
    S_DONE = 0
    S_MORE = 16
    S_MISMATCH = 17
    S_NONFINITE = 18
    # the counter a rank publishes once its piece with a non-finite result is whole in its slot
    FILLED = 3


cdef inline bint _block_finite(real* p, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint32_t b32, m32 = 0
    cdef uint64_t b64, m64 = 0
    if real is float:
        for i in range(k):
            memcpy(&b32, &p[i], 4)
            m32 |= ((b32 & 0x7f800000u) + 0x00800000u)
        return (m32 & 0x80000000u) == 0
    else:
        for i in range(k):
            memcpy(&b64, &p[i], 8)
            m64 |= ((b64 & 0x7ff0000000000000ull) + 0x0010000000000000ull)
        return (m64 & 0x8000000000000000ull) == 0


cdef bint _minmax(real** xs, int n, Py_ssize_t m, real* out, bint is_max, bint check) noexcept nogil:
    """Element-wise max (or min) over ``n`` inputs; a NaN anywhere gives NaN (as ``numpy.maximum``).

    The check reads every input, not only the result: an infinity that the max (min) leaves out
    must halt every rank as well.
    """
    cdef Py_ssize_t lo = 0, hi, i, k
    cdef int j
    cdef bint ok = True
    cdef real* o
    cdef real* x
    cdef real a, b
    while lo < m:
        hi = lo + GCD_BLOCK
        if hi > m:
            hi = m
        k = hi - lo
        o = out + lo
        x = xs[0] + lo
        for i in range(k):
            o[i] = x[i]
        for j in range(1, n):
            x = xs[j] + lo
            for i in range(k):
                a = o[i]
                b = x[i]
                if is_max:
                    o[i] = a if (a > b or a != a) else b
                else:
                    o[i] = a if (a < b or a != a) else b
            if check and not _block_finite(x, k):
                ok = False
        if check and not (_block_finite(xs[0] + lo, k) and _block_finite(o, k)):
            ok = False
        lo = hi
    return ok


def simd_level(int cap=-1):
    """The widest vector loops this module's kernels run (2 AVX-512, 1 AVX2, 0 neither), after lowering
    them to at most ``cap`` when it is given (the tests run every level the CPU has; 2 restores them)."""
    return gc_set_simd_cap(cap)


def fp512(int on=-1):
    """Whether this module's 512-bit floating-point loops run (the CPU's default: not on Intel CPUs, see
    ``_fused.h``'s ``gc_fp512``), after setting it to ``on`` (0 or 1) when it is given."""
    return bool(gc_set_fp512(on))


cdef class Plan:
    # (the attributes Runner sets directly are declared here)
    """One collective's plan on one window: geometry, descriptor and progress (see ``direct.py``).

    Built by ``gradcoll.algorithms.direct`` once per call shape and reused;
    ``start`` binds a buffer and a tick, ``run`` advances up to a number of
    pieces and returns ``(status, culprit, piece)``.
    """

    cdef WinC w
    cdef int two, op, variant, f64, check, fp16, dodiv, region, root, scatter, phase, own
    cdef Py_ssize_t count, item, witem, piece, seg, depth, ring, rslot, res_off
    cdef Py_ssize_t bounds[MAXN + 1]
    cdef char* rbase
    cdef Py_ssize_t rstride, roff
    cdef double divisor, recip, limit
    cdef int64_t hi, lo, bmin
    cdef const float* table
    cdef object keep
    cdef unsigned char desc[64]
    # per call
    cdef char* buf
    cdef char* out
    cdef object held
    cdef uint64_t t0
    cdef Py_ssize_t npieces, k, kin
    cdef double deadline
    cdef int wait_index
    cdef uint64_t wait_value

    def __init__(self, layout, double spin_s, int yields, *, bint two, int op, int variant, bint f64, bint check,
                 Py_ssize_t count, Py_ssize_t item, Py_ssize_t witem, Py_ssize_t piece, Py_ssize_t seg,
                 list bounds, Py_ssize_t depth, Py_ssize_t ring, Py_ssize_t rslot, Py_ssize_t res_off,
                 double divisor, double recip, double limit, tuple exact, object table, bytes desc,
                 object region=None, int root=-1, bint scatter=False):
        cdef int q
        win_fill(&self.w, layout)
        self.w.spin_s, self.w.yields = spin_s, yields
        self.two, self.op, self.variant, self.f64, self.check = two, op, variant, f64, check
        self.fp16 = variant == V_FP16
        self.root, self.scatter = root, scatter
        # Two-shot: the share a rank reduces itself is read from its own buffer, never copied into its slot
        # (no peer reads it there); on a wire the reduction rounds it to the wire as it reads it. Not for
        # wire values already (copied as they are) nor for a region (in place).
        self.own = two and region is None and op < OP_GATHER and (variant <= V_EXACT or item == 4)
        self.count, self.item, self.witem, self.piece, self.seg = count, item, witem, piece, seg
        self.depth, self.ring, self.rslot, self.res_off = depth, ring, rslot, res_off
        self.divisor, self.recip, self.limit = divisor, recip, limit
        self.dodiv = op == OP_MEAN
        self.hi, self.lo, self.bmin = exact
        self.keep = (table, region)
        self.table = <const float*>cnp.PyArray_DATA(table) if table is not None else NULL
        if len(bounds) != self.w.n + 1 or self.w.n > MAXN:
            raise ValueError("bounds must have n + 1 entries")
        for q in range(self.w.n + 1):
            self.bounds[q] = bounds[q]
        self.region = region is not None
        if self.region:
            self.rbase = <char*><Py_ssize_t>region[0]
            self.rstride = region[1]
            self.roff = region[2]
        if len(desc) != 64:
            raise ValueError("a descriptor is 64 bytes")
        memcpy(self.desc, <const char*>desc, 64)
        if two:  # (cdivision: C's truncating division, so round up by hand)
            self.npieces = max(1, (self.bounds[1] - self.bounds[0] + seg - 1) // seg)
        else:
            self.npieces = max(1, (count + piece - 1) // piece)

    @property
    def pieces(self):
        return self.npieces

    @property
    def waited(self):
        return self.w.waited

    @property
    def waiting(self):
        """``(counter, value)`` of the last wait (what a timed-out rank was waiting for)."""
        return self.wait_index, self.wait_value

    cdef int _wait(self, int index, uint64_t value, int* culprit) noexcept nogil:
        self.wait_index, self.wait_value = index, value
        return win_wait_all(&self.w, index, value, self.deadline, culprit)

    def start(self, cnp.ndarray buf, cnp.ndarray out, uint64_t t0, int64_t seq, double deadline):
        """Bind ``buf`` (and ``out``, for a gather) and the first tick; the descriptor takes ``seq``."""
        self.held = (buf, out)
        self.buf = <char*>cnp.PyArray_DATA(buf)
        self.out = <char*>cnp.PyArray_DATA(out) if out is not None else NULL
        self.t0 = t0
        self.k = 0
        self.kin = 0
        self.deadline = deadline
        memcpy(self.desc + 20, &seq, 8)  # the Record's seq field (gradcoll.algorithms._handshake)

    def run(self, Py_ssize_t limit):
        """Advance at most ``limit`` pieces: ``(status, culprit, piece, phase)`` (S_MORE while pieces are left).

        ``phase`` is the step it was in: 1 copying in and waiting for the others' pieces, 2 reducing and
        waiting for the others' shares, 3 copying out and waiting for the others to be done.
        """
        cdef int st, culprit = -1
        cdef Py_ssize_t stop = self.k + limit
        if stop > self.npieces:
            stop = self.npieces
        with nogil:
            st = self._run(stop, &culprit)
        if st != S_MORE:
            self.held = None
        return st, culprit, self.k, self.phase

    # -- where things are -------------------------------------------------------------------------
    cdef inline char* _data(self, int r, Py_ssize_t k, int q) noexcept nogil:
        """Rank ``r``'s copy of share ``q`` of piece ``k`` (two-shot) or of piece ``k`` (one-shot)."""
        cdef Py_ssize_t e
        if self.region:
            e = self.bounds[q] + k * self.seg if self.two else k * self.piece
            return self.rbase + r * self.rstride + self.roff + e * self.witem
        if self.own and r == self.w.me and q == r:
            return self.buf + (self.bounds[q] + k * self.seg) * self.item
        e = q * self.seg if self.two else 0
        return (self.w.base + self.w.slots + r * self.w.stride + ((self.t0 + k) % self.depth) * self.ring
                + e * self.witem)

    cdef inline char* _result(self, int r, Py_ssize_t k) noexcept nogil:
        return (self.w.base + self.w.slots + r * self.w.stride + self.res_off
                + ((self.t0 + k) % self.depth) * self.rslot)

    cdef inline void _share(self, Py_ssize_t k, int q, Py_ssize_t* a, Py_ssize_t* b) noexcept nogil:
        """Elements ``[a, b)`` of share ``q`` of piece ``k`` (two-shot) or of piece ``k`` (one-shot)."""
        if self.two:
            a[0] = self.bounds[q] + k * self.seg
            b[0] = a[0] + self.seg
            if b[0] > self.bounds[q + 1]:
                b[0] = self.bounds[q + 1]
            if a[0] > b[0]:
                a[0] = b[0]
        else:
            a[0] = k * self.piece
            b[0] = a[0] + self.piece
            if b[0] > self.count:
                b[0] = self.count

    cdef inline char* _desc(self, int r) noexcept nogil:
        return self.w.base + self.w.headers + r * HEADER_BYTES + H_DESCRIPTORS + (self.t0 % N_DESCRIPTORS) * 64

    # -- the steps --------------------------------------------------------------------------------
    cdef int _wait_done(self, uint64_t t, int* culprit) noexcept nogil:
        """Before reusing the ring buffer of tick ``t``: every rank is done with tick ``t - depth``."""
        if t + 1 <= <uint64_t>self.depth:
            return W_OK
        return self._wait(DONE, t + 1 - self.depth, culprit)

    cdef int _copy_in(self, Py_ssize_t k, int* culprit) noexcept nogil:
        cdef uint64_t t = self.t0 + k
        cdef int st, q, nq
        cdef Py_ssize_t a, b
        st = self._wait_done(t, culprit)
        if st != W_OK:
            return st
        if not self.region and (self.op != OP_BCAST or self.root == self.w.me):
            nq = self.w.n if self.two else 1
            for q in range(nq):
                self._share(k, q, &a, &b)
                if b > a and not (self.own and q == self.w.me):
                    if self.variant >= V_BF16 and self.item == 4:
                        gcd_encode(<float*>(self.buf + a * 4), <uint16_t*>self._data(self.w.me, k, q), b - a,
                                   self.fp16)
                    else:
                        gcd_copy(self._data(self.w.me, k, q), self.buf + a * self.item, (b - a) * self.item)
        if k == 0:
            memcpy(self._desc(self.w.me), self.desc, 64)
        win_publish(&self.w, ARRIVED, self.t0 + (self.npieces if self.region else k + 1))
        return W_OK

    cdef bint _reduce(self, Py_ssize_t k, int q, char* out, float* dec, Py_ssize_t m) noexcept nogil:
        """Reduce share ``q`` of piece ``k`` (or piece ``k``) of every rank into ``out``; False if not finite."""
        cdef void* xs[MAXN]
        cdef int r, mode, n = self.w.n
        cdef const float* mine
        for r in range(n):
            xs[r] = self._data(r, k, q)
        if self.variant >= V_BF16:
            mine = <const float*>xs[self.w.me] if self.own and q == self.w.me else NULL
            return gcd_wire_reduce(<const uint16_t* const*>xs, n, m, <uint16_t*>out, dec, <float>self.divisor,
                                   self.dodiv, self.fp16, self.table, mine, self.w.me) == 0 or not self.check
        if self.variant == V_EXACT:
            if n == 2 and not self.f64 and (self.recip == 0.5 or self.recip == 1.0):
                # Two float32 contributions: the float32 sum, halved for a mean, has the exact reduction's bits
                # wherever it is finite (gcd_exact2_f32_avx2's reasoning), and that is the plain reduce's loop
                # on two inputs: the plain call's cost. Where it is not finite (a sum beyond float32's range
                # whose mean may be in it, or a NaN or Inf) the exact reduction redoes the piece and decides.
                if gc_reduce_ff(<const float* const*>xs, 2, m, <float*>out, <float>self.recip,
                                GC_MUL if self.dodiv else GC_NONE, 0) != 0:
                    return True
                r = gcd_exact32(<const float* const*>xs, n, m, <float*>out, self.divisor, self.recip,
                                self.limit, self.hi, self.lo, self.bmin)
                return r == 0 or not self.check
            if self.f64:
                r = gcd_exact_f64(<const double* const*>xs, n, m, <double*>out, self.divisor, self.recip,
                                  self.limit, self.hi, self.lo, self.bmin)
            else:
                r = gcd_exact32(<const float* const*>xs, n, m, <float*>out, self.divisor, self.recip,
                                self.limit, self.hi, self.lo, self.bmin)
            return r == 0 or not self.check
        if self.op <= OP_SUM:  # rank order 0..n-1, then the division (a multiply where 1/n is exact: the same bits)
            mode = GC_NONE if not self.dodiv else (GC_MUL if self.recip > 0 else GC_DIV)
            if self.f64:
                return gc_reduce_dd(<const double* const*>xs, n, m, <double*>out,
                                    self.recip if mode == GC_MUL else self.divisor, mode, 0) != 0 or not self.check
            return gc_reduce_ff(<const float* const*>xs, n, m, <float*>out,
                                <float>(self.recip if mode == GC_MUL else self.divisor), mode, 0) != 0 or not self.check
        if self.f64:
            return _minmax[double](<double**>xs, n, m, <double*>out, self.op == OP_MAX, self.check)
        return _minmax[float](<float**>xs, n, m, <float*>out, self.op == OP_MAX, self.check)

    cdef void _move(self, Py_ssize_t k, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
        """The step of a gather or a broadcast: copy piece ``k`` (bytes ``[a, b)``) out of the slots."""
        cdef int r
        if b <= a:
            return
        if self.op == OP_BCAST:
            if self.root != self.w.me:
                gcd_copy(self.buf + a, self._data(self.root, k, 0), b - a)
            return
        for r in range(self.w.n):
            gcd_copy(self.out + r * self.count + a, self._data(r, k, 0), b - a)

    cdef int _mismatch(self) noexcept nogil:
        cdef int r
        for r in range(self.w.n):
            if memcmp(self._desc(r), self.desc, 64) != 0:
                return r
        return -1

    cdef int _run(self, Py_ssize_t stop, int* culprit) noexcept nogil:
        cdef Py_ssize_t k, a, b
        cdef uint64_t t
        cdef int st, q, me = self.w.me, n = self.w.n
        cdef char* rep
        cdef char* res
        cdef uint64_t mark
        if self.w.n > MAXN:
            return S_MISMATCH
        while self.k < stop:
            k = self.k
            t = self.t0 + k
            self.phase = 1
            if self.region:
                if k == 0 and self.kin == 0:
                    st = self._copy_in(0, culprit)  # the data is in place: only the descriptor and the counter
                    if st != W_OK:
                        return st
                    self.kin = self.npieces
                st = self._wait_done(t, culprit)  # the result ring buffer of tick t is free
                if st != W_OK:
                    return st
            else:
                while self.kin <= k + 1 and self.kin < self.npieces:
                    st = self._copy_in(self.kin, culprit)
                    if st != W_OK:
                        return st
                    self.kin += 1
            st = self._wait(ARRIVED, t + 1, culprit)
            if st != W_OK:
                return st
            if k == 0:
                culprit[0] = self._mismatch()
                if culprit[0] >= 0:
                    return S_MISMATCH
            self.phase = 2
            if self.op >= OP_GATHER:
                self._share(k, 0, &a, &b)
                self._move(k, a, b)
                win_publish(&self.w, DONE, t + 1)
                self.k += 1
                continue
            if not self.two:
                self._share(k, 0, &a, &b)
                if self.variant >= V_BF16 and self.item == 4:
                    if not self._reduce(k, 0, NULL, <float*>(self.buf + a * 4), b - a):
                        return S_NONFINITE
                elif not self._reduce(k, 0, self.buf + a * self.item, NULL, b - a):
                    return S_NONFINITE
                win_publish(&self.w, DONE, t + 1)
                self.k += 1
                continue
            self._share(k, me, &a, &b)
            rep = self.w.base + self.w.headers + me * HEADER_BYTES + H_REPORT
            if b > a and not self._reduce(k, me, self._result(me, k), NULL, b - a):
                mark = t + 1
                memcpy(rep, &mark, 8)
            win_publish(&self.w, REDUCED, t + 1)
            self.phase = 3
            st = self._wait(REDUCED, t + 1, culprit)
            if st != W_OK:
                return st
            for q in range(n):
                memcpy(&mark, self.w.base + self.w.headers + q * HEADER_BYTES + H_REPORT, 8)
                if mark == t + 1:
                    culprit[0] = q
                    self._share(k, me, &a, &b)
                    if self.own and b > a:  # the scan of the error path reads every rank's piece in its slot
                        rep = (self.w.base + self.w.slots + me * self.w.stride
                               + ((self.t0 + k) % self.depth) * self.ring + me * self.seg * self.witem)
                        if self.variant >= V_BF16:
                            gcd_encode(<float*>(self.buf + a * 4), <uint16_t*>rep, b - a, self.fp16)
                        else:
                            gcd_copy(rep, self.buf + a * self.item, (b - a) * self.item)
                    win_publish(&self.w, FILLED, t + 1)
                    return S_NONFINITE
            for q in range(n):
                if self.scatter and q != me:
                    continue
                self._share(k, q, &a, &b)
                if b > a:
                    res = self._result(q, k)
                    if self.variant >= V_BF16 and self.item == 4:
                        gcd_decode(<uint16_t*>res, <float*>(self.buf + a * 4), b - a, self.fp16, self.table)
                    else:
                        gcd_copy(self.buf + a * self.item, res, (b - a) * self.item)
            win_publish(&self.w, DONE, t + 1)
            self.k += 1
        if self.k < self.npieces:
            return S_MORE
        self.phase = 3
        if self.region:  # peers read this rank's region until they are done: the caller may write it after
            return self._wait(DONE, self.t0 + self.npieces, culprit)
        return S_DONE


cdef class Runner:
    """The ticks and engines of one group window, and the engine's path of a plain allreduce in one C call.

    ``tick`` is the window's next tick (``_window_run`` advances it for every
    collective, the same on every rank); ``plans`` maps a call's key to its
    ``(shape, plan, descriptor)``. ``allreduce`` takes a plain call (an
    aligned, C-contiguous, writeable float32/float64 array, wholly inside
    an allocated region or outside all of them, an op code, the finite
    check) whose plan is already in ``fast``: it binds, runs every batch and accounts the waits without
    returning to Python. It returns None when the collective completed,
    NotImplemented when it does not take the call, else the failure
    ``(status, culprit, piece, phase, t0, entry)``.
    """

    cdef public uint64_t tick
    cdef public dict plans
    cdef public dict fast
    cdef public Py_ssize_t batch_bytes
    cdef object transport
    cdef list regions

    def __init__(self, transport, Py_ssize_t batch_bytes):
        self.tick = 0
        self.plans = {}
        self.fast = {}
        self.regions = []
        self.transport = transport
        self.batch_bytes = batch_bytes

    def add_region(self, Py_ssize_t start, Py_ssize_t end):
        """Buffers in ``[start, end)`` (this rank's slot of allocated window ``i``, the ``i``-th added) take
        the engine's path under ``(key, i, offset)``: that region's engine, which reads them in place."""
        self.regions.append((start, end))

    @staticmethod
    def key(Py_ssize_t size, int typenum, int op, bint check, int variant=0):
        """The key of ``fast`` for a call of ``variant`` (plain, exact, bf16 or fp16 wire)."""
        return ((((size << 3) | op) << 1 | check) << 1 | (typenum == cnp.NPY_DOUBLE)) << 2 | variant

    def allreduce(self, object buf, int op, bint check, int64_t seq, double timeout, int variant=0):
        cdef cnp.ndarray a
        cdef int typenum, st, culprit = -1
        cdef Py_ssize_t size, addr, stop, per, batch
        cdef uint64_t t0
        cdef double before
        cdef Plan plan
        cdef object entry, key
        if not cnp.PyArray_CheckExact(buf):
            return NotImplemented
        a = <cnp.ndarray>buf
        typenum = cnp.PyArray_TYPE(a)
        if (typenum != cnp.NPY_FLOAT and typenum != cnp.NPY_DOUBLE) or not cnp.PyArray_ISCARRAY(a):
            return NotImplemented
        size = cnp.PyArray_SIZE(a)
        key = ((((size << 3) | op) << 1 | check) << 1 | (typenum == cnp.NPY_DOUBLE)) << 2 | variant
        if self.regions:  # a buffer of an allocated region: that region's engine, for the buffer's offset
            addr = <Py_ssize_t>cnp.PyArray_DATA(a)
            stop = addr + size * cnp.PyArray_ITEMSIZE(a)
            for i, lo_hi in enumerate(self.regions):
                if addr < <Py_ssize_t>lo_hi[1] and stop > <Py_ssize_t>lo_hi[0]:
                    if size == 0 or addr < <Py_ssize_t>lo_hi[0] or stop > <Py_ssize_t>lo_hi[1]:
                        return NotImplemented
                    key = (key, i, addr - <Py_ssize_t>lo_hi[0])
                    break
        entry = self.fast.get(key)
        if entry is None:
            return NotImplemented
        plan = <Plan>entry[1]
        t0 = self.tick
        self.tick += plan.npieces
        plan.held = (a, None)
        plan.buf = <char*>cnp.PyArray_DATA(a)
        plan.out = NULL
        plan.t0, plan.k, plan.kin = t0, 0, 0
        plan.deadline = win_now() + timeout
        memcpy(plan.desc + 20, &seq, 8)
        per = (plan.seg * plan.w.n if plan.two else plan.piece) * plan.witem
        batch = self.batch_bytes // per if per > 0 else 1
        if batch < 1:
            batch = 1
        before = plan.w.waited
        while True:
            stop = plan.k + batch
            if stop > plan.npieces:
                stop = plan.npieces
            with nogil:
                st = plan._run(stop, &culprit)
            if st != S_MORE:
                break
            self.transport.note_wait(plan.w.waited - before)
            before = plan.w.waited
        self.transport.note_wait(plan.w.waited - before)
        plan.held = None
        if st == S_DONE:
            return None
        return st, culprit, plan.k, plan.phase, t0, entry

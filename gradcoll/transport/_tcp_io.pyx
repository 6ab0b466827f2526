# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The tcp transport's compiled loops: move a frame's bytes, and wait for sockets, without the GIL.

``push`` and ``pull`` are what ``TcpTransport._push`` and ``_pull`` do per
call, in one C loop: gather/scatter the 24-byte header and the payload with
``sendmsg``/``recvmsg`` until the frame is done or the socket would block
(``pull`` stops as soon as a header is complete, so that the transport can
check it before a byte of payload is trusted). ``wait`` is the transport's
idle: poll without blocking, yielding the CPU (``sched_yield``) in between,
for ``spin`` seconds, then block in ``poll``. None of them holds the GIL
while it runs, and none allocates. Errors come back as an errno, never
raised: the transport words them (``gradcoll.transport.tcp``).

``exchange`` is one whole step of a small exchange-and-reduce (a
recursive-doubling round, ``gradcoll.transport.tcp_fast``): this rank's
frame out and the peer's in, both directions at once, the peer's header
checked as the engine checks it, and the received payload added into the
sent buffer as it arrives, with the fused accumulate and finite check of
``gradcoll.kernels`` (``_fused.h``, the same loop and so the same bits as
``gradcoll.kernels.accumulate``). Anything it does not expect ends the
call with what it has moved, for the engine to carry on from.
"""

cimport numpy as cnp
from libc.errno cimport EAGAIN, EINTR, errno
from libc.math cimport NAN, frexp, isfinite
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cnp.import_array()


cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK


cdef extern from "<sys/socket.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags

    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    ssize_t recvmsg(int fd, msghdr* msg, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents

    int poll(pollfd* fds, unsigned long nfds, int timeout)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec

    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC


cdef extern from "../kernels/_fused.h" nogil:
    ctypedef Py_ssize_t gc_ssize
    enum:
        GC_NONE
        GC_MUL
        GC_DIV
    int gc_acc_f(float* acc, const float* x, gc_ssize m, float d, int mode, float sc, int doscale)
    int gc_acc_d(double* acc, const double* x, gc_ssize m, double d, int mode, double sc, int doscale)
    gc_ssize gc_acc_in_f(float* acc, const float* x, gc_ssize m, float d, int mode, int* fin)
    gc_ssize gc_acc_in_d(double* acc, const double* x, gc_ssize m, double d, int mode, int* fin)
    int gc_finite_f(const float* p, gc_ssize m)
    int gc_finite_d(const double* p, gc_ssize m)


cdef enum:
    HDR = 24
    KIND_DATA = 1
    POLLIN_ = 0x001
    POLLOUT_ = 0x004

#: ``exchange``'s outcomes: reduced (finite, or not checked); reduced with a non-finite result (marked NaN at
#: element 0); the input is not finite (nothing sent); stopped early (the offsets and errors say where).
cdef enum:
    X_DONE = 0
    X_NONFINITE = 1
    X_BAD_INPUT = 2
    X_STOPPED = 3
DONE, NONFINITE, BAD_INPUT, STOPPED = X_DONE, X_NONFINITE, X_BAD_INPUT, X_STOPPED


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void _no_extras(msghdr* msg) noexcept nogil:
    """A ``msghdr`` with no address, no control data and no flags (the iovecs are set by the caller)."""
    msg.msg_name = NULL
    msg.msg_namelen = 0
    msg.msg_control = NULL
    msg.msg_controllen = 0
    msg.msg_flags = 0


cdef inline void _frame_iov(msghdr* msg, iovec* iov, uint8_t* h, uint8_t* p, Py_ssize_t off,
                            Py_ssize_t total) noexcept nogil:
    """Point ``msg`` at what is left of the frame from byte ``off``: header and payload, or payload alone."""
    _no_extras(msg)
    if off < HDR:
        iov[0].iov_base = <void*>(h + off)
        iov[0].iov_len = HDR - off
        iov[1].iov_base = <void*>p
        iov[1].iov_len = total - HDR
        msg.msg_iovlen = 2 if total > HDR else 1
    else:
        iov[0].iov_base = <void*>(p + (off - HDR))
        iov[0].iov_len = total - off
        msg.msg_iovlen = 1
    msg.msg_iov = iov


cdef inline int _stopped(ssize_t n, bint send, int* err, int* eof) noexcept nogil:
    """What a ``sendmsg``/``recvmsg`` that returned ``n`` means: 0 bytes moved, go on; 1 interrupted, retry; 2 stop
    (the socket would block, an error in ``err``, or the end of the stream in ``eof``)."""
    if n < 0:
        if errno == EINTR:
            return 1
        if errno != EAGAIN and errno != EWOULDBLOCK:
            err[0] = errno
        return 2
    if n == 0 and not send:
        eof[0] = 1
        return 2
    return 0


cdef inline Py_ssize_t _move(int fd, uint8_t* h, uint8_t* p, Py_ssize_t off, Py_ssize_t total, bint send,
                             int* err, int* eof) noexcept nogil:
    """``sendmsg`` (``send``) or ``recvmsg`` from byte ``off`` until the frame is done or the socket would block; a
    receive also stops when the peer closed the stream (``eof``) and as soon as the header is complete, so that
    it is checked before a byte of payload is trusted. The new offset; ``err``: an errno that stopped it."""
    cdef iovec iov[2]
    cdef msghdr msg
    cdef ssize_t n
    cdef int how
    while off < total:
        _frame_iov(&msg, iov, h, p, off, total)
        n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) if send else recvmsg(fd, &msg, MSG_DONTWAIT)
        how = _stopped(n, send, err, eof)
        if how == 1:
            continue
        if how == 2:
            break
        if not send and off < HDR <= off + n:
            off += n
            break
        off += n
    return off


cdef inline int _finite(const uint8_t* a, Py_ssize_t lo, Py_ssize_t hi, int is64) noexcept nogil:
    if hi <= lo:
        return 1
    return gc_finite_d(<const double*>a + lo, hi - lo) if is64 else gc_finite_f(<const float*>a + lo, hi - lo)


cdef inline Py_ssize_t _first_bad(const uint8_t* a, Py_ssize_t lo, Py_ssize_t hi, int is64) noexcept nogil:
    """The first non-finite element of ``a[lo:hi]`` (which ``_finite`` found to hold one)."""
    cdef Py_ssize_t i
    for i in range(lo, hi):
        if not isfinite((<const double*>a)[i] if is64 else (<const float*>a)[i]):
            return i
    return hi - 1


cdef inline bint _aliased(const uint8_t* p) noexcept nogil:
    """Whether the kernel's copy of a payload at ``p`` into the socket's buffer pages is the slow one: the bytes
    land ``24 + i`` (mod 4096) into those pages in the usual case (the header first), and when that is 1-31 bytes
    past the source's page offset, AMD Zen cores run the copy's ``rep movsb`` several times slower (4K aliasing: each
    load seems to depend on a store just made; ``benches/bench_page_offset.py``). 1-63 is taken, for margin.
    A large NumPy array starts 16 bytes into a page: 8 bytes past."""
    cdef size_t d = (<size_t>HDR - (<size_t>p & 4095)) & 4095
    return 0 < d < 64


cdef struct Checked:
    # the input check of a staged send: elements [0, done) of the payload are checked; the first bad one
    Py_ssize_t done, size, item, bad_i
    int is64
    double bad_v


cdef inline Py_ssize_t _push_staged(int fd, uint8_t* h, const uint8_t* p, Py_ssize_t off, Py_ssize_t total,
                                    uint8_t* st, Py_ssize_t ssize, Py_ssize_t* st_lo, Py_ssize_t* st_hi,
                                    int* err, Checked* ck) noexcept nogil:
    """``_move``'s send, the payload copied through ``st`` (``ssize`` bytes, away from the aliasing) a piece at a
    time: ``st`` holds payload bytes ``[st_lo, st_hi)``, refilled once they are sent. Bytes up to ``total`` only
    are read from ``p``. ``ck`` (or NULL): the input check, run on each piece's elements as it is copied (they
    are in cache then), before a byte of them is sent; a bad element is recorded and the frame still goes."""
    cdef iovec iov[2]
    cdef msghdr msg
    cdef ssize_t n
    cdef int how, cnt, eof = 0
    cdef Py_ssize_t pay, k, e
    _no_extras(&msg)
    while off < total:
        pay = off - HDR if off > HDR else 0
        cnt = 0
        if off < HDR:
            iov[0].iov_base = <void*>(h + off)
            iov[0].iov_len = HDR - off
            cnt = 1
        if total > HDR:
            if pay >= st_hi[0] or pay < st_lo[0]:
                k = total - HDR - pay
                if k > ssize:
                    k = ssize
                memcpy(st, p + pay, k)
                st_lo[0] = pay
                st_hi[0] = pay + k
                if ck != NULL and ck.done < ck.size:
                    e = (pay + k + ck.item - 1) // ck.item  # the element the piece ends in, whole
                    if e > ck.size:
                        e = ck.size
                    if e > ck.done and not _finite(p, ck.done, e, ck.is64):
                        ck.bad_i = _first_bad(p, ck.done, e, ck.is64)
                        ck.bad_v = (<double*>p)[ck.bad_i] if ck.is64 else (<float*>p)[ck.bad_i]
                        e = ck.size  # the result is not finite: nothing more to find
                    if e > ck.done:
                        ck.done = e
            k = st_hi[0] - pay
            if k > total - HDR - pay:
                k = total - HDR - pay
            iov[cnt].iov_base = <void*>(st + (pay - st_lo[0]))
            iov[cnt].iov_len = k
            cnt += 1
        msg.msg_iov = iov
        msg.msg_iovlen = cnt
        n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
        how = _stopped(n, True, err, &eof)
        if how == 1:
            continue
        if how == 2:
            break
        off += n
    return off


def push(int fd, const uint8_t[::1] hdr, const uint8_t[::1] payload, Py_ssize_t off, uint8_t[::1] stage=None):
    """Send header and payload from byte ``off`` (header first) until done or the socket is full.

    ``stage``: a buffer of at least 4096 bytes away from the aliasing (``_aliased``) that a payload the kernel
    would copy the slow way goes through. Returns ``(off, err)``: the bytes sent so far and 0, or an errno.
    """
    cdef Py_ssize_t total = HDR + payload.shape[0], st_lo = 0, st_hi = 0
    cdef int err = 0, eof = 0
    cdef const uint8_t* h = &hdr[0]
    cdef const uint8_t* p = &payload[0] if payload.shape[0] else NULL
    cdef uint8_t* stg = NULL
    cdef Py_ssize_t stsize = 0
    if stage is not None and stage.shape[0] >= 4096 and p != NULL and _aliased(p):
        stg = &stage[0]
        stsize = stage.shape[0]
    with nogil:
        if stg != NULL:
            off = _push_staged(fd, <uint8_t*>h, p, off, total, stg, stsize, &st_lo, &st_hi, &err, NULL)
        else:
            off = _move(fd, <uint8_t*>h, <uint8_t*>p, off, total, True, &err, &eof)
    return off, err


def aliased(Py_ssize_t address):
    """Whether a send's payload at ``address`` goes through the staging buffer (``_aliased``)."""
    return bool(_aliased(<const uint8_t*>address))


cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    #include <time.h>
    /* The string copy the kernel copies socket payloads with (rep movsb), timed into a destination 8 bytes past
       its source's page offset (where AMD Zen cores run it several times slower) and into one half a page away; the
       ratio of the best of ``rounds`` each. 1.0 where the copy is not that instruction (not x86-64 GCC/Clang). */
    static double gct_now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
    static double gct_alias_ratio(size_t n, int rounds) {
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        char *a = (char *)aligned_alloc(4096, n + 8192), *b = (char *)aligned_alloc(4096, n + 8192);
        double slow = 1e30, fast = 1e30;
        if (a == NULL || b == NULL) { free(a); free(b); return 1.0; }
        memset(a, 1, n + 8192);
        memset(b, 2, n + 8192);
        for (int k = 0; k < rounds; k++) {
            for (int which = 0; which < 2; which++) {
                char *d = b + (which ? 2048 + 16 : 8 + 16);
                const char *src = a + 16;
                size_t c = n;
                double t0 = gct_now();
                __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(c) : : "memory");
                double t = gct_now() - t0;
                if (which) fast = t < fast ? t : fast; else slow = t < slow ? t : slow;
            }
        }
        free(a);
        free(b);
        return fast > 0 ? slow / fast : 1.0;
    #else
        (void)n; (void)rounds;
        return 1.0;
    #endif
    }
    """
    double gct_alias_ratio(size_t n, int rounds) nogil


def copy_alias_ratio(Py_ssize_t nbytes=64 << 10, int rounds=15):
    """How much slower the CPU's string copy (``rep movsb``, the kernel's copy of socket payloads) runs into a
    destination 8 bytes past its source's page offset than into one half a page away: best of ``rounds``
    copies of ``nbytes`` each way. Well above 1 on AMD Zen cores, about 1 on Intel ones."""
    with nogil:
        r = gct_alias_ratio(nbytes, rounds)
    return r


def pull(int fd, uint8_t[::1] hdr, uint8_t[::1] payload, Py_ssize_t off):
    """Receive header, then payload, from byte ``off`` until done, the socket is empty, or a header completes.

    Returns ``(off, err, eof)``: the bytes received so far, 0 or an errno,
    and whether the peer closed the stream.
    """
    cdef Py_ssize_t total = HDR + payload.shape[0]
    cdef int err = 0, eof = 0
    cdef uint8_t* h = &hdr[0]
    cdef uint8_t* p = &payload[0] if payload.shape[0] else NULL
    with nogil:
        off = _move(fd, h, p, off, total, False, &err, &eof)
    return off, err, eof


def wait(int[::1] fds, short[::1] events, short[::1] revents, double spin, double timeout):
    """Wait until one of ``fds`` is ready (``revents`` filled in); the number ready, 0 after ``timeout``.

    Polls without blocking, yielding the CPU between polls, for ``spin``
    seconds, then blocks (``timeout`` < 0: without a limit).
    """
    cdef Py_ssize_t i, k = fds.shape[0]
    cdef pollfd[64] pfd
    cdef int ready = 0, ms
    cdef double end, left
    if k > 64:
        raise ValueError("wait takes at most 64 descriptors")
    for i in range(k):
        pfd[i].fd = fds[i]
        pfd[i].events = events[i]
        pfd[i].revents = 0
    with nogil:
        end = _now() + spin
        while True:
            ready = poll(pfd, k, 0)
            if ready != 0 or _now() >= end:
                break
            sched_yield()
        if ready == 0:
            while True:
                if timeout < 0:
                    ms = -1
                else:
                    left = timeout - spin
                    ms = <int>(left * 1000.0) + 1 if left > 0 else 0
                ready = poll(pfd, k, ms)
                if ready >= 0 or errno != EINTR:
                    break
    for i in range(k):
        revents[i] = pfd[i].revents
    return max(ready, 0)


cdef inline void _put_header(uint8_t* h, uint32_t tag, uint64_t seq, uint64_t length) noexcept nogil:
    """A DATA header, as ``frame.pack_header`` writes it (little-endian ``<B3xIQQ``)."""
    cdef int i
    h[0] = KIND_DATA
    h[1] = h[2] = h[3] = 0
    for i in range(4):
        h[4 + i] = (tag >> (8 * i)) & 0xFF
    for i in range(8):
        h[8 + i] = (seq >> (8 * i)) & 0xFF
        h[16 + i] = (length >> (8 * i)) & 0xFF


cdef inline bint _is_header(const uint8_t* h, uint32_t tag, uint64_t seq, uint64_t length) noexcept nogil:
    """True when ``h`` is exactly the DATA header a receive of (``seq``, ``tag``, ``length``) expects."""
    cdef uint8_t want[HDR]
    cdef int i
    _put_header(want, tag, seq, length)
    for i in range(HDR):
        if i not in (1, 2, 3) and h[i] != want[i]:  # the padding is not the codec's business either
            return False
    return True


cdef inline int _finish(double divisor, double* f) noexcept nogil:
    """How a sum is divided, exactly as ``gradcoll.kernels``' accumulate does: not at all, by an exact
    reciprocal (a power of two in float32's normal range), or by dividing."""
    cdef int e
    if divisor == 1.0:
        f[0] = 1.0
        return GC_NONE
    if frexp(divisor, &e) == 0.5 and -120 < e < 120:  # the reciprocal is a normal float32 too: same bits
        f[0] = 1.0 / divisor
        return GC_MUL
    f[0] = divisor
    return GC_DIV


cdef inline int _acc(uint8_t* a, uint8_t* b, Py_ssize_t lo, Py_ssize_t hi, int is64, double f, int mode) noexcept nogil:
    """``acc[lo:hi] += tmp[lo:hi]`` (divided as ``_finish`` says) with the finite check; 1: finite."""
    if hi <= lo:
        return 1
    if is64:
        return gc_acc_d(<double*>a + lo, <double*>b + lo, hi - lo, f, mode, 1.0, 0)
    return gc_acc_f(<float*>a + lo, <float*>b + lo, hi - lo, <float>f, mode, 1.0, 0)


cdef inline void _mark(uint8_t* a, int is64) noexcept nogil:
    """The marker every later round carries on (``_common.plant``): a NaN at element 0."""
    if is64:
        (<double*>a)[0] = NAN
    else:
        (<float*>a)[0] = NAN


cdef inline int _acc_p(uint8_t* a, const uint8_t* x, Py_ssize_t cnt, int is64, double f, int mode) noexcept nogil:
    """``a[:cnt] += x[:cnt]`` on raw pointers (divided as ``_finish`` says), with the finite check; 1: finite."""
    if cnt <= 0:
        return 1
    if is64:
        return gc_acc_d(<double*>a, <const double*>x, cnt, f, mode, 1.0, 0)
    return gc_acc_f(<float*>a, <const float*>x, cnt, <float>f, mode, 1.0, 0)


cdef inline int _acc_ring(uint8_t* a, const uint8_t* ring, Py_ssize_t size, Py_ssize_t lo, Py_ssize_t hi,
                          Py_ssize_t item, int is64, double f, int mode) noexcept nogil:
    """``acc[lo:hi] += `` the received elements ``lo:hi``, which sit in ``ring`` at their payload offset mod
    ``size`` (a multiple of the item, so no element wraps)."""
    cdef Py_ssize_t s = (lo * item) % size, first = hi - lo
    if first <= 0:
        return 1
    if first > (size - s) // item:
        first = (size - s) // item
    return _acc_p(a + lo * item, ring + s, first, is64, f, mode) \
        & _acc_p(a + (lo + first) * item, ring, hi - lo - first, is64, f, mode)


cdef inline void _spill(const uint8_t* ring, Py_ssize_t size, uint8_t* b, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """Copy the payload bytes ``lo:hi`` from ``ring`` to where the engine expects them: ``b[lo:hi]``."""
    cdef Py_ssize_t s, k
    while lo < hi:
        s = lo % size
        k = hi - lo if hi - lo < size - s else size - s
        memcpy(b + lo, ring + s, k)
        lo += k


cdef inline Py_ssize_t _pull_ring(int fd, uint8_t* h, uint8_t* ring, Py_ssize_t size, Py_ssize_t off,
                                  Py_ssize_t total, Py_ssize_t upto, int* err, int* eof) noexcept nogil:
    """``recvmsg`` from byte ``off`` of the frame: the header into ``h``, the payload into ``ring`` at its offset
    mod ``size``, no further than payload byte ``upto`` (what the ring has room for), until the socket is empty
    or the header completes (checked before a byte of payload is trusted). The new offset; as ``_move``."""
    cdef iovec iov[3]
    cdef msghdr msg
    cdef ssize_t n
    cdef int how
    cdef Py_ssize_t pay, s, k
    cdef int cnt
    _no_extras(&msg)
    if upto > total - HDR:
        upto = total - HDR
    while off < total:
        cnt = 0
        pay = 0
        if off < HDR:
            iov[0].iov_base = <void*>(h + off)
            iov[0].iov_len = HDR - off
            cnt = 1
        else:
            pay = off - HDR
        if pay < upto:
            s = pay % size
            k = upto - pay
            if s + k > size:
                iov[cnt].iov_base = <void*>(ring + s)
                iov[cnt].iov_len = size - s
                iov[cnt + 1].iov_base = <void*>ring
                iov[cnt + 1].iov_len = k - (size - s)
                cnt += 2
            else:
                iov[cnt].iov_base = <void*>(ring + s)
                iov[cnt].iov_len = k
                cnt += 1
        if cnt == 0:
            break  # the ring is full
        msg.msg_iov = iov
        msg.msg_iovlen = cnt
        n = recvmsg(fd, &msg, MSG_DONTWAIT)
        how = _stopped(n, False, err, eof)
        if how == 1:
            continue
        if how == 2:
            break
        if off < HDR <= off + n:
            off += n
            break
        off += n
    return off


#: Elements reduced at a time while the frames move (64 KiB of float32): the received bytes are still in cache,
#: and the reduction fills the time the sockets make the call wait.
cdef Py_ssize_t REDUCE_STEP = 16384


cdef struct XS:
    # one exchange's state: what ``_xloop`` reads, and what it leaves for the caller
    int fd, rfd, wake, is64, mode, serr, rerr, eof, bad, fin, outcome
    bint same, copy, check, check_acc, bad_in_acc
    uint8_t* a
    uint8_t* sp
    uint8_t* rg
    uint8_t* stg
    Py_ssize_t m, nbytes, sm, total, stotal, item, ahead, rsize, stsize, st_lo, st_hi
    Py_ssize_t soff, roff, red, chk, bad_i
    uint32_t tag
    uint64_t rseq
    double f, spin, timeout, end, bad_v, wake_at  # wake_at: when the loop next looks at the wake socket
    Checked stck
    uint8_t sh[HDR]
    uint8_t rh[HDR]


cdef inline int _acc_in_p(XS* s, uint8_t* a, const uint8_t* x, Py_ssize_t lo, Py_ssize_t cnt) noexcept nogil:
    """``_acc_p`` of elements ``lo:lo + cnt`` of ``s.a`` (at ``a``), this rank's input in them checked in the same
    pass: the first non-finite one goes to ``s.bad_i``/``s.bad_v`` (``s.bad_in_acc``), as the separate check
    found it; 1: every sum finite."""
    cdef int fin = 1
    cdef Py_ssize_t done, at
    if cnt <= 0:
        return 1
    if s.is64:
        done = gc_acc_in_d(<double*>a, <const double*>x, cnt, s.f, s.mode, &fin)
    else:
        done = gc_acc_in_f(<float*>a, <const float*>x, cnt, <float>s.f, s.mode, &fin)
    if done < cnt:  # a run that may hold a bad input, as it was: the exact check, then the plain accumulate
        if s.bad_i < 0 and not _finite(s.a, lo + done, lo + cnt, s.is64):
            at = _first_bad(s.a, lo + done, lo + cnt, s.is64)
            s.bad_i, s.bad_in_acc = at, True
            s.bad_v = (<double*>s.a)[at] if s.is64 else (<float*>s.a)[at]
        fin = _acc_p(a + done * s.item, x + done * s.item, cnt - done, s.is64, s.f, s.mode) & fin
    return fin


cdef inline int _reduce_to(XS* s, Py_ssize_t hi) noexcept nogil:
    """``acc[s.red:hi] +=`` the received elements from the ring (``_acc_ring``), with this rank's input in them
    checked (``s.check_acc``) in the same pass until a bad one is found; 1: every sum finite."""
    cdef Py_ssize_t lo = s.red, off, first
    if not s.check_acc or s.bad_i >= 0:
        return _acc_ring(s.a, s.rg, s.rsize, lo, hi, s.item, s.is64, s.f, s.mode)
    if hi <= lo:
        return 1
    off = (lo * s.item) % s.rsize
    first = hi - lo
    if first > (s.rsize - off) // s.item:
        first = (s.rsize - off) // s.item
    return _acc_in_p(s, s.a + lo * s.item, s.rg + off, lo, first) \
        & _acc_in_p(s, s.a + (lo + first) * s.item, s.rg, lo + first, hi - lo - first)


#: How often (seconds) a loop whose bytes keep flowing looks at the wake socket: another thread's work, or a
#: close, stops a long exchange within this much, not only when the loop waits.
cdef double WAKE_CHECK_S = 1e-3


cdef void _xloop(XS* s) noexcept nogil:
    """``exchange``'s loop on ``s`` (the frames from ``s.soff``/``s.roff``, the header ``s.sh`` written): moves,
    checks and reduces until both frames are done or something stops it; ``s.outcome`` says which."""
    cdef Py_ssize_t before, upto, ready_elems, lim, floor_b, pay
    cdef int moved, ready, ms, nfds
    cdef pollfd pfd[3]
    cdef pollfd wpfd
    cdef double now, spin_end
    now = _now()
    spin_end = now + s.spin
    while True:
        if s.wake_at <= now:  # while the bytes keep flowing the loop never polls: look at the wake socket
            s.wake_at = now + WAKE_CHECK_S  # (across the rounds of a call, each of which may take less)
            wpfd.fd, wpfd.events, wpfd.revents = s.wake, POLLIN_, 0
            if poll(&wpfd, 1, 0) > 0 and wpfd.revents:
                break  # another thread queued work (or closes the transport): the engine drives from here
        now = _now()
        before = s.soff
        lim = s.roff + s.ahead if s.roff > HDR else HDR + s.ahead
        if lim > s.stotal or s.roff >= s.total or s.copy:  # (a longer send than receive goes on once it is done)
            lim = s.stotal
        if s.chk < s.sm and s.stg == NULL:  # the input's next piece, checked just before the socket copies it
            upto = (lim - HDR + s.item - 1) // s.item
            if upto > s.sm:
                upto = s.sm
            if upto > s.chk:
                if not _finite(s.sp, s.chk, upto, s.is64):
                    if s.bad_i < 0:
                        s.bad_i = _first_bad(s.sp, s.chk, upto, s.is64)
                        s.bad_v = (<double*>s.sp)[s.bad_i] if s.is64 else (<float*>s.sp)[s.bad_i]
                    upto = s.sm  # the result is not finite: nothing more to find
                s.chk = upto
        if s.stg != NULL:  # everything the socket takes now (the input checked as it is staged)
            s.soff = _push_staged(s.fd, s.sh, s.sp, s.soff, lim, s.stg, s.stsize, &s.st_lo, &s.st_hi, &s.serr,
                                  &s.stck if s.chk < s.sm else NULL)
            if s.stck.bad_i >= 0 and s.bad_i < 0:
                s.bad_i, s.bad_v = s.stck.bad_i, s.stck.bad_v
        else:
            s.soff = _move(s.fd, s.sh, s.sp, s.soff, lim, True, &s.serr, &s.eof)
        moved = s.soff > before
        if s.serr:
            break
        while s.roff < s.total:  # everything already here, the header checked once it is complete
            before = s.roff
            if s.copy:
                s.roff = _move(s.rfd, s.rh, s.a, s.roff, s.total, False, &s.rerr, &s.eof)
            else:
                s.roff = _pull_ring(s.rfd, s.rh, s.rg, s.rsize, s.roff, s.total, s.red * s.item + s.rsize, &s.rerr,
                                    &s.eof)
            moved = moved or s.roff > before
            if not (before < HDR <= s.roff):
                break  # in whole, or nothing more to read now, or an error, or the end of the stream
            if not _is_header(s.rh, s.tag, s.rseq, s.nbytes):
                s.bad = 1
                break
        if s.rerr or s.eof or s.bad:
            break
        if s.soff == s.stotal and s.roff == s.total and s.copy:
            s.outcome = X_DONE
            break
        if s.soff == s.stotal and s.roff == s.total:
            s.fin = _reduce_to(s, s.m) & s.fin
            s.red = s.m
            s.outcome = X_DONE if s.fin or not s.check else X_NONFINITE
            if s.outcome == X_NONFINITE:
                _mark(s.a, s.is64)
            break
        ready_elems = ((s.soff if s.same and s.soff < s.roff else s.roff) - HDR) // s.item
        pay = s.roff - HDR if s.roff > HDR else 0
        floor_b = s.red * s.item
        if not s.copy and ready_elems > s.red and (ready_elems - s.red >= REDUCE_STEP or pay - floor_b >= s.rsize):
            # sent (when the accumulator is what is sent) and received: reduce it while the sockets work (now,
            # when the ring is full)
            s.fin = _reduce_to(s, ready_elems) & s.fin
            s.red = ready_elems
            continue
        if moved:
            spin_end = _now() + s.spin  # the spin counts from the last byte moved
            continue
        # the send's link, the wake socket, and the receive's link where it is another one (a ring's left)
        pfd[0].fd = s.fd
        pfd[0].events = POLLOUT_ if s.soff < lim else 0
        pfd[1].fd = s.wake
        pfd[1].events = POLLIN_
        pfd[1].revents = 0
        pfd[2].fd = s.rfd
        pfd[2].events = POLLIN_ if s.roff < s.total and (s.copy or s.roff < HDR or pay - floor_b < s.rsize) else 0
        pfd[2].revents = 0
        if s.rfd == s.fd:
            pfd[0].events |= pfd[2].events
        pfd[0].revents = 0
        now = _now()
        if s.timeout >= 0 and now >= s.end:
            break  # the engine raises the timeout, with its words (checked while spinning too: a peer that
            # trickles bytes keeps the spin going)
        nfds = 2 if s.rfd == s.fd else 3
        if now < spin_end:
            ready = poll(pfd, nfds, 0)
            if ready == 0:
                sched_yield()
        else:
            ms = 60000 if s.timeout < 0 or s.end - now > 60.0 else <int>((s.end - now) * 1000.0) + 1
            ready = poll(pfd, nfds, ms)
        if ready > 0 and pfd[1].revents:
            break  # another thread queued work: the engine drives from here


cdef enum:
    PLAN_COPY_ = 1
    PLAN_DIVIDE_ = 2
    PLAN_CHECK_ = 4


cdef inline void _xround(XS* s, int fd, int rfd, uint64_t sseq, uint64_t rseq, double divisor) noexcept nogil:
    """Set ``s`` up for a fresh exchange: frame ``sseq`` out on ``fd``, frame ``rseq`` in on ``rfd`` (the same link
    but in a ring's round), the sum divided by ``divisor``; the arrays, sizes, ring, tag and deadline are the
    caller's."""
    s.fd, s.rfd, s.rseq = fd, rfd, rseq
    s.soff = s.roff = s.red = 0
    s.serr = s.rerr = s.eof = s.bad = 0
    s.fin, s.outcome = 1, X_STOPPED
    s.bad_i, s.bad_v, s.bad_in_acc = -1, 0.0, False
    s.st_lo = s.st_hi = 0
    _put_header(s.sh, s.tag, sseq, s.stotal - HDR)
    s.mode = _finish(divisor, &s.f)


cdef tuple _xresult(XS* s, uint8_t* b):
    """``exchange``'s answer from ``s`` (what a stopped call received goes to ``b``: the engine carries on there)."""
    if s.outcome == X_STOPPED and s.roff > HDR and not s.copy:
        _spill(s.rg, s.rsize, b, s.red * s.item, s.roff - HDR)
    return (s.outcome, s.soff, s.roff, s.serr, s.rerr, bool(s.eof),
            (<bytes>(<char*>s.rh)[:min(s.roff, HDR)]) if s.outcome == X_STOPPED and s.roff else None, s.red,
            bool(s.fin), None if s.bad_i < 0 else (s.bad_i, s.bad_v, bool(s.bad_in_acc)))


cdef int _xarrays(XS* s, cnp.ndarray acc, cnp.ndarray tmp, object src, bint copy, uint8_t[::1] ring,
                  Py_ssize_t ahead) except -1:
    """Check ``exchange``'s arrays and fill ``s`` with them."""
    s.is64 = cnp.PyArray_TYPE(acc) == cnp.NPY_DOUBLE
    s.m, s.nbytes = cnp.PyArray_SIZE(acc), cnp.PyArray_NBYTES(acc)
    if (not s.is64 and cnp.PyArray_TYPE(acc) != cnp.NPY_FLOAT) or cnp.PyArray_TYPE(tmp) != cnp.PyArray_TYPE(acc) \
            or cnp.PyArray_SIZE(tmp) != s.m or not cnp.PyArray_IS_C_CONTIGUOUS(acc) \
            or not cnp.PyArray_IS_C_CONTIGUOUS(tmp) or not cnp.PyArray_ISWRITEABLE(acc) \
            or not cnp.PyArray_ISWRITEABLE(tmp):
        raise ValueError("exchange takes two writeable C-contiguous float32 or float64 arrays of one size")
    s.same = src is None or src is acc
    if s.same and copy:
        raise ValueError("exchange copies into the accumulator only what it receives for another array it sends")
    if s.same:
        src = acc
    elif cnp.PyArray_TYPE(<cnp.ndarray>src) != cnp.PyArray_TYPE(acc) \
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>src):
        raise ValueError("exchange sends a C-contiguous array of the accumulator's dtype")
    s.a = <uint8_t*>cnp.PyArray_DATA(acc)
    s.sp = <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>src)
    s.sm = cnp.PyArray_SIZE(<cnp.ndarray>src)
    cdef Py_ssize_t snbytes = cnp.PyArray_NBYTES(<cnp.ndarray>src)
    if not s.same and snbytes and s.nbytes and s.sp < s.a + s.nbytes and s.a < s.sp + snbytes:
        raise ValueError("exchange's send array overlaps its accumulator")
    s.total, s.stotal, s.item, s.copy = HDR + s.nbytes, HDR + snbytes, 8 if s.is64 else 4, copy
    s.rsize, s.ahead = ring.shape[0], ahead
    if ahead < 4096 or s.rsize < 4096 or s.rsize % 8:
        raise ValueError("exchange runs the send at least 4096 bytes ahead and a ring of 8k >= 4096 bytes")
    s.rg = &ring[0]
    s.stg, s.stsize = NULL, 0
    return 0


cdef inline bint _x_first_piece(XS* s, bint check_input) noexcept nogil:
    """The input check's first piece (``s.ahead`` bytes) before anything is sent; False: it is not finite."""
    s.chk = s.sm
    if check_input and s.sm:
        s.chk = s.ahead // s.item if s.sm > s.ahead // s.item else s.sm
        if not _finite(s.sp, 0, s.chk, s.is64):
            return False
    s.stck.done, s.stck.size, s.stck.item, s.stck.bad_i, s.stck.is64, s.stck.bad_v = \
        s.chk, s.sm, s.item, -1, s.is64, 0.0
    return True


def exchange(int fd, int wake, cnp.ndarray acc, cnp.ndarray tmp, uint32_t tag, uint64_t sseq, uint64_t rseq,
             double spin, double timeout, double divisor, bint check_input, bint check, Py_ssize_t ahead,
             uint8_t[::1] ring, cnp.ndarray src=None, bint copy=False, uint8_t[::1] stage=None):
    """One exchange-and-reduce with the peer on ``fd``: ``acc`` out (frame ``sseq``), ``tmp`` in (frame ``rseq``),
    and ``acc += tmp`` (divided by ``divisor``) with the finite check when ``check``.

    ``acc`` and ``tmp`` are C-contiguous arrays of one float dtype (float32 or
    float64) and size. ``check_input``: check ``acc`` itself, each piece
    just before the socket takes it. A non-finite element in the first
    ``ahead`` bytes ends the call before anything is sent (``BAD_INPUT``);
    one further on is reported (``bad_input``) and the frames still move. Waits as ``wait`` does (``spin`` seconds of
    polling since the last byte moved, then blocking) for at most ``timeout`` seconds (< 0: no limit),
    and stops when ``wake`` is readable (another thread queued work).

    The send runs at most ``ahead`` payload bytes ahead of the receive. The
    peer's payload arrives in ``ring`` (a multiple of 8 bytes, at least 4096),
    at its offset modulo the ring's size, so that it stays in cache however
    large the frame; ``tmp`` is only written when the call stops early (the
    bytes not yet reduced, at their offsets, for the engine). The
    reduction runs as the frames move: the elements both sent and
    received are reduced ``REDUCE_STEP`` at a time (an element of ``acc`` is
    only changed once its bytes are on the wire).

    ``src``: send this array instead of ``acc`` (one dtype, any size, not
    overlapping ``acc``): the recursive-halving round of a reduce-scatter,
    which sends one part of the buffer and adds the peer's into another.
    The received elements are then reduced as soon as they arrive, and
    ``check_input`` also checks each piece of ``acc`` just before adding
    into it (both are this rank's input in such a round). With ``copy``
    (and a ``src``) nothing is reduced or checked: the peer's payload goes
    straight into ``acc`` (an allgather round; ``tmp`` is not used, ``ring``
    neither) and the outcome is ``DONE`` once both frames moved.

    Returns ``(outcome, sent, received, send_errno, recv_errno, eof, header,
    reduced, finite, bad_input)``: the outcome (``DONE``, ``NONFINITE``, ``BAD_INPUT`` or
    ``STOPPED``), the bytes of each frame moved, header included, the errno
    that stopped either direction (0: none), whether the peer closed the
    stream, on ``STOPPED`` the header bytes received so far (None when none),
    the elements already reduced with whether they came out finite, and
    ``(index, value, in_acc)`` of the first non-finite element of the input found
    once the frame had started (None: none; the result is not finite; ``in_acc``:
    an index of ``acc``, else of the array sent). It
    stops as soon as a complete header is not the expected DATA header (seq,
    tag, length): the caller's engine then judges it. After ``STOPPED`` the
    caller finishes the frames and then ``reduce_rest``.
    """
    cdef XS s
    _xarrays(&s, acc, tmp, src, copy, ring, ahead)
    s.wake, s.tag, s.check, s.spin, s.timeout = wake, tag, check, spin, timeout
    s.check_acc = check_input and not s.same
    _xround(&s, fd, fd, sseq, rseq, divisor)
    if stage is not None and stage.shape[0] >= 4096 and s.stotal > HDR and _aliased(s.sp):
        s.stg, s.stsize = &stage[0], stage.shape[0]
    if not _x_first_piece(&s, check_input):
        return X_BAD_INPUT, 0, 0, 0, 0, False, None, 0, True, None
    with nogil:
        s.end = _now() + timeout
        s.wake_at = s.end - timeout + WAKE_CHECK_S
        _xloop(&s)
    return _xresult(&s, <uint8_t*>cnp.PyArray_DATA(tmp))


#: ``exchange_plan``'s fields of a round, in this order (``PLAN_FIELDS`` int64 per round).
PLAN_FD, PLAN_TAG, PLAN_SSEQ, PLAN_RSEQ, PLAN_A, PLAN_B, PLAN_C, PLAN_D, PLAN_FLAGS, PLAN_RFD = range(10)
PLAN_FIELDS = 10
cdef enum:
    NF = 10
    NF_FD = 0  # (PLAN_FD, PLAN_SSEQ, PLAN_RSEQ, PLAN_RFD)
    NF_SSEQ = 2
    NF_RSEQ = 3
    NF_RFD = 9


cdef inline void _xplan(XS* s, uint8_t* base, const int64_t[::1] plan, Py_ssize_t k, double divisor,
                        uint8_t* stage, Py_ssize_t stsize) noexcept nogil:
    """``s`` set up for round ``k`` of ``exchange_plan``."""
    cdef const int64_t* r = &plan[NF * k]
    s.a, s.m = base + r[4] * s.item, r[5] - r[4]
    s.nbytes, s.total = s.m * s.item, HDR + s.m * s.item
    s.sp, s.sm = base + r[6] * s.item, r[7] - r[6]
    s.stotal = HDR + s.sm * s.item
    s.same, s.copy, s.tag = r[4] == r[6] and r[5] == r[7], r[8] & PLAN_COPY_, <uint32_t>r[1]
    _xround(s, <int>r[0], <int>r[9], <uint64_t>r[2], <uint64_t>r[3], divisor if r[8] & PLAN_DIVIDE_ else 1.0)
    s.stg, s.stsize = NULL, 0
    if stage != NULL and s.stotal > HDR and _aliased(s.sp):
        s.stg, s.stsize = stage, stsize


#: ``exchange_plan``'s round flags: receive into the array and reduce nothing; divide the round's sum; check the part
#: added into as this rank's input (it is untouched by the rounds before: a ring's reduce-scatter).
PLAN_COPY, PLAN_DIVIDE, PLAN_CHECK = 1, 2, 4


def exchange_plan(int wake, cnp.ndarray flat, cnp.ndarray tmp, const int64_t[::1] plan, double spin,
                  double timeout, double divisor, bint check_input, bint check, Py_ssize_t ahead, uint8_t[::1] ring,
                  uint8_t[::1] stage=None):
    """``exchange`` round after round in one call, on parts of one buffer (the rounds of a recursive doubling, of
    a halving-doubling's reduce-scatter and allgather, or of a ring's). ``plan`` holds ``PLAN_FIELDS`` integers
    per round: round ``k`` sends frame ``sseq`` of ``flat[c:d]`` with ``tag`` on the link ``fd`` and receives
    frame ``rseq``, of ``b - a`` elements, on the link ``rfd`` (``fd`` itself but in a ring, whose rounds send
    to one neighbour and receive from the other) into ``flat[a:b]``: added into it (through the ring, ``tmp`` as
    ``exchange``'s), or copied (``flags & PLAN_COPY``). The sum of a round with ``PLAN_DIVIDE`` is divided by
    ``divisor``. ``check_input`` checks the first round's arrays as ``exchange`` does, and the part a later round
    with ``PLAN_CHECK`` adds into. A round whose result is not finite marks the first element it received into
    (NaN), as ``exchange`` does, and the rounds go on. ``timeout`` is for all the rounds together.

    Returns ``(k, outcome, ...)``: the index of the last round run and ``exchange``'s answer for it (``STOPPED``:
    the rounds from ``k`` on are the caller's; ``BAD_INPUT``: nothing was sent), its ``bad_input`` the first
    non-finite input element any round found, as an index of ``flat``. ``stage`` as ``exchange``'s.
    """
    return _plan_rounds(wake, flat, tmp, plan, spin, timeout, divisor, check_input, check, ahead, ring, stage)


cdef tuple _plan_rounds(int wake, cnp.ndarray flat, cnp.ndarray tmp, const int64_t[::1] plan, double spin,
                        double timeout, double divisor, bint check_input, bint check, Py_ssize_t ahead,
                        uint8_t[::1] ring, uint8_t[::1] stage):
    """``exchange_plan``'s body (``PlanCall`` calls it without the arguments' conversion)."""
    cdef XS s
    cdef Py_ssize_t k = 0, rounds = plan.shape[0] // NF, size, most = 0, i
    cdef int64_t a, b, c, d
    cdef Py_ssize_t bad_at = -1
    cdef double bad_v = 0.0
    cdef bint bad_acc = False
    cdef const int64_t* r
    cdef uint8_t* base
    cdef uint8_t* stg = NULL
    cdef Py_ssize_t stsize = 0
    if rounds < 1 or plan.shape[0] != NF * rounds:
        raise ValueError("exchange_plan takes PLAN_FIELDS integers per round")
    _xarrays(&s, flat, flat, None, False, ring, ahead)
    if cnp.PyArray_TYPE(tmp) != cnp.PyArray_TYPE(flat) or not cnp.PyArray_IS_C_CONTIGUOUS(tmp) \
            or not cnp.PyArray_ISWRITEABLE(tmp):
        raise ValueError("exchange_plan takes a writeable C-contiguous tmp of the buffer's dtype")
    size = s.m
    for i in range(rounds):
        a, b, c, d = plan[NF * i + 4], plan[NF * i + 5], plan[NF * i + 6], plan[NF * i + 7]
        if not (0 <= a <= b <= size and 0 <= c <= d <= size):
            raise ValueError(f"exchange_plan's round {i} is out of the buffer: {(a, b, c, d)}, size {size}")
        if not (a == c and b == d) and b > a and d > c and a < d and c < b:
            raise ValueError(f"exchange_plan's round {i} sends part of what it receives into")
        if not (0 <= plan[NF * i + 1] <= 0xFFFFFFFF):
            raise ValueError(f"exchange_plan's round {i} has tag {plan[NF * i + 1]}")
        if not plan[NF * i + 8] & PLAN_COPY_ and b - a > most:
            most = b - a
    if cnp.PyArray_SIZE(tmp) < most:
        raise ValueError("exchange_plan's tmp is smaller than a round's receive")
    base = <uint8_t*>cnp.PyArray_DATA(flat)
    if stage is not None and stage.shape[0] >= 4096:
        stg, stsize = &stage[0], stage.shape[0]
    s.wake, s.check, s.spin, s.timeout = wake, check, spin, timeout
    _xplan(&s, base, plan, 0, divisor, stg, stsize)
    s.check_acc = check_input and not s.same
    if not _x_first_piece(&s, check_input):
        return (0, X_BAD_INPUT, 0, 0, 0, 0, False, None, 0, True, None)
    with nogil:
        s.end = _now() + timeout
        s.wake_at = s.end - timeout + WAKE_CHECK_S
        while True:
            _xloop(&s)
            if s.bad_i >= 0 and bad_at < 0:  # the first bad input element found, as an index of flat
                r = &plan[NF * k]
                bad_at, bad_v, bad_acc = s.bad_i + (r[4] if s.bad_in_acc else r[6]), s.bad_v, s.bad_in_acc
            if s.outcome == X_STOPPED or k == rounds - 1:
                break
            k += 1
            _xplan(&s, base, plan, k, divisor, stg, stsize)
            s.check_acc = check_input and not s.same and plan[NF * k + 8] & PLAN_CHECK_ != 0
            s.chk = s.sm  # (what a later round sends is not this rank's input any more)
    out = _xresult(&s, <uint8_t*>cnp.PyArray_DATA(tmp))
    return (k,) + out[:9] + (None if bad_at < 0 else (bad_at, bad_v, bool(bad_acc)),)


def reduce_rest(cnp.ndarray acc, cnp.ndarray tmp, Py_ssize_t done, double divisor, bint finite, bint check):
    """Finish a stopped ``exchange`` once the engine moved both frames: ``acc[done:] += tmp[done:]``.

    ``finite``: what ``exchange`` reported for the first ``done`` elements.
    Returns ``DONE`` or ``NONFINITE`` (marked with a NaN at element 0), as
    ``exchange`` would have.
    """
    cdef int is64 = cnp.PyArray_TYPE(acc) == cnp.NPY_DOUBLE
    cdef Py_ssize_t m = cnp.PyArray_SIZE(acc)
    if (not is64 and cnp.PyArray_TYPE(acc) != cnp.NPY_FLOAT) or cnp.PyArray_TYPE(tmp) != cnp.PyArray_TYPE(acc) \
            or cnp.PyArray_SIZE(tmp) != m or not cnp.PyArray_IS_C_CONTIGUOUS(acc) \
            or not cnp.PyArray_IS_C_CONTIGUOUS(tmp) or not cnp.PyArray_ISWRITEABLE(acc) or not 0 <= done <= m:
        raise ValueError("reduce_rest takes the arrays of the exchange and what it reduced")
    cdef uint8_t* a = <uint8_t*>cnp.PyArray_DATA(acc)
    cdef uint8_t* b = <uint8_t*>cnp.PyArray_DATA(tmp)
    cdef double f
    cdef int mode = _finish(divisor, &f), fin = finite
    with nogil:
        fin = _acc(a, b, done, m, is64, f, mode) & fin
        if not fin and check:
            _mark(a, is64)
    return X_DONE if fin or not check else X_NONFINITE


cdef class PlanCall:
    """``tcp_rounds.Runner``'s call in C: the links' checks and seqs under the transport's lock, the rounds
    (``exchange_plan``'s body, without its arguments' conversion), and the links handed back after a call that
    ended as planned (``done``). Anything else (``BAD_INPUT``, a round stopped early, a bad input element found)
    goes to ``Runner.after``, in Python, which judges it as before. Why in C: the Python frame around the
    rounds was a sizeable share of a small allreduce (docs/performance.md, "the rounds' frame in C")."""

    cdef object runner, t, mu, ls, uniq, fill, sends, recvs, fast, stage_obj, spec_obj
    cdef int64_t[::1] spec
    cdef uint8_t[::1] ring
    cdef uint8_t[::1] stage
    cdef Py_ssize_t rounds

    def __init__(self, runner, fast):
        self.runner, self.t, self.fast = runner, runner.t, fast
        self.mu, self.ls = self.t._mu, runner.ls
        self.uniq, self.fill, self.sends, self.recvs = runner.uniq, runner.fill, runner.sends, runner.recvs
        self.rounds = runner.n
        self.ring = runner.ring
        self.stage_obj = runner.stage
        if runner.stage is not None:
            self.stage = runner.stage

    def __call__(self, cnp.ndarray flat, cnp.ndarray tmp, spec, timeout, double divisor, bint check, list found,
                 list at):
        """``Runner.__call__``'s answer: the rounds done (0: declined, nothing moved)."""
        cdef int64_t[::1] plan
        cdef double started, limit_s
        t, fast = self.t, self.fast
        if cnp.PyArray_NBYTES(flat) > fast.SMALL_BYTES:
            return 0
        if spec is not self.spec_obj:  # (one plan per size: the same array again and again)
            plan = spec
            if plan.shape[0] != NF * self.rounds:
                raise ValueError("a runner's plan has PLAN_FIELDS integers per round")
            self.spec, self.spec_obj = plan, spec
        plan = self.spec
        mu = self.mu
        mu.acquire()
        try:
            if t._driving or t._queued() or t._woken is not None or t.closed:
                return 0
            for link in self.uniq:
                if link.stash or link.failure is not None:
                    return 0
            for i, link, rlink, so, ro in self.fill:
                plan[i + NF_FD], plan[i + NF_RFD] = link.fd, rlink.fd
                plan[i + NF_SSEQ], plan[i + NF_RSEQ] = link.send_seq + so, rlink.recv_seq + ro
            for link, k in self.sends:
                link.send_seq += k
            t._driving, t._stepping = True, self.uniq
        finally:
            mu.release()
        limit = t._timeout(timeout)
        limit_s = -1.0 if limit is None else <double>limit
        started = _now()  # (CLOCK_MONOTONIC: time.monotonic())
        try:
            answer = _plan_rounds(t._wake_fd, flat, tmp, plan, max(t._spin, fast.STEP_SPIN_S), limit_s, divisor,
                                  check, check, fast.PIECE_BYTES, self.ring,
                                  self.stage if self.stage_obj is not None and cnp.PyArray_NBYTES(flat) <= fast.STAGE_MAX
                                  else None)
        except BaseException:  # refused its arrays: nothing moved
            self.ls.release(t, spec, 0, False)
            raise
        if answer[1] == X_STOPPED or answer[1] == X_BAD_INPUT or answer[10] is not None:
            return self.runner.after(answer, flat, tmp, spec, limit, started, divisor, check, found, at)
        self.done()
        return self.rounds

    cpdef done(self):
        """The links handed back after a call whose every round moved both frames (``_Links.release``, in fewer
        steps): their receive seqs on, the transport not driven, what other threads queued meanwhile pushed."""
        t = self.t
        mu = self.mu
        mu.acquire()
        try:
            for link, k in self.recvs:
                link.recv_seq += k
            t._driving, t._stepping = False, None
            for link in self.uniq:
                if link.sendq:  # queued behind by another thread
                    t._push(link)
            if t._sleepers:
                t._cv.notify_all()
        finally:
            mu.release()

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The waiting protocol of ``gradcoll.transport.window``, compiled (``nogil``).

``MappedWindow`` uses ``Handle`` for its publishes and waits; the compiled
collectives (``gradcoll.algorithms._direct_c``) cimport the C functions of
``_window_c.pxd`` and call them between their own steps, with no Python in
between. The layout and the protocol are the module docstring of
``gradcoll.transport.window``.

A waiter spins for ``spin_s`` (reading the counter, with ``pause``), then
yields ``yields`` times, then sleeps on the futex word of the rank it waits
for, at most ``SLICE_S`` at a time. Between sleeps it reads every rank's
state and, every ``PROBE_S``, asks whether that rank is alive: with ``lockf``
(``F_GETLK`` on the rank's byte of the segment file: the kernel drops the
lock when the process dies) or with ``kill(pid, 0)``.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <sched.h>
    #include <signal.h>
    #include <stdint.h>
    #include <time.h>
    #include <unistd.h>
    #ifdef __linux__
    #include <linux/futex.h>
    #include <sys/syscall.h>
    #endif

    static inline double gcw_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    static inline uint64_t gcw_load64(const volatile void* p) { return __atomic_load_n((const volatile uint64_t*)p, __ATOMIC_ACQUIRE); }
    static inline void gcw_store64(volatile void* p, uint64_t v) { __atomic_store_n((volatile uint64_t*)p, v, __ATOMIC_RELEASE); }
    static inline uint32_t gcw_load32(const volatile void* p) { return __atomic_load_n((const volatile uint32_t*)p, __ATOMIC_ACQUIRE); }
    static inline void gcw_bump(volatile void* p) { __atomic_add_fetch((volatile uint32_t*)p, 1u, __ATOMIC_SEQ_CST); }
    static inline void gcw_store8(volatile void* p, uint8_t v) { __atomic_store_n((volatile uint8_t*)p, v, __ATOMIC_RELAXED); }
    static inline void gcw_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    static inline uint64_t gcw_peek64(const volatile void* p) { return __atomic_load_n((const volatile uint64_t*)p, __ATOMIC_RELAXED); }
    static inline void gcw_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    static inline void gcw_sleep(volatile void* word, uint32_t value, double seconds) {
        if (seconds <= 0) return;
        struct timespec ts;
        ts.tv_sec = (time_t)seconds;
        ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    #ifdef __linux__
        syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT, value, &ts, NULL, 0);
    #else
        if (seconds > 2e-4) { ts.tv_sec = 0; ts.tv_nsec = 200000; }
        nanosleep(&ts, NULL);
    #endif
    }
    static inline void gcw_wake(volatile void* word) {
    #ifdef __linux__
        syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    #endif
    }
    static inline int gcw_lock_free(int fd, int64_t byte) {
        struct flock fl;
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = byte;
        fl.l_len = 1;
        fl.l_pid = 0;
        if (fcntl(fd, F_GETLK, &fl) != 0) return 0;
        return fl.l_type == F_UNLCK;
    }
    static inline int gcw_pid_gone(int64_t pid) {
        if (pid <= 0) return 0;
        return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
    }
    """
    double gcw_now() nogil
    uint64_t gcw_load64(const void* p) nogil
    void gcw_store64(void* p, uint64_t v) nogil
    uint32_t gcw_load32(const void* p) nogil
    void gcw_bump(void* p) nogil
    void gcw_store8(void* p, uint8_t v) nogil
    void gcw_fence() nogil
    uint64_t gcw_peek64(const void* p) nogil
    void gcw_pause() nogil
    void gcw_sleep(void* word, uint32_t value, double seconds) nogil
    void gcw_wake(void* word) nogil
    int gcw_lock_free(int fd, int64_t byte) nogil
    int gcw_pid_gone(int64_t pid) nogil
    int sched_yield() nogil
    int getpid() nogil

cdef double PROBE_S = 0.05
cdef double SLICE_S = 0.05
cdef enum:
    OPEN = 0
    CLOSED = 1
    ALARM = 2

#: The header offsets, for the test that holds them equal to gradcoll.transport.window.LAYOUT.
LAYOUT = {"futex": H_FUTEX, "counters": H_COUNTERS, "waiting": H_WAITING, "state": H_STATE, "pid": H_PID,
          "alarm": H_ALARM, "report": H_REPORT, "descriptors": H_DESCRIPTORS}


cdef double win_now() noexcept nogil:
    return gcw_now()


cdef char* win_header(WinC* w, int r) noexcept nogil:
    return w.base + w.headers + <Py_ssize_t>r * HEADER_BYTES


cdef char* win_slot(WinC* w, int r) noexcept nogil:
    return w.base + w.slots + <Py_ssize_t>r * w.stride


cdef uint64_t win_counter(WinC* w, int r, int index) noexcept nogil:
    return gcw_load64(win_header(w, r) + H_COUNTERS + 8 * index)


cdef void win_publish(WinC* w, int index, uint64_t value) noexcept nogil:
    """Counter ``index`` := ``value`` (release), bump the futex word (a full fence), wake sleepers if any."""
    cdef char* h = win_header(w, w.me)
    cdef int i
    gcw_store64(h + H_COUNTERS + 8 * index, value)
    gcw_bump(h + H_FUTEX)
    for i in range((w.n + 7) // 8):
        if gcw_peek64(h + H_WAITING + 8 * i):
            gcw_wake(h + H_FUTEX)
            return


cdef bint win_dead(WinC* w, int r) noexcept nogil:
    """True once rank ``r``'s process is gone (never for a rank of this process)."""
    if r == w.me or w.local[r]:
        return False
    if w.probe == 1:
        return gcw_lock_free(w.fd, r) != 0
    if w.probe == 2:
        return gcw_pid_gone(w.pid[r]) != 0
    return False


cdef int _states(WinC* w, int r) noexcept nogil:
    """W_ALARM (any rank), W_SELF_CLOSED, W_CLOSED (rank r) or W_OK, from the state words."""
    cdef int q
    for q in range(w.n):
        if gcw_load64(win_header(w, q) + H_STATE) == ALARM:
            return W_ALARM | (q << 8)
    if gcw_load64(win_header(w, w.me) + H_STATE) == CLOSED:
        return W_SELF_CLOSED | (w.me << 8)
    if gcw_load64(win_header(w, r) + H_STATE) == CLOSED:
        return W_CLOSED | (r << 8)
    return W_OK


cdef int win_wait_one(WinC* w, int r, int index, uint64_t value, double deadline) noexcept nogil:
    """Wait until rank ``r``'s counter ``index`` >= ``value``; W_OK, or a code | (culprit << 8)."""
    cdef char* h = win_header(w, r)
    cdef char* ctr = h + H_COUNTERS + 8 * index
    cdef char* mine = h + H_WAITING + w.me
    cdef double t0, now, next_probe, left
    cdef uint32_t word
    cdef int i, st
    if gcw_load64(ctr) >= value:
        return W_OK
    t0 = gcw_now()
    if w.spin_s > 0:
        i = 0
        while True:
            gcw_pause()
            if gcw_load64(ctr) >= value:
                w.waited += gcw_now() - t0
                return W_OK
            i += 1
            if (i & 63) == 0 and gcw_now() - t0 > w.spin_s:
                break
    for i in range(w.yields):
        sched_yield()
        if gcw_load64(ctr) >= value:
            w.waited += gcw_now() - t0
            return W_OK
    next_probe = t0 + PROBE_S
    while True:
        st = _states(w, r)
        if st != W_OK:
            w.waited += gcw_now() - t0
            return st
        now = gcw_now()
        if now >= deadline:
            w.waited += now - t0
            return W_TIMEOUT | (r << 8)
        if now >= next_probe:
            next_probe = now + PROBE_S
            if win_dead(w, r) and gcw_load64(ctr) < value:
                w.waited += now - t0
                return W_DEAD | (r << 8)
        gcw_store8(mine, 1)
        gcw_fence()
        word = gcw_load32(h + H_FUTEX)
        if gcw_load64(ctr) >= value:
            gcw_store8(mine, 0)
            break
        left = deadline - now
        if next_probe - now < left:
            left = next_probe - now
        if SLICE_S < left:
            left = SLICE_S
        gcw_sleep(h + H_FUTEX, word, left)
        gcw_store8(mine, 0)
        if gcw_load64(ctr) >= value:
            break
    w.waited += gcw_now() - t0
    return W_OK


cdef int win_wait_all(WinC* w, int index, uint64_t value, double deadline, int* culprit) noexcept nogil:
    """Wait for counter ``index`` >= ``value`` on every other rank, in rank order; the first failure's code."""
    cdef int r, st
    for r in range(w.n):
        if r == w.me:
            continue
        st = win_wait_one(w, r, index, value, deadline)
        if st != W_OK:
            culprit[0] = st >> 8
            return st & 0xFF
    return W_OK


cdef int win_fill(WinC* w, object layout) except -1:
    """Fill ``w`` from a ``WindowLayout`` (and the pids in the headers)."""
    cdef int r
    w.base = <char*><Py_ssize_t>layout.address
    w.n = layout.size
    w.me = layout.rank
    w.headers = layout.headers
    w.slots = layout.slots
    w.stride = layout.stride
    w.slot_bytes = layout.slot_bytes
    w.probe = layout.probe
    w.fd = layout.fd
    w.waited = 0.0
    if w.n > MAX_RANKS or layout.header_bytes != HEADER_BYTES:
        raise ValueError("window layout does not match the compiled protocol")
    for r in range(w.n):
        w.pid[r] = <int64_t>gcw_load64(win_header(w, r) + H_PID)
        w.local[r] = w.pid[r] == getpid()
    return 0


cdef class Handle:
    """One rank's compiled view of a window (``MappedWindow`` keeps one)."""

    cdef WinC w

    def __init__(self, layout, double spin_s, int yields):
        win_fill(&self.w, layout)
        self.w.spin_s = spin_s
        self.w.yields = yields

    def publish(self, int index, uint64_t value):
        with nogil:
            win_publish(&self.w, index, value)

    def wait(self, list ranks, int index, uint64_t value, double deadline):
        """``(0, -1)`` once every rank of ``ranks`` got there, else ``(code, culprit)``."""
        cdef int r, st = W_OK
        for r in ranks:
            if r == self.w.me:
                continue
            with nogil:
                st = win_wait_one(&self.w, r, index, value, deadline)
            if st != W_OK:
                return st & 0xFF, st >> 8
        return 0, -1

    def sleep(self, int r, uint32_t word, double seconds):
        """Sleep on rank ``r``'s futex word while it still reads ``word`` (at most ``seconds``)."""
        with nogil:
            gcw_sleep(win_header(&self.w, r) + H_FUTEX, word, seconds)

    def wake_all(self):
        """Wake every sleeper on every rank's futex word."""
        cdef int r
        with nogil:
            for r in range(self.w.n):
                gcw_wake(win_header(&self.w, r) + H_FUTEX)

    def alive(self, int r):
        return not win_dead(&self.w, r)

    @property
    def waited(self):
        """Seconds this handle's waits took."""
        return self.w.waited

    @property
    def address(self):
        return <Py_ssize_t>self.w.base

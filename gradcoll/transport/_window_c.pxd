# The compiled waiting protocol of gradcoll.transport.window, for the compiled collectives to cimport.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

cdef enum:
    MAX_RANKS = 64
    HEADER_BYTES = 1024
    H_FUTEX = 0
    H_COUNTERS = 8
    H_WAITING = 64
    H_STATE = 128
    H_PID = 136
    H_ALARM = 192
    H_REPORT = 256
    H_DESCRIPTORS = 512
    N_DESCRIPTORS = 8

# Wait results (MappedWindow._raise reads the same codes).
cdef enum:
    W_OK = 0
    W_TIMEOUT = 1
    W_DEAD = 2
    W_CLOSED = 3
    W_ALARM = 4
    W_SELF_CLOSED = 5

cdef struct WinC:
    char* base
    Py_ssize_t headers
    Py_ssize_t slots
    Py_ssize_t stride
    Py_ssize_t slot_bytes
    int n
    int me
    int probe
    int fd
    double spin_s
    int yields
    double waited
    int64_t pid[MAX_RANKS]
    uint8_t local[MAX_RANKS]

cdef double win_now() noexcept nogil
cdef char* win_header(WinC* w, int r) noexcept nogil
cdef char* win_slot(WinC* w, int r) noexcept nogil
cdef uint64_t win_counter(WinC* w, int r, int index) noexcept nogil
cdef void win_publish(WinC* w, int index, uint64_t value) noexcept nogil
cdef int win_wait_one(WinC* w, int r, int index, uint64_t value, double deadline) noexcept nogil
cdef int win_wait_all(WinC* w, int index, uint64_t value, double deadline, int* culprit) noexcept nogil
cdef bint win_dead(WinC* w, int r) noexcept nogil
cdef int win_fill(WinC* w, object layout) except -1

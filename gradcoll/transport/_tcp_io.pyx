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
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint8_t


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


cdef enum:
    HDR = 24


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void _frame_iov(msghdr* msg, iovec* iov, uint8_t* h, uint8_t* p, Py_ssize_t off,
                            Py_ssize_t total) noexcept nogil:
    """Point ``msg`` at what is left of the frame from byte ``off``: header and payload, or payload alone."""
    msg.msg_name = NULL
    msg.msg_namelen = 0
    msg.msg_control = NULL
    msg.msg_controllen = 0
    msg.msg_flags = 0
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


def push(int fd, const uint8_t[::1] hdr, const uint8_t[::1] payload, Py_ssize_t off):
    """Send header and payload from byte ``off`` (header first) until done or the socket is full.

    Returns ``(off, err)``: the bytes sent so far and 0, or an errno.
    """
    cdef Py_ssize_t total = HDR + payload.shape[0]
    cdef ssize_t n
    cdef int err = 0
    cdef iovec iov[2]
    cdef msghdr msg
    cdef const uint8_t* h = &hdr[0]
    cdef const uint8_t* p = &payload[0] if payload.shape[0] else NULL
    with nogil:
        while off < total:
            _frame_iov(&msg, iov, <uint8_t*>h, <uint8_t*>p, off, total)
            n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
            if n < 0:
                if errno == EINTR:
                    continue
                if errno != EAGAIN and errno != EWOULDBLOCK:
                    err = errno
                break
            off += n
    return off, err


def pull(int fd, uint8_t[::1] hdr, uint8_t[::1] payload, Py_ssize_t off):
    """Receive header, then payload, from byte ``off`` until done, the socket is empty, or a header completes.

    Returns ``(off, err, eof)``: the bytes received so far, 0 or an errno,
    and whether the peer closed the stream.
    """
    cdef Py_ssize_t total = HDR + payload.shape[0]
    cdef ssize_t n
    cdef int err = 0, eof = 0
    cdef iovec iov[2]
    cdef msghdr msg
    cdef uint8_t* h = &hdr[0]
    cdef uint8_t* p = &payload[0] if payload.shape[0] else NULL
    with nogil:
        while off < total:
            _frame_iov(&msg, iov, h, p, off, total)
            n = recvmsg(fd, &msg, MSG_DONTWAIT)
            if n < 0:
                if errno == EINTR:
                    continue
                if errno != EAGAIN and errno != EWOULDBLOCK:
                    err = errno
                break
            if n == 0:
                eof = 1
                break
            if off < HDR <= off + n:
                off += n
                break  # the header is complete: the transport checks it before reading on
            off += n
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

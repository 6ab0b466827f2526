"""Shared windows over one mapping: the layout, the waiting protocol, and ``MappedWindow``.

A window ([`Window`][gradcoll.transport.base.Window]) is one mapping that
every rank of a host shares: the shm transport makes it in ``window_shm``, the
inproc and mpi transports in their own modules; all three hand the memory to
``MappedWindow``. Layout, in bytes:

    0       global header: magic, world size, slot bytes, stride, where headers and slots start
    PAGE    one HEADER_BYTES header per rank
    slots   one slot per rank, STRIDE bytes apart: a page multiple plus a stagger of a few cache
            lines, so that element i of two slots never shares its low 12 address bits (a reduction
            reading every slot at once would otherwise stall on 4 KiB aliasing)

A rank's header, fields grouped by who writes them, each group on its own
cache line (offsets in bytes):

    0     u32 futex word, bumped at every publish; u32 unused; u64 counters[COUNTERS]    (the owner)
    64    u8 waiting[MAX_RANKS]: byte q is 1 while rank q sleeps on the futex word       (rank q)
    128   u64 state (0 open, 1 closed, 2 alarm), u64 pid                                  (the owner)
    192   the 64-byte alarm record                                                        (the owner)
    256   the 64-byte report of the algorithms                                            (the owner)
    512   DESCRIPTORS descriptors of 64 bytes                                             (the owner)

The protocol. A publisher stores into its slot, then its counter (a release
store), then increments its futex word with a locked instruction (a full
fence), then reads the waiting bytes and calls ``FUTEX_WAKE`` only if one is
set. A waiter spins for ``spin_s`` (and yields ``yields`` times), then sets
its waiting byte, fences, reads the futex word, reads the counter again and
only then calls ``FUTEX_WAIT`` with the word it read: the kernel returns at
once if the word moved in between, so no wake-up is lost. Futexes are the
shared (not process-private) kind: the word lives in memory of several
processes. A sleep lasts at most ``SLICE_S``; between sleeps the waiter reads
every rank's state (an alarm or a close wakes every futex word of the
window) and, every ``PROBE_S``, asks whether the rank it waits for is alive.

The compiled implementation of the protocol is ``_window_c`` (Cython,
``nogil``; the compiled collectives call it directly). This module's Python
code is the fallback where the extension was not built: it always calls
``FUTEX_WAKE`` after a publish (it cannot fence), and without a futex it
sleeps in short steps instead.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._util import Deadline
from ..errors import CollectiveTimeout, ProtocolError, TransportBroken, TransportClosed, UsageError
from .base import Window, WindowAlarm, WindowLayout

__all__ = ["MappedWindow", "WindowAlarm", "plan", "init_header", "MAGIC", "PAGE", "HEADER_BYTES", "MAX_RANKS",
           "LAYOUT", "PROBE_S", "SLICE_S", "WINDOW_TAG"]

PAGE = 4096
LINE = 64
MAGIC = 0x4743_5749_4E00_0001  # "GCWIN", layout version 1
MAX_RANKS = 64
HEADER_BYTES = 1024
STAGGER = 5 * LINE
#: Offsets in a rank's header (bytes); ``_window_c`` has the same (a test holds them together).
LAYOUT = {"futex": 0, "counters": 8, "waiting": 64, "state": 128, "pid": 136, "alarm": 192, "report": 256,
          "descriptors": 512}
OPEN, CLOSED, ALARM = 0, 1, 2
_STATES = {OPEN: "open", CLOSED: "closed", ALARM: "alarm"}
#: How often a waiting rank asks whether the rank it waits for is alive; the longest single sleep.
PROBE_S = 0.05
#: How long a waiter spins before it sleeps on the futex, when the group has a core per rank (seconds).
SPIN_S = 50e-6
SLICE_S = 0.05
#: The tag of the window set-up messages over a transport's links (registered in ``gradcoll.algorithms.tags``).
WINDOW_TAG = 0x7F000004
_GLOBAL = struct.Struct("<QQQQQQ")  # magic, size, slot bytes, stride, headers, slots


def plan(size: int, slot_bytes: int) -> tuple[int, int, int, int]:
    """``(total bytes, headers offset, slots offset, stride)`` of a window of ``size`` slots of ``slot_bytes``."""
    if not 1 <= size <= MAX_RANKS:
        raise UsageError(f"a window holds 1 to {MAX_RANKS} ranks, not {size}")
    slot_bytes = max(LINE, -(-int(slot_bytes) // LINE) * LINE)
    stride = -(-slot_bytes // PAGE) * PAGE + STAGGER
    slots = -(-(PAGE + size * HEADER_BYTES) // PAGE) * PAGE
    return -(-(slots + size * stride) // PAGE) * PAGE, PAGE, slots, stride


def init_header(buf: Any, size: int, slot_bytes: int) -> None:
    """Write the global header of a fresh (zeroed) window into ``buf`` (the creator does it, once)."""
    _, headers, slots, stride = plan(size, slot_bytes)
    slot_bytes = max(LINE, -(-int(slot_bytes) // LINE) * LINE)
    _GLOBAL.pack_into(buf, 0, 0, size, slot_bytes, stride, headers, slots)
    struct.pack_into("<Q", buf, 0, MAGIC)  # last: a reader that sees the magic sees the rest


# -- the futex, through ctypes (the fallback path) ------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "i386": 240, "i686": 240, "aarch64": 98}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> Any:
    if _SYS_FUTEX is None or not platform.system() == "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall_fn = _syscall()


def _futex_wait(addr: int, value: int, seconds: float) -> None:
    if _syscall_fn is None:
        time.sleep(min(seconds, 2e-4))
        return
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _syscall_fn(_SYS_FUTEX, ctypes.c_void_p(addr), 0, ctypes.c_uint32(value), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    if _syscall_fn is not None:
        _syscall_fn(_SYS_FUTEX, ctypes.c_void_p(addr), 1, 0x7FFFFFFF, None, None, 0)


def _compiled() -> Any:
    try:
        from . import _window_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _window_c


class MappedWindow(Window):
    """A window over ``buf``, a writable mapping laid out as the module docstring says.

    ``fd`` and ``probe`` say how peers' deaths are seen (``WindowLayout``):
    probe 0 never (every rank is a thread of this process), 1 ``lockf`` byte
    ``r`` of ``fd`` held by rank ``r``'s process, 2 rank ``r``'s pid.
    ``release`` runs at ``close`` (unmapping, closing ``fd``). Every rank's
    pid must be in its header before the window is built (the creating
    transport sees to it). ``crowd``: the ranks, of any group, sharing this machine's cores (default ``size``);
    where they outnumber the cores, waiters yield instead of spinning.
    """

    def __init__(self, buf: Any, rank: int, size: int, *, probe: int = 0, fd: int = -1,
                 release: Callable[[], None] | None = None, spin_s: float | None = None,
                 yields: int | None = None, crowd: int | None = None) -> None:
        self.buf = buf
        self.u8 = np.frombuffer(buf, np.uint8)
        magic, n, slot_bytes, stride, headers, slots = _GLOBAL.unpack_from(self.u8.data, 0)
        if magic != MAGIC or n != size or not 0 <= rank < size:
            raise ProtocolError(f"rank {rank}: not a gradcoll window of {size} ranks (or another layout version)")
        if len(self.u8) < slots + size * stride:
            raise ProtocolError(f"rank {rank}: the window mapping is {len(self.u8)} bytes, too short for its layout")
        self.rank, self.size, self.slot_bytes = rank, size, int(slot_bytes)
        self._headers, self._slots, self._stride = int(headers), int(slots), int(stride)
        self._probe, self._fd, self._release = probe, fd, release
        self.closed = False
        self._closing = threading.Lock()
        self.cache = {}
        hdr = self.u8[headers: headers + size * HEADER_BYTES].reshape(size, HEADER_BYTES)
        self._hdr = hdr
        self._futex = hdr[:, :4].view(np.uint32).reshape(size)
        self._ctr = hdr[:, 8:64].view(np.uint64)
        self._waiting = hdr[:, 64:64 + MAX_RANKS]
        self._state = hdr[:, 128:136].view(np.uint64).reshape(size)
        self._pid = hdr[:, 136:144].view(np.uint64).reshape(size)
        self._address = self.u8.ctypes.data
        self._local = [int(self._pid[r]) == os.getpid() for r in range(size)]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        crowded = max(size, crowd or 0) > cores  # more ranks than cores: a spinner takes the core of the one it awaits
        self.spin_s = (0.0 if crowded else SPIN_S) if spin_s is None else spin_s
        self.yields = (8 if crowded else 0) if yields is None else yields
        self._c = _compiled()
        self._handle = self._c.Handle(self.layout(), self.spin_s, self.yields) if self._c is not None else None

    # -- memory ----------------------------------------------------------------------------------
    def slot(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s slot as a writable ``uint8`` array."""
        start = self._slots + rank * self._stride
        out: np.ndarray = self.u8[start: start + self.slot_bytes]
        return out

    def layout(self) -> WindowLayout:
        """The addresses compiled code reads this window at."""
        return WindowLayout(self._address, self.size, self.rank, self._headers, HEADER_BYTES, self._slots,
                            self._stride, self.slot_bytes, self._probe, self._fd)

    def counter(self, rank: int, index: int) -> int:
        """Counter ``index`` of rank ``rank``."""
        return int(self._ctr[rank, index])

    def describe(self, k: int, desc: bytes) -> None:
        """This rank's descriptor ``k`` (mod ``DESCRIPTORS``)."""
        at = LAYOUT["descriptors"] + (k % self.DESCRIPTORS) * LINE
        self._hdr[self.rank, at: at + LINE] = np.frombuffer(bytes(desc).ljust(LINE, b"\0")[:LINE], np.uint8)

    def descriptor(self, rank: int, k: int) -> bytes:
        """Rank ``rank``'s descriptor ``k`` (mod ``DESCRIPTORS``)."""
        at = LAYOUT["descriptors"] + (k % self.DESCRIPTORS) * LINE
        return self._hdr[rank, at: at + LINE].tobytes()

    def report(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s 64-byte report (the algorithms' to fill; writable for this rank)."""
        at = LAYOUT["report"]
        out: np.ndarray = self._hdr[rank, at: at + LINE]
        return out

    # -- synchronisation ---------------------------------------------------------------------------
    def publish(self, index: int, value: int) -> None:
        """Counter ``index`` of this rank := ``value``; wake its waiters."""
        if not 0 <= index < self.COUNTERS:
            raise UsageError(f"rank {self.rank}: window counter {index} out of range (0..{self.COUNTERS - 1})")
        if self._handle is not None:
            self._handle.publish(index, value)
            return
        me = self.rank
        self._ctr[me, index] = value
        self._futex[me] += np.uint32(1)
        _futex_wake(self._address + self._headers + me * HEADER_BYTES)

    def wait(self, ranks: Sequence[int], index: int, value: int, timeout: float | None = None) -> None:
        """Return once counter ``index`` of every rank in ``ranks`` is ``>= value`` (``Window.wait``)."""
        if not 0 <= index < self.COUNTERS:
            raise UsageError(f"rank {self.rank}: window counter {index} out of range (0..{self.COUNTERS - 1})")
        deadline = Deadline(timeout)
        if self._handle is not None:
            at = time.monotonic() + (1e9 if timeout is None else timeout)
            status, culprit = self._handle.wait(list(ranks), index, value, at)
            if status:
                self._raise(status, culprit, ranks, index, value, timeout)
            return
        self._wait_py(ranks, index, value, deadline)

    def _wait_py(self, ranks: Sequence[int], index: int, value: int, deadline: Deadline) -> None:
        ctr, me = self._ctr, self.rank
        start = time.monotonic()
        next_probe = start + PROBE_S
        while True:
            pending = [r for r in ranks if r != me and int(ctr[r, index]) < value]
            if not pending:
                return
            self._check_states(pending)
            now = time.monotonic()
            if deadline.expired():
                self._raise(1, pending[0], ranks, index, value, deadline.timeout)
            if now >= next_probe:
                next_probe = now + PROBE_S
                for r in pending:
                    if not self._alive(r):
                        self._raise(2, r, ranks, index, value, deadline.timeout)
            if now - start < self.spin_s:
                continue
            r = pending[0]
            self._waiting[r, me] = 1
            word = int(self._futex[r])
            if int(ctr[r, index]) < value:
                left = deadline.remaining()
                _futex_wait(self._address + self._headers + r * HEADER_BYTES, word,
                            min(SLICE_S, 2e-3, max(0.0, next_probe - now), *(() if left is None else (left,))))
            self._waiting[r, me] = 0

    def _check_states(self, pending: Sequence[int]) -> None:
        st = self._state
        for r in range(self.size):
            if st[r] == ALARM:
                self._raise(4, r, pending, 0, 0, None)
        if st[self.rank] == CLOSED:
            self._raise(5, self.rank, pending, 0, 0, None)
        for r in pending:
            if st[r] == CLOSED:
                self._raise(3, r, pending, 0, 0, None)

    def _raise(self, status: int, culprit: int, ranks: Sequence[int], index: int, value: int,
               timeout: float | None) -> None:
        """The error of a wait that ended with ``status`` (the codes of ``_window_c``) on rank ``culprit``."""
        me = self.rank
        if status == 1:
            missing = [r for r in ranks if r != me and self.counter(r, index) < value]
            raise CollectiveTimeout(
                f"rank {me}: window wait for counter {index} >= {value} timed out after {timeout}s; "
                f"rank(s) {', '.join(map(str, missing))} did not get there", rank=me, missing=missing or [culprit])
        if status == 2:
            raise TransportBroken(f"rank {me}: peer {culprit} (pid {int(self._pid[culprit])}) died", rank=me,
                                  peer=culprit)
        if status == 3:
            raise TransportClosed(f"rank {me}: peer {culprit} closed its window", rank=me, peer=culprit)
        if status == 4:
            raise WindowAlarm(f"rank {me}: peer {culprit} raised an alarm on the window", rank=me, peer=culprit,
                              record=self.alarm_record(culprit) or b"")
        raise TransportClosed(f"rank {me}: this rank's window was closed", rank=me, peer=me)

    def _alive(self, r: int) -> bool:
        if self._handle is not None:
            return bool(self._handle.alive(r))
        if r == self.rank or self._local[r] or self._probe == 0:
            return True
        if self._probe == 2:
            try:
                os.kill(int(self._pid[r]), 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        import fcntl  # only the fallback path probes from Python

        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, r)
        except OSError:
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, r)
        return False

    def _wake_all(self) -> None:
        if self._handle is not None:
            self._handle.wake_all()
            return
        for r in range(self.size):
            _futex_wake(self._address + self._headers + r * HEADER_BYTES)

    def wait_alarms(self, ranks: Sequence[int], timeout: float | None) -> None:
        """Return once every rank in ``ranks`` raised an alarm, closed or died, or ``timeout`` passed."""
        deadline = Deadline(timeout)
        while True:
            open_ = [r for r in ranks if int(self._state[r]) == OPEN and self._alive(r)]
            if not open_ or deadline.expired():
                return
            r = open_[0]
            word = int(self._futex[r])
            if int(self._state[r]) == OPEN:
                left = deadline.remaining()
                if self._handle is not None:
                    self._handle.sleep(r, word, min(PROBE_S, 1.0 if left is None else left))
                else:
                    _futex_wait(self._address + self._headers + r * HEADER_BYTES, word,
                                min(2e-3, 1.0 if left is None else left))

    # -- state ------------------------------------------------------------------------------------
    def alarm(self, record: bytes) -> None:
        """Fail the window with this rank's record and wake every waiter of every rank."""
        if self.closed:
            return
        at = LAYOUT["alarm"]
        self._hdr[self.rank, at: at + LINE] = np.frombuffer(bytes(record).ljust(LINE, b"\0")[:LINE], np.uint8)
        self._state[self.rank] = ALARM
        self._futex[self.rank] += np.uint32(1)
        self._wake_all()

    def alarm_record(self, rank: int) -> bytes | None:
        """Rank ``rank``'s alarm record, or None."""
        if int(self._state[rank]) != ALARM:
            return None
        at = LAYOUT["alarm"]
        return self._hdr[rank, at: at + LINE].tobytes()

    def state(self, rank: int) -> str:
        """``open``, ``closed``, ``alarm``, or ``dead`` for a process that died."""
        name = _STATES.get(int(self._state[rank]), "closed")
        if name == "open" and not self._alive(rank):
            return "dead"
        return name

    def alive(self, rank: int) -> bool:
        """True unless rank ``rank``'s process died."""
        return self._alive(rank)

    def close(self) -> None:
        """Mark this rank closed (unless it raised an alarm), wake every waiter, release the mapping.

        Safe from several threads at once (a watchdog's close racing the owner's): one of them releases.
        """
        with self._closing:
            if self.closed:
                return
            self._close()

    def _close(self) -> None:
        if int(self._state[self.rank]) == OPEN:
            self._state[self.rank] = CLOSED
        self._futex[self.rank] += np.uint32(1)
        self._wake_all()
        self.closed = True
        self._handle = None
        self.cache.clear()
        if self._release is not None:
            self._release()

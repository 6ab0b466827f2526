"""MPI transport over mpi4py (optional: ``pip install gradcoll[mpi]`` plus a system MPI).

``create`` duplicates the communicator (``COMM_WORLD`` by default), so
gradcoll's traffic never matches anyone else's receives. Sends are
``Isend`` of the caller's buffer; user tags are MPI tags. Receives match the
next message from the peer whatever its tag (MPI keeps messages between a
pair in order), look at its envelope with a matched probe (``improbe``) and
only then receive it into the caller's buffer with ``Irecv``, so a wrong tag
or length is reported exactly ([`CollectiveMismatch`][gradcoll.errors.CollectiveMismatch])
instead of truncating. Two reserved tags above the user range carry an
orderly close and an abort. Waits poll the requests (spin, then yield, then
short sleeps) under a lock, so threads may share a transport, and every wait
honours its timeout.

MPI itself decides what happens when a rank dies: under ``mpirun`` the job is
normally torn down, so dead-peer detection is not this module's business.

Windows: when every rank of the communicator is on one node
(``Split_type(COMM_TYPE_SHARED)`` spans it all), ``shared_memory`` is True
and ``window`` maps one with ``MPI.Win.Allocate_shared`` on that node
communicator: rank 0 allocates the whole segment (contiguous, the layout of
``gradcoll.transport.window``), every rank maps it with ``Shared_query``.
An ``Ibarrier`` polled until the timeout comes first, so that the blocking
allocation only starts once every rank is there. Like the communicator, an
MPI window is never freed (``MPI_Win_free`` is collective: a rank closing
early would hang in it); MPI releases it at finalize. Liveness is the peer's
pid (``kill(pid, 0)``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np

from .._util import Deadline
from ..errors import BackendUnavailable, CollectiveMismatch, TransportAborted, TransportClosed, UsageError
from ..store import Store
from .base import QueuedRequest, Request, Transport, Window, as_bytes_view, as_writable_view
from .window import LAYOUT, MappedWindow, init_header, plan

__all__ = ["MpiTransport", "create", "prepare"]

INSTALL_HINT = (
    "the mpi transport needs mpi4py and an MPI library: pip install gradcoll[mpi] "
    "with a system Open MPI (e.g. apt-get install openmpi-bin libopenmpi-dev)"
)
_SPIN_S, _YIELD_S = 50e-6, 2e-3


def prepare() -> None:
    """Initialise MPI now, before the group's rendezvous (``init_process_group`` calls it first).

    ``MPI_Init`` (run by importing ``mpi4py.MPI``) waits for every process of the job and holds the
    interpreter lock meanwhile. Run later, after rank 0's store server is up, a rank 0 done with the
    rendezvous would sit in it while a slower rank still asks that server (a thread of the same process)
    for the last keys: each waits for the other until the startup timeout.
    """
    _import_mpi()


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise BackendUnavailable(INSTALL_HINT) from e
    return MPI


class _Op(QueuedRequest):
    """An ``isend``/``irecv`` in flight; ``req`` is the MPI request once one exists."""

    __slots__ = ("_t", "peer", "view", "tag", "is_send", "seq", "req", "done", "error")

    def __init__(self, t: "MpiTransport", peer: int, view: memoryview, tag: int, is_send: bool, seq: int) -> None:
        self._t, self.peer, self.view, self.tag, self.is_send, self.seq = t, peer, view, tag, is_send, seq
        self.req: Any = None
        self.done = False
        self.error: BaseException | None = None

    def describe(self) -> str:
        where = f"send to peer {self.peer}" if self.is_send else f"recv from peer {self.peer}"
        return f"{where} (seq {self.seq}, tag {self.tag}, {len(self.view)} bytes)"


class MpiTransport(Transport):
    """Point-to-point transport over an MPI communicator (see the module docstring)."""

    name = "mpi"

    def __init__(self, comm: Any, mpi: Any, timeout: float = 300.0) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self._comm, self._MPI = comm, mpi
        ub = comm.Get_attr(mpi.TAG_UB)
        self._close_tag, self._abort_tag, self._max_tag = ub, ub - 1, ub - 2
        self._lock = threading.Lock()
        self._sends: list[_Op] = []
        self._loose: list[Any] = []  # requests nobody waits for (abort notices)
        self._recvq: list[deque[_Op]] = [deque() for _ in range(self.size)]
        self._seq = [[0, 0] for _ in range(self.size)]  # per peer: [next send, next recv]
        self._failure: list[tuple[type, str] | None] = [None] * self.size
        self._status = mpi.Status()
        self._node = comm.Split_type(mpi.COMM_TYPE_SHARED)
        self.shared_memory = self._node.Get_size() == self.size
        self._mpi_windows: list[Any] = []  # never freed (see the module docstring)

    def window(self, nbytes: int, timeout: float | None = None) -> Window | None:
        """Collective: a window over ``MPI.Win.Allocate_shared`` on the node, or None when ranks span nodes."""
        if not self.shared_memory:
            return None
        import os
        import struct

        MPI, node = self._MPI, self._node
        total, headers, _, _ = plan(self.size, nbytes)
        self._barrier(timeout, "window allocation")
        win = MPI.Win.Allocate_shared(total + 4096 if self.rank == 0 else 0, 1, comm=node)
        self._mpi_windows.append(win)
        buf, _ = win.Shared_query(0)
        whole = np.frombuffer(buf, np.uint8)
        # MPI aligns the segment to a few bytes only: the window starts at rank 0's next page boundary (every
        # rank maps the segment at the same offset within a page, so the same pad works everywhere).
        pad = node.bcast((-whole.ctypes.data) % 4096 if self.rank == 0 else None, root=0)
        if (whole.ctypes.data + pad) % 64:
            raise BackendUnavailable(f"rank {self.rank}: the MPI shared segment maps at another page offset here")
        mem = memoryview(whole[pad: pad + total].data)
        if self.rank == 0:  # MPI does not zero it
            mem[: headers + self.size * 1024] = bytes(headers + self.size * 1024)
            init_header(mem, self.size, nbytes)
        self._barrier(timeout, "window set-up")
        struct.pack_into("<Q", mem, headers + self.rank * 1024 + LAYOUT["pid"], os.getpid())
        self._barrier(timeout, "window set-up")
        return self._keep_window(MappedWindow(mem, self.rank, self.size, probe=2))

    def _barrier(self, timeout: float | None, what: str) -> None:
        req = self._node.Ibarrier()
        deadline = Deadline(self._timeout(timeout))
        while not req.Test():
            if deadline.expired():
                raise self._timeout_error(what, -1, deadline.timeout)
            time.sleep(1e-4)

    def _start(self, peer: int, view: memoryview, tag: int, is_send: bool) -> _Op:
        self._check_peer(peer)
        if not isinstance(tag, int) or not 0 <= tag <= self._max_tag:
            raise UsageError(f"tag must be an int in [0, {self._max_tag}], got {tag!r}")
        with self._lock:
            op = _Op(self, peer, view, tag, is_send, self._seq[peer][0 if is_send else 1])
            if self.closed or self._failure[peer] is not None:
                cls, reason = self._failure[peer] or (TransportClosed, "the transport was closed locally")
                raise cls(f"rank {self.rank}: {op.describe()}: {reason}", rank=self.rank, peer=peer)
            self._seq[peer][0 if is_send else 1] += 1
            if is_send:
                op.req = self._comm.Isend([view, self._MPI.BYTE], dest=peer, tag=tag)
                self._sends.append(op)
            else:
                self._recvq[peer].append(op)
        return op

    def isend(self, peer: int, buf: Any, tag: int = 0) -> Request:
        """Start an ``Isend`` of ``buf`` to ``peer``."""
        return self._start(peer, as_bytes_view(buf), tag, True)

    def irecv(self, peer: int, out: Any, tag: int = 0) -> Request:
        """Queue a receive of exactly ``len(out)`` bytes with ``tag`` from ``peer``."""
        return self._start(peer, as_writable_view(out), tag, False)

    def sendrecv(self, dst: int, sendbuf: Any, src: int, recvbuf: Any, tag: int = 0, timeout: float | None = None) -> int:
        """Full-duplex exchange driven by one polling loop."""
        rop = self._start(src, as_writable_view(recvbuf), tag, False)
        try:
            sop = self._start(dst, as_bytes_view(sendbuf), tag, True)
        except BaseException:
            with self._lock:
                if rop.req is None and rop in self._recvq[src]:
                    self._recvq[src].remove(rop)
            raise
        self._wait((rop, sop), timeout)
        return len(rop.view)

    # -- progress ---------------------------------------------------------
    def _progress(self) -> None:
        """Advance every request without blocking (lock held)."""
        MPI, st = self._MPI, self._status
        for op in [s for s in self._sends if s.req.Test()]:
            self._sends.remove(op)
            op.done = True
        for peer, q in enumerate(self._recvq):
            while q:
                op = q[0]
                if op.req is None:
                    msg = self._comm.improbe(source=peer, tag=MPI.ANY_TAG, status=st)
                    if msg is None:
                        break
                    got_tag, got_len = st.Get_tag(), st.Get_count(MPI.BYTE)
                    if got_tag != op.tag or got_len != len(op.view):
                        msg.Recv([bytearray(got_len), MPI.BYTE])  # consume it: the stream stays in step
                        self._mismatch(op, got_tag, got_len)
                        break
                    op.req = msg.Irecv([op.view, MPI.BYTE])
                if not op.req.Test():
                    break
                q.popleft()
                op.done = True

    def _mismatch(self, op: _Op, got_tag: int, got_len: int) -> None:
        if got_tag == self._close_tag:
            self._fail(op.peer, TransportClosed, f"peer {op.peer} closed the link")
        elif got_tag == self._abort_tag:
            self._fail(op.peer, TransportAborted, f"peer {op.peer} dropped the link after an error on its side")
        else:
            self._recvq[op.peer].popleft()
            op.error, op.done = CollectiveMismatch(
                f"rank {self.rank}: recv from peer {op.peer} expected seq {op.seq} tag {op.tag} "
                f"({len(op.view)} bytes), but peer {op.peer} sent tag {got_tag} ({got_len} bytes) "
                f"(mpi transport; the ranks are running different collectives)"
            ), True
            reason = f"link dropped after a mismatch ({op.error})"
            self._fail(op.peer, TransportAborted, reason)
            self._loose.append(self._comm.Isend([b"", self._MPI.BYTE], dest=op.peer, tag=self._abort_tag))

    def _fail(self, peer: int, cls: type, reason: str) -> None:
        if self._failure[peer] is not None:
            return
        self._failure[peer] = (cls, reason)
        for op in [*self._recvq[peer], *(s for s in self._sends if s.peer == peer and not s.done)]:
            op.error, op.done = cls(f"rank {self.rank}: {op.describe()}: {reason}", rank=self.rank, peer=peer), True
        self._recvq[peer].clear()
        # sends stay in _sends so MPI still owns their buffers until they complete

    def _wait(self, ops: tuple[_Op, ...], timeout: float | None) -> int:
        deadline, idle_since = Deadline(self._timeout(timeout)), None
        while True:
            with self._lock:
                self._progress()
                if all(op.done for op in ops):
                    break
                if deadline.expired():
                    self._expire(ops, deadline.timeout)
            now = time.monotonic()
            idle_since = idle_since or now
            if now - idle_since > _YIELD_S:
                time.sleep(min(1e-3, (now - idle_since) / 20, deadline.remaining() or 1e-3))
            elif now - idle_since > _SPIN_S:
                time.sleep(0)
        for op in ops:
            if op.error is not None:
                raise op.error
        return len(ops[0].view)

    def _test(self, op: _Op) -> bool:
        with self._lock:
            self._progress()
            return op.done

    def _cancel(self, op: _Op) -> bool:
        """Withdraw a receive that has not matched a message yet; a send is MPI's from ``Isend`` on."""
        with self._lock:
            if not op.done and not op.is_send and op.req is None:
                self._recvq[op.peer].remove(op)  # nothing matched yet: the next receive gets the next message
                op.view, op.done = op.view[:0], True  # it moved nothing: wait() returns 0
            return op.done

    def _expire(self, ops: tuple[_Op, ...], timeout: float | None) -> None:
        first = None
        for op in ops:
            if op.done:
                continue
            what = f"{'send' if op.is_send else 'recv'} (seq {op.seq}, tag {op.tag}, {len(op.view)} bytes)"
            err = self._timeout_error(what, op.peer, timeout, len(op.view))
            if op.is_send or op.req is not None:  # MPI owns the buffer now: the link is unusable
                self._fail(op.peer, TransportAborted, f"link abandoned after a timeout in {op.describe()}")
            else:
                self._recvq[op.peer].remove(op)
            op.error, op.done = err, True
            first = first or err
        if first is not None:
            raise first

    def close(self) -> None:
        """Tell every peer (a message on the close tag) and fail pending receives."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._close_windows()
            byes = [
                self._comm.Isend([b"", self._MPI.BYTE], dest=p, tag=self._close_tag)
                for p in range(self.size)
                if p != self.rank and self._failure[p] is None
            ]
            for p in range(self.size):
                if p != self.rank:
                    self._fail(p, TransportClosed, "the transport was closed locally")
            deadline = Deadline(1.0)  # queued sends and the goodbyes usually leave at once (eager)
            pending = byes + self._loose + [s.req for s in self._sends]
            while pending and not deadline.expired():
                pending = [r for r in pending if not r.Test()]
        # The communicator is deliberately not freed: our close notice may still
        # be unmatched at the peer, and MPI could reuse a freed context id for a
        # later communicator where that stale message would then match.


def create(store: Store | None, rank: int, size: int, *, timeout: float = 300.0, comm: Any = None) -> MpiTransport:
    """An MPI transport over a duplicate of ``comm`` (default ``COMM_WORLD``).

    MPI bootstraps itself, so ``store`` is not used (pass ``None``);
    ``rank`` and ``size`` must agree with the communicator. Raises
    [`BackendUnavailable`][gradcoll.errors.BackendUnavailable] without mpi4py.
    """
    MPI = _import_mpi()
    base = MPI.COMM_WORLD if comm is None else comm
    if (base.Get_rank(), base.Get_size()) != (rank, size):
        raise UsageError(
            f"rank {rank} of {size} disagrees with the MPI communicator (rank {base.Get_rank()} of {base.Get_size()})"
        )
    dup = base.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    return MpiTransport(dup, MPI, timeout)

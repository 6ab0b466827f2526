"""Shared pieces of the collective algorithms: chunk arithmetic, options, the combine kernel, error wording.

Nothing here moves data by itself. ``Coll`` is the state of one running
collective (which rank, which operation, which sequence number, which step,
where its result may hold a marker) and turns every transport error into a
message that names all of it, in the house style ``rank 3: peer 4 closed the
link during ring allreduce step 2/6 (seq 118)``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from ..errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, TransportBroken, TransportClosed, UsageError
from ..kernels.workspace import Workspace
from ..transport.base import Deadline, Request, Transport
from ..transport.frame import FrameMismatch
from .tags import seq_tag

__all__ = [
    "OPS",
    "REDUCE_DTYPES",
    "chunk_bounds",
    "segment_bounds",
    "sit_out",
    "as_flat",
    "check_op",
    "scratch",
    "Options",
    "combiner",
    "plant",
    "Coll",
    "TRANSLATED",
    "Workspace",
    "closing",
    "note_closing",
]

#: Reduction ops every allreduce-like algorithm accepts.
OPS = ("mean", "sum", "max", "min")

#: Element types the reduction kernels take.
REDUCE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

def chunk_bounds(count: int, n: int) -> list[int]:
    """Offsets of ``n`` near-equal chunks of ``count`` elements (``n + 1`` entries)."""
    # Chunk i covers [bounds[i], bounds[i+1]). With q, r = divmod(count, n)
    # every chunk gets q elements and the first r chunks one more, so sizes
    # differ by at most one and the split needs no padding: chunk i starts at
    # i*q (the q-element part of every earlier chunk) plus min(i, r) (one
    # extra element for each earlier chunk that was among the first r). Every
    # rank computes the same table from the count alone, which the handshake
    # has already agreed on, so no chunk size ever travels on the wire. When
    # count < n the last n - count chunks are empty; they still take part in
    # the ring as zero-length messages, which keeps the schedule identical for
    # every count.
    q, r = divmod(count, n)
    return [i * q + min(i, r) for i in range(n + 1)]


def segment_bounds(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into pieces of at most ``seg`` elements (one empty piece if lo == hi)."""
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def as_flat(buf: Any, *, reduce: bool, what: str = "buf") -> np.ndarray:
    """Return ``buf`` as a 1-D C-contiguous writeable view, or raise UsageError."""
    if not isinstance(buf, np.ndarray):
        raise UsageError(f"{what} must be a numpy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError(f"{what} must be a writeable C-contiguous array")
    if reduce and buf.dtype not in REDUCE_DTYPES:
        raise UsageError(f"{what} has dtype {buf.dtype}; reductions take float16, float32 or float64")
    return buf.reshape(-1)


def sit_out(coll: Coll, buf: Any, fold: int, unfold: int) -> bool:
    """Where ``n`` is not a power of two, the even ranks below ``2 (n - p)`` fold ``buf`` into the odd rank above
    (tag ``fold``) and wait for the result from it (``unfold``): True on such a rank, which is then done."""
    n, me = coll.size, coll.rank
    if not (me < 2 * (n - (1 << (n.bit_length() - 1))) and me % 2 == 0):
        return False
    coll.step = 1
    coll.send(me + 1, buf, fold)
    coll.step = coll.steps
    coll.recv(me + 1, buf, unfold)
    return True


def check_op(op: str) -> str:
    """Return ``op`` if it is a known reduction op, else raise UsageError."""
    if op not in OPS:
        raise UsageError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    return op


def scratch(ws: Workspace | None, name: str, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """``ws.get(...)``, or a fresh array without a workspace."""
    return np.empty(shape, dtype) if ws is None else ws.get(name, shape, dtype)


#: The transports whose group this rank is closing (``note_closing``, from the moment it tells its peers).
_CLOSING: weakref.WeakSet[Transport] = weakref.WeakSet()


def note_closing(t: Transport) -> None:
    """This rank is closing ``t``'s group: its peers may drop their links before ``t.closed`` is set."""
    _CLOSING.add(t)


def closing(t: Transport) -> bool:
    """Whether this rank closed, or is closing, ``t``'s group: a link error now is that close's doing."""
    return t.closed or t in _CLOSING


@dataclass(slots=True)
class Options:
    """The options every allreduce takes, as one value for the guarded frame and the schedules."""

    op: str = "mean"
    check_finite: bool = True
    seq: int = 0
    timeout: float | None = None
    workspace: Workspace | None = None
    backend: str | None = None


def plant(view: np.ndarray, marker: Any = np.nan) -> None:
    """Mark ``view`` non-finite at its first element: a slot its schedule declared in ``Coll.marks``.

    Every marker goes through here: a bad input (planted before any data
    moves) and a reduction that overflowed. Reductions carry a NaN on, so
    the result holds the marker on every rank, where ``_guard.first_marker``
    finds it.
    """
    if view.size:
        view[0] = marker


def combiner(opts: Options, n: int) -> Callable[[np.ndarray, np.ndarray, bool], None]:
    """``combine(acc, x, last)``: reduce ``x`` into ``acc`` (dividing by ``n`` on the ``last`` one for mean).

    A sum that comes out non-finite (an overflow, or a marker carried in)
    is marked at ``acc[0]``; max and min carry a NaN marker by themselves.
    """
    if opts.op in ("mean", "sum"):
        divide = n if opts.op == "mean" else None
        check, backend = opts.check_finite, opts.backend

        def combine(acc: np.ndarray, x: np.ndarray, last: bool) -> None:
            try:
                kernels.accumulate(acc, x, divide_by=divide if last else None, check_finite=check, backend=backend)
            except NonFiniteError:
                plant(acc)
        return combine
    ufunc = np.maximum if opts.op == "max" else np.minimum

    def combine_minmax(acc: np.ndarray, x: np.ndarray, last: bool) -> None:
        ufunc(acc, x, out=acc)
    return combine_minmax


#: The transport errors a collective rewords (``Coll.translate``) with its rank, operation, step and seq.
TRANSLATED = (CollectiveTimeout, TransportClosed, TransportBroken, CollectiveMismatch)


class Coll:
    """One running collective on one rank: identity, progress, and error wording."""

    __slots__ = ("t", "rank", "size", "name", "seq", "nbytes", "timeout", "started", "deadline", "step", "steps",
                 "tag0", "desc", "status", "pending", "marks")

    def __init__(self, transport: Transport, name: str, seq: int, nbytes: int, timeout: float | None) -> None:
        self.t = transport
        self.rank = transport.rank
        self.size = transport.size
        self.name = name
        self.seq = seq
        self.nbytes = nbytes
        self.timeout = transport.timeout if timeout is None else timeout
        self.started = time.monotonic()  # the call's start: its timeout, and the error path's grace, count from here
        self.deadline = Deadline(self.timeout)
        self.step = 0
        self.steps = 0
        self.tag0 = seq_tag(seq)  # phase tags are tag0 + phase (gradcoll.algorithms.tags)
        # Set by the guarded allreduce frame (_guard), for the error path:
        self.desc: tuple[int, ...] = ()  # this rank's call: the descriptor fields of its handshake Record
        self.status: Any = None  # (NONFINITE, index, value) when the local input is bad
        self.pending: dict[Request, int] | None = None  # receives not yet waited for -> peer
        # The sentinel record: where a marker may sit in the result. A bad input is planted at element 0;
        # a schedule that plants elsewhere declares its slots here when it decides them.
        self.marks: Sequence[int] = (0,)

    def begin(self, steps: int) -> None:
        """Start the data phase: ``steps`` steps, with a fresh deadline."""
        self.steps = steps
        self.step = 0
        self.deadline = Deadline(self.timeout)

    def where(self) -> str:
        """``ring allreduce step 2/6 (seq 118)`` (or without the step outside a data phase)."""
        if self.steps:
            return f"{self.name} step {self.step}/{self.steps} (seq {self.seq})"
        return f"{self.name} (seq {self.seq})"

    def timeout_error(self, missing: list[int], detail: str) -> CollectiveTimeout:
        """A CollectiveTimeout naming the missing peers, op, seq and buffer size."""
        return CollectiveTimeout(
            f"rank {self.rank}: {self.where()} timed out after {self.timeout}s on a buffer of "
            f"{self.nbytes} bytes: {detail}",
            rank=self.rank,
            missing=missing,
            op=self.name,
            seq=self.seq,
            nbytes=self.nbytes,
        )

    def translate(self, exc: BaseException, peer: int) -> BaseException:
        """The exception to raise for transport error ``exc`` on the link to ``peer``."""
        if isinstance(exc, CollectiveTimeout):
            detail = f"peer {peer} stopped responding" if self.steps else f"peer {peer} did not arrive"
            return self.timeout_error([peer], detail)
        if isinstance(exc, TransportBroken) and closing(self.t):  # the peer dropped the link at this rank's close
            exc = TransportClosed(str(exc), rank=self.rank, peer=peer)
        if isinstance(exc, TransportClosed):
            if closing(self.t):
                msg = f"rank {self.rank}: this rank's transport was closed during {self.where()}"
            else:
                msg = f"rank {self.rank}: peer {peer} closed the link during {self.where()}"
            return TransportClosed(msg, rank=self.rank, peer=peer)
        if isinstance(exc, TransportBroken):  # TransportAborted stays itself: a consequence, not a cause
            return type(exc)(f"rank {self.rank}: the link to peer {peer} broke during {self.where()}: {exc}",
                             rank=self.rank, peer=peer)
        if isinstance(exc, FrameMismatch):
            return exc  # the error path reads the frame it carries
        if isinstance(exc, CollectiveMismatch):
            return CollectiveMismatch(f"rank {self.rank}: during {self.where()}: {exc}")
        return exc

    # -- transport calls with translated errors ----------------------------
    def isend(self, peer: int, buf: Any, tag: int) -> Request:
        """Start a send to ``peer``."""
        try:
            return self.t.isend(peer, buf, tag)
        except TRANSLATED as exc:
            raise self.translate(exc, peer) from exc

    def irecv(self, peer: int, out: Any, tag: int) -> Request:
        """Start a receive from ``peer`` (remembered until waited for, for the error path)."""
        try:
            req = self.t.irecv(peer, out, tag)
        except TRANSLATED as exc:
            raise self.translate(exc, peer) from exc
        if self.pending is not None:
            self.pending[req] = peer
        return req

    def wait(self, req: Request, peer: int) -> int:
        """Wait for ``req`` until the deadline of the current phase."""
        t0 = time.perf_counter()
        try:
            n = req.wait(self.deadline.remaining())
        except TRANSLATED as exc:
            raise self.translate(exc, peer) from exc
        finally:
            self.t.note_wait(time.perf_counter() - t0)  # ProcessGroup.stats() "wait time"
        if self.pending:
            self.pending.pop(req, None)
        return n

    def send(self, peer: int, buf: Any, tag: int) -> None:
        """Blocking send to ``peer``."""
        self.wait(self.isend(peer, buf, tag), peer)

    def recv(self, peer: int, out: Any, tag: int) -> int:
        """Blocking receive from ``peer``."""
        return self.wait(self.irecv(peer, out, tag), peer)

    def sendrecv(self, peer: int, sendbuf: Any, recvbuf: Any, tag: int) -> None:
        """Exchange with ``peer`` (both directions in flight at once; the transport's own fast path)."""
        t0 = time.perf_counter()
        try:
            self.t.sendrecv(peer, sendbuf, peer, recvbuf, tag, self.deadline.remaining())
        except TRANSLATED as exc:
            raise self.translate(exc, peer) from exc
        finally:
            self.t.note_wait(time.perf_counter() - t0)

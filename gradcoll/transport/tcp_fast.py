"""The tcp transport's small exchange-and-reduce: one compiled call per recursive-doubling round.

``exchange_reduce`` is ``sendrecv`` with the peer followed by ``acc += tmp``
(and the divide of a mean's last round), for a small float buffer over a
plain link, in one ``nogil`` call of ``_tcp_io.exchange``: this rank's frame
goes out and the peer's comes in (both directions at once), the peer's header
is checked as the engine checks it (kind, seq, tag, length), and the fused
accumulate with its finite check runs on the received payload in place, a
piece at a time as the bytes arrive (the reduction fills the time the
sockets would make the call wait).

It runs only where the engine would do nothing else meanwhile: no queued
operation on any link, no other thread driving, nothing stashed, no secret
or TLS framing (those links keep ``gradcoll.transport.tcp_secure``'s loops),
the compiled extension present (``GRADCOLL_TCP_PURE_PYTHON=1`` turns it
off), at most ``SMALL_BYTES``. Otherwise it declines before a byte moves and
the caller runs its general path.

It takes large buffers too. The send runs at most ``PIECE_BYTES`` bytes
ahead of the receive, so each piece of the input is checked just before the
socket copies it and is still in cache when the peer's piece is added to
it, and the peer's bytes arrive in a ring of ``RING_BYTES`` that every step
of the transport reuses (``tmp`` is written only when a step stops early): at 2 ranks a whole large allreduce is
one such call, faster than the ring (whose reduction runs in Python-driven segments).

While the call runs, this thread is the transport's driver and the link is
``_stepping``: other threads queue behind it and wake it through the
transport's wake socket instead of writing to the socket themselves.
Anything the compiled call does not expect ends it with what it moved: a
header that is not the one due (a stray, a close, an abort, a mismatch, a
hostile length), an error, the end of the stream, the deadline, a wake-up.
``_adopt`` then turns what was moved into the engine's own send and receive
operations, at the head of their queues, judges the header with the engine's
code, and the engine's ``_wait`` finishes them: every error is the one the
general path raises, in its words. ``_tcp_io.reduce_rest`` then reduces
what the compiled call had not.

``header_in`` is that judgement, shared with the transport's own scatter
reads (``TcpTransport._pull``): a header that completed with payload bytes
already behind it in the receive buffer.
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ProtocolError
from . import frame as fr
from ._engine import Op
from .base import as_bytes_view, as_writable_view
from .plan import DECLINED, MOVED, REDUCED

__all__ = ["exchange_reduce", "header_in", "read_stash", "SMALL_BYTES", "PIECE_BYTES", "DECLINED", "MOVED", "REDUCED",
           "NONFINITE"]

#: The largest buffer (bytes) the compiled step takes (a frame's length fits its field far beyond it).
SMALL_BYTES = 1 << 40

#: How far (bytes of payload) the send may run ahead of the receive: each piece of the input is checked just
#: before the socket takes it, and is in cache when the peer's piece is added to it if it fits. Every piece
#: ends in a wait of both ranks for each other, and on a virtual machine such a wait can stall for a long
#: time with both ranks idle: fewer, larger pieces stall less often, smaller ones keep the piece in cache; this
#: size is the best trade found for large buffers (docs/performance.md, "the step's piece"). A refit records it
#: as the cost model's ``piece_bytes`` for tcp.
PIECE_BYTES = 1 << 20
#: The ring the peer's payload arrives in, reused by every step: it stays in cache however large the frame.
RING_BYTES = 2 * PIECE_BYTES
#: Where the ring starts within a 4 KiB page. The kernel copies each received byte from the socket's pages into
#: the ring; byte ``p`` of a payload sits at page offset ``24 + p`` (mod 4096) there in the usual case, after
#: the header. On AMD Zen cores that copy runs several times slower when its destination lies 1-31 bytes past its
#: source's page offset (4K aliasing; docs/transports.md, "Page offsets of the kernel's copies"). Half a page
#: away, the ring stays clear of it even when the payload starts elsewhere in the socket's pages.
RING_PAGE_OFFSET = 2048
#: The staging buffer of a send whose source the kernel would copy the slow way (the same aliasing, on the
#: sending side: ``_tcp_io._aliased``; a large NumPy array is such a source): the payload goes through it, a
#: piece at a time, copied by the C library's ``memcpy`` half a page away.
STAGE_BYTES = 256 << 10
#: Frames with a payload of at least ``STAGE_MIN`` and at most ``STAGE_MAX`` bytes are offered the staging
#: buffer. Smaller ones are not worth a look; larger ones do not stay in the cache, where the extra copy cost
#: more than the slow one saved (docs/performance.md, "the page offset of a send").
STAGE_MIN = 64 << 10
STAGE_MAX = 8 << 20
#: Whether sends stage at all: None until the first send that could (then ``copy_alias_ratio`` of the compiled
#: loops decides, once per process: staging where the CPU's string copy runs at least ``ALIAS_RATIO`` times
#: slower into the aliased destination). AMD Zen cores pay the aliasing; Intel ones hardly do, in user space
#: or in the kernel (``benches/bench_page_offset.py``), and there staging only adds a copy (docs/performance.md,
#: "Congestion control and staging"). True or False
#: sets it (the tests stage on every CPU); so does ``GRADCOLL_TCP_STAGE=1`` or ``0`` in a new process.
STAGING: bool | None = None
ALIAS_RATIO = 1.3

#: How long (seconds) the step polls, yielding the CPU in between, after the last byte it moved before it blocks
#: in ``poll``. A rank that blocks must be woken, and on a machine with more ranks than cores the kernel may queue
#: the woken rank behind another on a busy core while the other core idles (docs/performance.md, "Ranks that
#: stay runnable"); a rank that polls and yields stays runnable.
STEP_SPIN_S = 5e-4

#: ``exchange_reduce``'s outcomes.
# (the outcomes are the capability's: ``gradcoll.transport.plan``)
NONFINITE = 2  # moved and reduced; the result is not finite, marked with a NaN at element 0

_HDR = fr.HEADER_SIZE


def exchange_reduce(t: Any, io: ModuleType, peer: int, acc: np.ndarray, tmp: np.ndarray, tag: int,
                    timeout: float | None, divisor: float, check_input: bool, check: bool,
                    found: list[tuple[int, float]] | None = None, send: np.ndarray | None = None,
                    at: tuple[int, int] = (0, 0), copy: bool = False) -> int:
    """Exchange ``acc`` for the peer's frame in ``tmp`` and reduce it into ``acc`` (see the module docstring).

    ``t`` is a ``TcpTransport`` (which imports this module), ``io`` its
    compiled loops.
    ``check_input``: check ``acc`` itself, a piece at a time just before the
    socket takes it. A non-finite element in the first piece
    (``PIECE_BYTES``) declines (DECLINED) before anything is sent;
    one further on comes out as NONFINITE, with ``(index, value)`` appended
    to ``found``: this rank's input is the culprit. Raises what ``sendrecv``
    raises.
    ``send``: send this array (of ``acc``'s dtype, any size, apart from
    ``acc``) instead of ``acc``, and receive a frame of ``acc``'s size (a
    recursive-halving round: ``sendrecv(peer, send, peer, tmp)``, then
    ``acc += tmp``). ``check_input`` then checks ``send`` before the socket
    takes it and ``acc`` before adding into it; ``at`` is where ``send`` and
    ``acc`` start in the caller's buffer, for the index put in ``found``.
    ``copy`` (with ``send``): ``sendrecv(peer, send, peer, acc)`` and
    nothing else (an allgather round): MOVED once both frames moved
    (``tmp``, ``divisor`` and the checks are not used).
    """
    if type(peer) is not int or not 0 <= peer < t.size or peer == t.rank:
        t._check_peer(peer)
    if type(tag) is not int or not 0 <= tag <= fr.MAX_TAG:
        fr.check_tag(tag)
    link = t._links[peer]
    src = acc if send is None else send
    if max(acc.nbytes, src.nbytes) > SMALL_BYTES or link.secure is not None:
        return DECLINED
    with t._mu:
        if t._driving or t._queued() or link.stash or link.failure is not None or t._woken is not None or t.closed:
            return DECLINED
        t._driving, t._stepping = True, link
        sseq, rseq = link.send_seq, link.recv_seq
        link.send_seq = sseq + 1
    limit = t._timeout(timeout)
    started = time.monotonic()
    try:
        out, sent, got, serr, rerr, eof, hdr, red, fin, bad = io.exchange(
            link.fd, t._wake_fd, acc, tmp, tag, sseq, rseq, max(t._spin, STEP_SPIN_S), -1.0 if limit is None else limit, divisor,
            check_input and not copy, check, PIECE_BYTES, _ring(t), src, copy,
            _stage(t) if (acc if src is None else src).nbytes <= STAGE_MAX and staging(io) else None)
    except BaseException:  # refused its arrays: nothing moved
        _release(t, link, sseq, rseq)
        raise
    if out == io.BAD_INPUT:
        _release(t, link, sseq, rseq)
        return DECLINED
    if bad is not None and found is not None:
        found.append((at[1 if bad[2] else 0] + bad[0], bad[1]))
    if out != io.STOPPED:
        _release(t, link, None, rseq + 1)
        return MOVED if copy else REDUCED if out == io.DONE else NONFINITE
    ops = _adopt(t, link, src, acc if copy else tmp, tag, sseq, rseq, sent, got, serr, rerr, eof, hdr)
    t._wait(ops, None if limit is None else max(0.0, limit - (time.monotonic() - started)))
    if copy:  # the engine received the rest into acc itself
        return MOVED
    if check_input and src is not acc and bad is None and found is not None:  # the part of acc not yet checked
        rest = np.flatnonzero(~np.isfinite(acc[red:]))
        if rest.size:
            found.append((at[1] + red + int(rest[0]), float(acc[red + int(rest[0])])))
    return REDUCED if io.reduce_rest(acc, tmp, red, divisor, fin, check) == io.DONE else NONFINITE


def staging(io: ModuleType) -> bool:
    """Whether sends that the kernel would copy the slow way go through a staging buffer (``STAGING``)."""
    global STAGING
    if STAGING is None:
        forced = os.environ.get("GRADCOLL_TCP_STAGE")
        STAGING = forced == "1" if forced in ("0", "1") else bool(io.copy_alias_ratio() >= ALIAS_RATIO)
    return STAGING


def _ring(t: Any) -> np.ndarray:
    """The transport's receive ring for the step (``RING_BYTES``; one step runs at a time per transport)."""
    ring: np.ndarray | None = t.__dict__.get("_step_ring")
    if ring is None:
        ring = t._step_ring = _page_placed(RING_BYTES)
    return ring


def _stage(t: Any) -> np.ndarray:
    """The transport's staging buffer for sends from an array the kernel copies slowly (``STAGE_BYTES``, at
    ``RING_PAGE_OFFSET`` in its first page, as the ring)."""
    stage: np.ndarray | None = t.__dict__.get("_step_stage")
    if stage is None:
        stage = t._step_stage = _page_placed(STAGE_BYTES)
    return stage


def push_stage(t: Any) -> np.ndarray:
    """The staging buffer of the transport's frame sends (``_tcp_io.push``, always with the transport's lock held;
    the step has its own, since another thread may send on another link while it runs)."""
    stage: np.ndarray | None = t.__dict__.get("_push_stage")
    if stage is None:
        stage = t._push_stage = _page_placed(STAGE_BYTES)
    return stage


def _page_placed(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 starting ``RING_PAGE_OFFSET`` bytes into a 4 KiB page."""
    raw = np.empty(nbytes + 4096, np.uint8)
    k = (RING_PAGE_OFFSET - raw.ctypes.data) % 4096
    return raw[k:k + nbytes]


def _release(t: Any, link: Any, send_seq: int | None, recv_seq: int) -> None:
    """The step is over without handing anything to the engine: the link's next seqs (``send_seq`` None: as is)."""
    with t._mu:
        if send_seq is not None:
            link.send_seq = send_seq
        link.recv_seq = recv_seq
        t._driving, t._stepping = False, None
        if link.sendq:  # queued behind the step by another thread: written now, as it would have been inline
            t._push(link)
        if t._sleepers:
            t._cv.notify_all()


def _adopt(t: Any, link: Any, src: np.ndarray, tmp: np.ndarray, tag: int, sseq: int, rseq: int,
           sent: int, got: int, serr: int, rerr: int, eof: bool, hdr: bytes | None,
           rlink: Any = None) -> tuple[Op, Op]:
    """The engine's operations for a stopped step: ``(recv, send)``, at the head of their queues, judged. The send
    was on ``link``, the receive on ``rlink`` (None: the same link; a ring's round receives from its other
    neighbour)."""
    rlink = link if rlink is None else rlink
    sop = Op(t, link, True, as_bytes_view(src), tag)
    sop.seq, sop.hdr, sop.off = sseq, fr.pack_header(sseq, tag, sop.total), sent
    rop = Op(t, rlink, False, as_writable_view(tmp), tag)
    rop.seq, rop.off, rop.hdr = rseq, got, bytearray(_HDR)
    rop.hdr[: len(hdr or b"")] = hdr or b""
    with t._mu:
        t._driving, t._stepping = False, None
        for lk, op in ((link, sop), (rlink, rop)):
            if lk.failure is not None:  # the link failed (or closed) meanwhile: what _start would have raised
                cls, reason = lk.failure
                op.error, op.done = cls(f"rank {t.rank}: {op.describe()}: {reason}", rank=t.rank, peer=lk.peer), True
        failed = sop.done  # (a failed link's ops are done with its error)
        if not failed:
            if sent < _HDR + sop.total:
                link.sendq.appendleft(sop)
            else:
                sop.done = True
            t._busy[link] = None
        if not rop.done:
            rlink.recvq.appendleft(rop)
            t._busy[rlink] = None
            if got >= _HDR and header_in(t, rlink, rop) and rop.off >= _HDR + rop.total:
                rlink.recvq.remove(rop)
                t._finish_recv(rlink, rop)
        if serr and not failed:
            t._send_failed(link, OSError(serr, os.strerror(serr)))
        if (rerr or eof) and not rop.done and not (serr and rlink is link):
            t._broken(rlink, rop, OSError(rerr, os.strerror(rerr)) if rerr else None)
        if t._sleepers:
            t._cv.notify_all()
    return rop, sop


def header_in(t: Any, link: Any, op: Op) -> bool:
    """``op``'s header just completed, payload bytes perhaps behind it in ``op.view``: act on it (lock held).

    False when it failed the op or the link (a malformed header, a close, an
    abort, a mismatch, a hostile length). A stray frame's bytes move to its
    own buffer (``_redirect``).
    """
    try:
        got = fr.unpack_header(op.hdr)
    except ProtocolError as e:
        return not t._malformed(link, op, e)
    if not t._accept_header(link, op, got):
        return False
    if op.stray is not None and op.off > _HDR:
        _redirect(link, op)
    return True


def _redirect(link: Any, op: Op) -> None:
    """Move the payload bytes a scatter read put in the old buffer to the stray frame's own.

    Bytes beyond the stray frame belong to the frames after it: they go to
    ``link.stash``, which the next reads consume before the socket.
    """
    old = op.stray[2]
    got = op.off - _HDR
    keep = min(got, op.total)
    op.view[:keep] = old[:keep]
    if got > keep:
        link.stash = bytes(old[keep:got]) + link.stash
    op.off = _HDR + keep


def read_stash(link: Any, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` from ``link.stash`` first (as ``recvmsg_into`` would from the socket)."""
    n = 0
    for b in bufs:
        k = min(len(b), len(link.stash) - n)
        b[:k] = link.stash[n : n + k]
        n += k
        if k < len(b):
            break
    link.stash = link.stash[n:]
    return n

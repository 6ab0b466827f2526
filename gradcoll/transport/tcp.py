"""TCP transport: one socket per pair of ranks, driven by the caller's thread.

Bootstrap (``create``, through ``gradcoll.transport.tcp_connect``): every
rank that has higher peers listens and publishes ``host port token`` in the
store; every rank dials each lower rank, so each pair gets exactly one
connection. A 32-byte handshake (magic, version, rank, world size, the
listener's random token) refuses strangers, stale addresses and duplicate
links.

Data path: sockets are non-blocking with TCP_NODELAY and large buffers. ``isend`` writes header + payload inline
with one ``sendmsg`` when the socket has room (the small-message path never hands off to another thread); whatever
does not fit is queued. ``wait`` drives every queued send and receive of the transport with ``poll`` (busy-polling
for the first 50 us) until its own operation is done, so a ring's pending send keeps moving while the caller waits
for the left neighbour, and two peers exchanging 64 MiB at once never deadlock. Receives land directly in the
caller's buffer (``recvmsg_into`` / ``recv_into``, no staging copy); a large send from a source the kernel would
copy slowly, by its page offset, goes through a staging buffer (``tcp_fast.STAGE_BYTES``). The send, receive and
wait loops run compiled and without the GIL where ``_tcp_io`` was built (same bytes on the wire);
``GRADCOLL_TCP_PURE_PYTHON=1`` or a missing extension runs them here. Links with a secret (tagged frames) or TLS run
``gradcoll.transport.tcp_secure``'s.

Dead links: every socket has TCP keepalive and ``TCP_USER_TIMEOUT`` set
(``set_liveness``, ``gradcoll.transport.tcp_liveness``), so a peer that falls silent without closing (a pulled
cable, a host that lost power, a partition: no FIN, no RST) is found by the
kernel: an idle link is probed every ``heartbeat_s`` seconds, and a link
whose probes or data go unanswered for ``link_timeout`` seconds is dropped.
Its pending and later operations raise TransportBroken saying the peer is
unreachable, within ``link_timeout + heartbeat_s`` of the loss, however long
the collective's own timeout. The kernel answers the probes, so a peer busy
computing (or stopped in a debugger) is never taken for dead.

Queues, ordering, timeouts and the one-driver-at-a-time waiting live in
``FramedTransport`` (``gradcoll.transport._engine``); a socketpair wakes the
driver when another thread queues work. Frame codec:
``gradcoll.transport.frame``; format: ``docs/wire.md``.
"""

from __future__ import annotations

import array
import importlib
import os
import select
import socket
import ssl
import time
from types import ModuleType
from typing import Any, cast

import numpy as np

from .. import _auth
from .._util import Deadline
from ..errors import ProtocolError, TransportAborted, TransportBroken, TransportClosed, UsageError
from ..store import Store
from . import frame as fr
from . import tcp_fast as fast
from . import tcp_rounds
from . import tcp_secure as sec
from ._engine import FramedTransport, Link, Op
from .plan import PlanRunner, Rounds
from .tcp_connect import SOCKBUF, Linked, connect
from .tcp_liveness import HEARTBEAT_S, LINK_TIMEOUT_S, set_liveness, unreachable_or_broken
from .tcp_secure import tls_contexts

__all__ = ["TcpTransport", "create", "set_liveness", "tls_contexts", "SOCKBUF", "SPIN_S", "HEARTBEAT_S",
           "LINK_TIMEOUT_S"]

SPIN_S = 50e-6  # busy-poll this long before blocking in poll()
_HDR = fr.HEADER_SIZE


def _compiled() -> ModuleType | None:
    """The compiled send/receive/wait loops (``_tcp_io.pyx``), or None: the same loops in Python, slower."""
    if os.environ.get("GRADCOLL_TCP_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module("gradcoll.transport._tcp_io")
    except ImportError:
        return None


_IO = _compiled()


class _SockLink(Link):
    """A link over one connected, non-blocking socket; ``secure`` when it carries tags or runs in TLS."""

    def __init__(self, peer: int, sock: socket.socket, send_key: bytes | None = None,
                 recv_key: bytes | None = None) -> None:
        super().__init__(peer)
        self.sock, self.fd = sock, sock.fileno()
        self.events = 0  # mask currently registered with poll
        self.stash = b""  # bytes read past a stray frame (tcp_fast.header_in), served before the socket
        tls = isinstance(sock, ssl.SSLSocket)  # tagged or in TLS: the loops of tcp_secure
        self.secure = sec.Secure(send_key, recv_key, tls) if tls or send_key is not None else None

    def header(self, tag: int, kind: int) -> bytes:
        """A CLOSE or ABORT frame (``tag``: the reason) at the next send seq, tagged on a tagged link."""
        if self.secure is not None:
            return self.secure.header(self.send_seq, tag, 0, kind)
        return fr.pack_header(self.send_seq, tag, 0, kind)


class TcpTransport(FramedTransport, Rounds):
    """Point-to-point transport over one TCP connection per peer (see the module docstring)."""

    name = "tcp"

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket] | dict[int, Linked],
                 timeout: float = 300.0, *, heartbeat_s: float = HEARTBEAT_S,
                 link_timeout: float = LINK_TIMEOUT_S) -> None:
        if not heartbeat_s > 0 or not link_timeout > 0:
            raise UsageError(f"heartbeat_s and link_timeout must be positive, got {heartbeat_s!r}, {link_timeout!r}")
        self.heartbeat_s, self.link_timeout = float(heartbeat_s), float(link_timeout)
        links = {p: s if isinstance(s, Linked) else Linked(s) for p, s in socks.items()}
        for ln in links.values():
            ln.sock.setblocking(False)
            set_liveness(ln.sock, heartbeat_s, link_timeout)
        super().__init__(rank, size, {p: _SockLink(p, *ln) for p, ln in links.items()}, timeout)
        self.rounds = self if _IO is not None else None  # the compiled rounds need the extension
        self._peers: list[_SockLink] = [cast(_SockLink, ln) for ln in self._links if ln is not None]
        self._tls = any(ln.secure is not None and ln.secure.tls for ln in self._peers)
        self._poll = select.poll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_fd = self._wake_r.fileno()
        self._poll.register(self._wake_r.fileno(), select.POLLIN)
        self._idle_since = 0.0
        self._spin = SPIN_S
        # The compiled wait's poll set: slot 0 the wake socket, slot i the i-th peer (fd -1, ignored by
        # poll, while nothing is queued on it); updated in place, never rebuilt.
        self._fds = array.array("i", [self._wake_r.fileno()] + [-1] * len(self._peers))
        self._events = array.array("h", [select.POLLIN] + [0] * len(self._peers))
        self._revents = array.array("h", [0] * (1 + len(self._peers)))

    def exchange_reduce(self, peer: int, acc: np.ndarray, tmp: np.ndarray, tag: int, timeout: float | None,
                        divisor: float, check_input: bool, check: bool,
                        found: list[tuple[int, float]] | None = None, send: np.ndarray | None = None,
                        at: tuple[int, int] = (0, 0), copy: bool = False) -> int:
        """``Rounds.exchange_reduce``: one compiled step (``gradcoll.transport.tcp_fast``) where it can."""
        if _IO is None:
            return fast.DECLINED
        return fast.exchange_reduce(self, _IO, peer, acc, tmp, tag, timeout, divisor, check_input, check, found,
                                    send, at, copy)

    def exchange_rounds(self, *args: Any) -> int:  # a recursive doubling's rounds
        return 0 if _IO is None else tcp_rounds.exchange_rounds(self, _IO, *args)

    def exchange_plan(self, *args: Any) -> int:  # an allreduce's rounds in one call
        return 0 if _IO is None else tcp_rounds.exchange_plan(self, _IO, *args)

    def plan_runner(self, peers: tuple[int, ...], sources: tuple[int, ...] | None = None) -> PlanRunner | None:
        """``exchange_plan`` of these rounds prepared for repeated calls (``tcp_rounds.Runner``), or None."""
        return None if _IO is None else tcp_rounds.runner(self, _IO, peers, sources)

    # -- waiting ---------------------------------------------------------
    def _before_idle(self) -> None:
        for i, link in enumerate(self._peers, 1):
            mask = (select.POLLIN if link.recvq else 0) | (select.POLLOUT if link.sendq else 0)
            if mask != link.events:
                if link.events == 0:
                    self._poll.register(link.fd, mask)
                elif mask == 0:
                    self._poll.unregister(link.fd)
                else:
                    self._poll.modify(link.fd, mask)
                link.events = self._events[i] = mask
                self._fds[i] = link.fd if mask else -1

    def _idle(self, rounds: int, deadline: Deadline) -> None:
        # Poll without blocking for the first SPIN_S, yielding the CPU in between (a peer that shares this
        # core runs meanwhile), then sleep in poll(): waking a sleeping process costs tens of microseconds,
        # more than a small message's round trip. The compiled loop does it without the GIL.
        if self._tls and any(sec.pending(link) for link in self._peers):
            return  # TLS already decrypted bytes that poll cannot see
        left, now = deadline.remaining(), time.monotonic()
        if rounds <= 1:
            self._idle_since = now
        spin = max(0.0, self._idle_since + self._spin - now)  # what is left of this wait's spin
        if _IO is not None and len(self._fds) <= 64:
            if _IO.wait(self._fds, self._events, self._revents, spin, -1.0 if left is None else left) \
                    and self._revents[0]:
                self._drain_wake()
            return
        if spin:
            left = 0.0
        for fd, _ in self._poll.poll(None if left is None else left * 1000.0):
            if fd == self._wake_r.fileno():
                self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _wake_driver(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full or closed: the driver is awake anyway
            pass

    # -- moving bytes ----------------------------------------------------
    def _push(self, link: _SockLink) -> bool:
        if link.secure is not None:
            return sec.push(self, link)
        q, finished = link.sendq, False
        while q:
            op = q[0]
            if op.hdr is None:
                op.seq, link.send_seq = link.send_seq, link.send_seq + 1
                op.hdr = fr.pack_header(op.seq, op.tag, op.total)
            try:
                if _IO is not None:  # every sendmsg until the frame is out or the socket is full, in C
                    n, err = _IO.push(link.fd, op.hdr, op.view, op.off,
                                      fast.push_stage(self) if fast.STAGE_MIN <= op.total <= fast.STAGE_MAX
                                      and fast.staging(_IO) else None)
                    if err:
                        raise OSError(err, os.strerror(err))
                    n -= op.off
                elif op.off < _HDR:  # gather: header and payload in one syscall
                    n = link.sock.sendmsg([op.hdr[op.off :], op.view])
                else:
                    n = link.sock.send(op.view[op.off - _HDR :])
            except (BlockingIOError, InterruptedError):
                return finished
            except OSError as e:
                self._send_failed(link, e)
                return True
            op.off += n
            if op.off < _HDR + op.total:
                return finished  # socket buffer full; poll for POLLOUT
            q.popleft()
            op.done = finished = True
        return finished

    def _pull(self, link: _SockLink) -> bool:
        if link.secure is not None:
            return sec.pull(self, link)
        q, finished = link.recvq, False
        while q:
            op = q[0]
            if op.hdr is None:
                op.hdr = bytearray(_HDR)
                op.seq = link.recv_seq
            try:
                if _IO is not None and not link.stash:  # recvmsg until done, empty or a header is in, in C
                    n, err, eof = _IO.pull(link.fd, op.hdr, op.view, op.off)
                    if err:
                        raise OSError(err, os.strerror(err))
                    n -= op.off
                    if n == 0 and not eof:
                        return finished
                else:
                    if op.off < _HDR:  # scatter: header and payload in one syscall
                        bufs = [memoryview(op.hdr)[op.off :]]
                        if op.total:
                            bufs.append(op.view)
                    else:
                        bufs = [op.view[op.off - _HDR :]]
                    n = fast.read_stash(link, bufs) if link.stash else link.sock.recvmsg_into(bufs)[0]
            except (BlockingIOError, InterruptedError):
                return finished
            except OSError as e:
                return self._broken(link, op, e)
            if n == 0:
                return self._broken(link, op)
            before, op.off = op.off, op.off + n
            if before < _HDR <= op.off and not fast.header_in(self, link, op):
                return True
            if op.off < _HDR + op.total:
                continue  # more may be readable already; EAGAIN ends the loop
            q.popleft()
            self._finish_recv(link, op)
            finished = True
        return finished

    def _broken(self, link: _SockLink, op: Op, e: OSError | None = None) -> bool:
        """A read of ``op`` failed with ``e``, or met the end of the stream: the link is broken (True)."""
        if e is not None:
            self._fail(link, TransportBroken, unreachable_or_broken(link.peer, e, self.link_timeout, self.heartbeat_s), e)
        else:
            where = "in the middle of a message" if op.off else "without an orderly close (process died?)"
            self._fail(link, TransportBroken, f"peer {link.peer} dropped the connection {where}")
        return True

    def _malformed(self, link: _SockLink, op: Op, e: ProtocolError) -> bool:
        """``op`` read a header the codec refused: drop the link (True)."""
        self.refuse(link, op, ProtocolError(f"rank {self.rank}: peer {link.peer} broke the protocol: {e}", rank=self.rank, peer=link.peer))
        return True

    def _send_failed(self, link: _SockLink, e: OSError) -> None:
        # EPIPE/ECONNRESET also follow an orderly close; if the peer's CLOSE
        # frame is next in the stream, report "closed", not "broken".
        cls: type[TransportBroken | TransportClosed] = TransportBroken
        reason = unreachable_or_broken(link.peer, e, self.link_timeout, self.heartbeat_s)
        got = None if link.recvq and link.recvq[0].off else sec.peek(link)
        if got is not None and got.kind == fr.CLOSE:
            cls, reason = TransportClosed, f"peer {link.peer} closed the link"
        elif got is not None and got.kind == fr.ABORT:
            why = fr.abort_reason(got.tag)
            cls, reason = TransportAborted, f"peer {link.peer} dropped the link after {why} on its side"
        self._fail(link, cls, reason, e)

    # -- failure and close -------------------------------------------------
    def _on_fail(self, link: _SockLink, abort: int | None) -> None:
        if abort is not None and not (link.sendq and link.sendq[0].off):
            sec.send_now(link, link.header(abort, fr.ABORT))  # best effort: only between messages, if there is room
        try:  # wakes a poller and tells the peer at once; the fd is closed in close()
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Flush queued sends, send CLOSE to every peer, fail pending receives, release sockets."""
        if self.closed:
            return
        self._close_links(_say_goodbye)
        for link in self._peers:
            link.sock.close()
        self._wake_r.close()
        self._wake_w.close()


def _say_goodbye(link: _SockLink) -> None:
    """Flush queued sends (for up to a second), send CLOSE, then half-close."""
    sock, deadline = link.sock, Deadline(1.0)
    try:
        for op in list(link.sendq):  # the peer gets what was sent before CLOSE
            parts = sec.rest(link, op)
            for part in parts:
                sock.settimeout(max(deadline.remaining() or 0.0, 1e-3))
                sock.sendall(part)
            link.sendq.popleft()
            op.off, op.done = op.off + sum(len(p) for p in parts), True
        sock.settimeout(max(deadline.remaining() or 0.0, 1e-3))
        sock.sendall(link.header(0, fr.CLOSE))
        # Unread input makes the kernel answer our close with RST, which can
        # overtake the CLOSE frame at the peer: drain what is already here.
        sock.setblocking(False)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


# -- bootstrap ----------------------------------------------------------------
def create(
    store: Store,
    rank: int,
    size: int,
    *,
    timeout: float = 300.0,
    host: str = "127.0.0.1",
    sockbuf: int = SOCKBUF,
    key_prefix: str = "tcp",
    secret: bytes | str | None = None,
    ssl_context: ssl.SSLContext | tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    link_timeout: float = LINK_TIMEOUT_S,
) -> TcpTransport:
    """Connect ``rank`` to every other rank over TCP, exchanging addresses through ``store``.

    Every rank with higher peers listens on ``host`` (an ephemeral port) and
    publishes its address under ``{key_prefix}/{rank}``; each rank then dials
    every lower rank and accepts every higher one
    (``gradcoll.transport.tcp_connect``). Use a fresh
    [`PrefixStore`][gradcoll.store.PrefixStore] per group so stale addresses of an
    earlier group are never read. ``timeout`` bounds the whole bootstrap and
    becomes the transport's default timeout. ``secret`` (default
    ``$GRADCOLL_SECRET``): every link proves both ends know it (mutual HMAC
    challenge-response); a peer without it is refused and logged, and every
    frame carries an integrity tag (``gradcoll.transport.tcp_secure``).
    ``ssl_context``: one ``ssl.SSLContext`` that can both accept and dial,
    or a ``(server, client)`` pair (``tls_contexts``
    makes one for mutual TLS); every link then runs inside TLS.
    ``heartbeat_s`` and ``link_timeout`` say how fast a silent peer is found
    (module docstring).
    """
    socks = connect(store, rank, size, Deadline(timeout), host=host, sockbuf=sockbuf, key_prefix=key_prefix,
                    key=_auth.resolve(secret), tls=sec.tls_pair(ssl_context))
    try:
        return TcpTransport(rank, size, socks, timeout=timeout, heartbeat_s=heartbeat_s, link_timeout=link_timeout)
    except BaseException:
        for s in socks.values():
            s.sock.close()
        raise

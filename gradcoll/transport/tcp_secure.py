"""The tcp transport's links that carry integrity tags or run inside TLS: their frames and their loops.

A link gets here when the group has a secret (its frames carry tags) or an
``ssl_context`` (its socket is an ``ssl.SSLSocket``); every other link keeps
the plain path of ``gradcoll.transport.tcp`` (compiled where built), whose
bytes and speed do not change. These loops are Python: a non-blocking SSL
socket has no ``sendmsg``/``recvmsg_into``, and a tag costs a pass of
HMAC-SHA256 over the payload, which dwarfs what a compiled loop would save
(``benches/bench_secret.py``).

Frame on a tagged link (``docs/wire.md``)::

    header (24) | head tag (16) | payload (length bytes) | payload tag (16; none when length is 0)

    head tag    = HMAC-SHA256(k, seq | "H" | header)[:16]
    payload tag = HMAC-SHA256(k, seq | "P" | header | payload)[:16]

``k`` is the key of this direction of this link (derived at the handshake
from the secret, the listener's token, both ranks and both nonces:
``tcp_connect.frame_key``); ``seq`` is the 8-byte count of frames sent on
it in this direction, the receiver's own count, not the header's word. The
receiver checks the head tag before it believes the header (before its
length sizes anything, its kind ends the link, or a mismatch is reported),
hashes the payload as it arrives, and checks the payload tag before the
receive completes. A frame altered, cut short, replayed, reordered or
moved to another link fails one of the two: the receive raises a
``ProtocolError`` naming the peer and the link is dropped with an ABORT,
the path of any malformed frame. A tampered payload has by then been
written into the receive buffer, but the operation fails, never returns it.
"""

from __future__ import annotations

import hmac
import socket
import ssl
from typing import Any

from .. import _auth
from ..errors import ProtocolError, UsageError
from . import frame as fr
from .tcp_connect import TlsPair

__all__ = ["Secure", "tls_pair", "tls_contexts", "number", "remaining", "rest", "push", "pull", "send_now", "peek",
           "pending"]

_HDR, _MAC = fr.HEADER_SIZE, _auth.MAC_SIZE
#: Bytes of a frame a TLS link writes per ``send``; a small frame goes out whole, in one record.
_CHUNK = 1 << 20
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Secure:
    """What makes a link secure: the taggers of its two directions (or None) and whether it runs in TLS."""

    __slots__ = ("tx", "rx", "tls", "head")

    def __init__(self, send_key: bytes | None, recv_key: bytes | None, tls: bool) -> None:
        self.tx = _auth.Tagger(send_key) if send_key is not None else None
        self.rx = _auth.Tagger(recv_key) if recv_key is not None else None
        self.tls = tls
        self.head = _HDR + (_MAC if self.rx is not None else 0)  # header and head tag

    def header(self, seq: int, tag: int, length: int, kind: int = fr.DATA) -> bytes:
        """The header of frame ``seq``, followed by its head tag on a tagged link."""
        h = fr.pack_header(seq, tag, length, kind)
        return h if self.tx is None else h + self.tx.tag(seq, b"H", h)

    def trailer(self) -> int:
        """Bytes of the payload tag of a non-empty frame."""
        return _MAC if self.rx is not None else 0


def tls_pair(ssl_context: Any) -> TlsPair:
    """``ssl_context`` as the (server side, client side) pair; one context serves both sides."""
    if ssl_context is None:
        return None
    pair = tuple(ssl_context) if isinstance(ssl_context, (tuple, list)) else (ssl_context, ssl_context)
    if len(pair) != 2 or not all(isinstance(c, ssl.SSLContext) for c in pair):
        raise UsageError(f"ssl_context must be an ssl.SSLContext or a (server, client) pair of them, got {ssl_context!r}")
    server, client = pair
    if server.protocol == ssl.PROTOCOL_TLS_CLIENT or client.protocol == ssl.PROTOCOL_TLS_SERVER:
        raise UsageError("ssl_context: a PROTOCOL_TLS_CLIENT context cannot accept, nor a PROTOCOL_TLS_SERVER one dial; "
                         "pass a (server, client) pair (gradcoll.transport.tcp.tls_contexts makes one)")
    return server, client


def tls_contexts(certfile: str, keyfile: str | None = None, cafile: str | None = None, *,
                 check_hostname: bool = False) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A (server, client) pair for mutual TLS: both sides present ``certfile`` and trust only ``cafile``.

    ``cafile`` defaults to ``certfile`` (a self-signed group certificate).
    Every rank must present a certificate the others' ``cafile`` signed; a
    peer without one is refused during the TLS handshake. The address a
    rank dials comes from the store, so the certificate's host name is not
    checked unless ``check_hostname``: the trust is in the authority.
    """
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(certfile, keyfile)
        ctx.load_verify_locations(cafile or certfile)
        ctx.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = check_hostname
    return server, client


# -- sending ----------------------------------------------------------------------
class _Out:
    """A send's frame in progress: its size, and its running payload tag (None once appended or untagged)."""

    __slots__ = ("size", "mac", "hashed", "head")

    def __init__(self, size: int, mac: Any, head: int) -> None:
        self.size, self.mac, self.hashed, self.head = size, mac, 0, head


def number(link: Any, op: Any) -> None:
    """Give the send at the head of the queue its seq and its frame's pieces (header, payload; the trailer later).

    The payload tag is computed as the payload goes out (``_hashed_to``),
    not in a pass before the first byte, so the peer is never idle while
    this rank hashes a large payload.
    """
    sec: Secure = link.secure
    op.seq, link.send_seq = link.send_seq, link.send_seq + 1
    head = sec.header(op.seq, op.tag, op.total)
    mac = sec.tx.begin(op.seq, b"P", head[:_HDR]) if sec.tx is not None and op.total else None
    op.ext = _Out(len(head) + op.total + (_MAC if mac is not None else 0), mac, len(head))
    op.hdr = [head, op.view] if op.total else [head]
    if sec.tls and op.ext.size <= 1 << 16:
        _hashed_to(op, op.total)
        op.hdr = [b"".join(op.hdr)]  # one TLS record, not three


def _hashed_to(op: Any, upto: int) -> None:
    """Hash the payload up to byte ``upto``; once it is all hashed, its tag becomes the frame's last piece."""
    out: _Out = op.ext
    if out.mac is None:
        return
    if upto > out.hashed:
        out.mac.update(op.view[out.hashed : upto])
        out.hashed = upto
    if out.hashed == op.total:
        op.hdr.append(out.mac.digest()[:_MAC])
        out.mac = None


def remaining(op: Any) -> list[memoryview]:
    """What is left to send of ``op``'s frame, piece by piece."""
    out, skip = [], op.off
    for p in op.hdr:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(memoryview(p)[skip:])
        skip = 0
    return out


def rest(link: Any, op: Any) -> list[Any]:
    """What is left to send of the frame of ``op`` (numbered now if it was not), on any link."""
    if link.secure is not None:
        if op.hdr is None:
            number(link, op)
        _hashed_to(op, op.total)
        return remaining(op)
    if op.hdr is None:
        op.seq, link.send_seq = link.send_seq, link.send_seq + 1
        op.hdr = fr.pack_header(op.seq, op.tag, op.total)
    return [op.hdr[op.off :] if op.off < _HDR else b"", op.view[max(0, op.off - _HDR) :]]


def push(t: Any, link: Any) -> bool:
    """``TcpTransport._push`` for a secure link."""
    q, finished, sec = link.sendq, False, link.secure
    while q:
        op = q[0]
        if op.hdr is None:
            number(link, op)
        try:
            left = remaining(op)
            # An SSL write that would block must be retried with the same bytes: ``off`` has not moved, so it is.
            n = link.sock.send(left[0][:_CHUNK]) if sec.tls else link.sock.sendmsg(left)
        except _WOULD_BLOCK:
            return finished
        except OSError as e:
            t._send_failed(link, e)
            return True
        op.off += n
        out: _Out = op.ext
        if op.off > out.head:
            _hashed_to(op, min(op.off - out.head, op.total))
        if op.off < out.size:
            continue  # a partial write: the next one says EAGAIN
        q.popleft()
        op.done = finished = True
    return finished


def send_now(link: Any, data: bytes) -> None:
    """Best effort, never blocking: an ABORT frame, on any link."""
    try:
        if link.secure is not None and link.secure.tls:
            link.sock.send(data)
        else:
            link.sock.send(data, socket.MSG_DONTWAIT)
    except OSError:
        pass


def peek(link: Any) -> fr.Header | None:
    """The next frame's header if it is already here and, on a tagged link, authentic (else None); any link."""
    sec: Secure | None = link.secure
    if sec is not None and sec.tls:  # an SSL socket cannot peek; the error keeps its plainer wording
        return None
    size = _HDR if sec is None else sec.head
    try:
        head = link.sock.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        if len(head) < size or (sec is not None and sec.rx is not None
                                and not sec.rx.check(link.recv_seq, head[_HDR:], b"H", head[:_HDR])):
            return None
        return fr.unpack_header(head)
    except (OSError, ProtocolError):
        return None


def pending(link: Any) -> bool:
    """True when a TLS link holds decrypted bytes that ``poll`` cannot see."""
    return bool(link.secure.tls and link.recvq and link.sock.pending())


# -- receiving --------------------------------------------------------------------
def pull(t: Any, link: Any) -> bool:
    """``TcpTransport._pull`` for a secure link: header (and head tag), payload, payload tag, each read in place."""
    q, finished, sec = link.recvq, False, link.secure
    h = sec.head
    while q:
        op = q[0]
        if op.hdr is None:
            op.hdr, op.seq, op.ext = bytearray(h), link.recv_seq, None
        try:
            if op.off < h:
                buf = memoryview(op.hdr)[op.off :]
            elif op.off < h + op.total:
                buf = op.view[op.off - h :]
            else:
                buf = memoryview(op.ext[1])[op.off - h - op.total :]
            n = link.sock.recv_into(buf)
        except _WOULD_BLOCK:
            return finished
        except OSError as e:
            return bool(t._broken(link, op, e))
        if n == 0:
            return bool(t._broken(link, op))
        before, op.off = op.off, op.off + n
        if op.off == h:
            if not _head(t, link, op):
                return True
        elif op.ext is not None and before < h + op.total:
            op.ext[0].update(buf[:n])
        if op.off < h + op.total + (sec.trailer() if op.total else 0):
            continue  # more may be readable already; EAGAIN ends the loop
        if op.ext is not None and not hmac.compare_digest(op.ext[0].digest()[:_MAC], bytes(op.ext[1])):
            t.refuse(link, op, _forged(t, link, op, "its payload"))
            return True
        q.popleft()
        t._finish_recv(link, op)
        finished = True
    return finished


def _head(t: Any, link: Any, op: Any) -> bool:
    """Check the head tag, then act on the header (``_accept_header``); False when the link was dropped."""
    sec: Secure = link.secure
    header = op.hdr[:_HDR]
    if sec.rx is not None and not sec.rx.check(op.seq, op.hdr[_HDR:], b"H", header):
        t.refuse(link, op, _forged(t, link, op, "its header"))
        return False
    try:
        got = fr.unpack_header(header)
    except ProtocolError as e:
        t._malformed(link, op, e)
        return False
    if not t._accept_header(link, op, got):
        return False
    if sec.rx is not None and op.total:  # op.total is now the frame's own length, checked by _accept_header
        op.ext = (sec.rx.begin(op.seq, b"P", header), bytearray(_MAC))
    return True


def _forged(t: Any, link: Any, op: Any, what: str) -> ProtocolError:
    return ProtocolError(
        f"rank {t.rank}: peer {link.peer} sent frame seq {op.seq} whose integrity tag does not match {what}: the "
        f"bytes were altered, cut, replayed or reordered on the way, or the peer has another secret; the link is "
        f"dropped (tcp transport, {op.describe(with_peer=False)})", rank=t.rank, peer=link.peer)

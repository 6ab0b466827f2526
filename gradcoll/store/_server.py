"""The TCPStore server and the request codec it shares with the client (private).

Wire format (see ``gradcoll.store``): a frame is ``u32 big-endian length`` +
payload; request payload ``u8 op`` then fields, strings and blobs as ``u32
length`` + bytes (little-endian); response payload ``u8 status`` then the
op's answer. ``KeyValue`` is the table and the request handler without any
socket (what the fuzz tests drive); ``StoreServer`` adds the listening
socket, one accept thread and one thread per client connection.

Limits: the table holds at most ``max_bytes`` of keys and values and
``max_keys`` keys; a SET or ADD past them is answered with an error naming
the limit (the client raises it) and stores nothing. With a key (the
group's shared secret) a connection must pass the AUTH exchange before any
other request (HELLO excepted): the client sends ``AUTH`` + its nonce, the
server answers with its nonce and its proof, the client answers ``AUTH`` +
its proof, each an HMAC bound to both nonces and the server's port
(``gradcoll._auth``). Until then a request frame may be at most
``PREAUTH_FRAME`` bytes; a peer that fails is refused, logged with its
address on logger ``"gradcoll"``, and dropped.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from .. import _auth
from .._util import recv_exact
from ..errors import ProtocolError, UsageError

__all__ = ["KeyValue", "StoreServer", "Reader", "recv_frame", "send_frame", "blob", "MAX_FRAME", "STORE_MAGIC",
           "STORE_VERSION", "GREETING"]

#: Request ops.
SET, GET, ADD, CHECK, DELETE, HELLO, AUTH = 1, 2, 3, 4, 5, 6, 7
#: Response statuses.
OK, TIMEOUT, ERROR = 0, 1, 2
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
LEN = struct.Struct(">I")  # the frame's length prefix (big-endian)

#: Largest request or response frame (bytes) either side accepts.
MAX_FRAME = 64 << 20
#: Largest request frame before a connection has authenticated (HELLO and AUTH are tiny).
PREAUTH_FRAME = 256
#: Default bounds of the table: bytes of keys and values, and keys.
MAX_BYTES = 256 << 20
MAX_KEYS = 100_000
#: The labels of the two proofs of the AUTH exchange.
CLIENT_PROOF, SERVER_PROOF = b"gradcoll-store-client-v1", b"gradcoll-store-server-v1"

log = logging.getLogger("gradcoll")

#: The greeting: magic and protocol version, sent by the client and echoed by the server.
STORE_MAGIC = b"GCST"
STORE_VERSION = 1
GREETING = STORE_MAGIC + struct.pack("<H", STORE_VERSION)


def blob(b: bytes) -> bytes:
    """A string or blob field: u32 length + bytes."""
    return U32.pack(len(b)) + b


class Reader:
    """Field-by-field decoder of one payload; any short read is a ProtocolError."""

    def __init__(self, payload: bytes) -> None:
        self.buf, self.pos = payload, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ProtocolError("truncated store frame")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        value: int = U32.unpack(self.take(4))[0]
        return value

    def i64(self) -> int:
        value: int = I64.unpack(self.take(8))[0]
        return value

    def blob(self) -> bytes:
        return self.take(self.u32())

    def key(self) -> str:
        try:
            return self.blob().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError("store key is not valid UTF-8") from exc

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes in store frame")


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """Read one frame's payload; a length over ``limit`` is a ProtocolError before anything is allocated."""
    (n,) = LEN.unpack(recv_exact(sock, 4, "store frame"))
    if n > limit:
        raise ProtocolError(f"store frame of {n} bytes exceeds the {limit}-byte limit")
    return recv_exact(sock, n, "store frame")


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame (length prefix and payload in one call)."""
    sock.sendall(LEN.pack(len(payload)) + payload)


class KeyValue:
    """The server's table and its request handler, without sockets (``handle`` takes a payload)."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_keys: int = MAX_KEYS) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
        self.max_bytes, self.max_keys = max_bytes, max_keys
        self.used = 0  # bytes of keys and values in ``data``

    def _put(self, key: str, value: bytes) -> bytes | None:
        """Store ``value`` under ``key`` (lock held); the error response if that would pass a limit."""
        old = self.data.get(key)
        used = self.used + len(value) + (len(key) if old is None else -len(old))
        if old is None and len(self.data) >= self.max_keys:
            return bytes([ERROR]) + blob(f"store is full: {self.max_keys} keys (max_keys); {key!r} not set".encode())
        if used > self.max_bytes:
            return bytes([ERROR]) + blob(f"store is full: setting {key!r} ({len(value)} bytes) would pass "
                                         f"{self.max_bytes} bytes of keys and values (max_bytes)".encode())
        self.data[key], self.used = value, used
        self.cond.notify_all()
        return None

    def handle(self, payload: bytes) -> bytes:
        """The response payload to one request payload; a malformed request is a ProtocolError."""
        r = Reader(payload)
        op = r.take(1)[0]
        if op == SET:
            key, value = r.key(), r.blob()
            r.end()
            with self.cond:
                return self._put(key, value) or bytes([OK])
        if op == GET:
            key, ms = r.key(), r.u32()
            r.end()
            end = time.monotonic() + ms / 1000.0
            with self.cond:
                while key not in self.data and not self.closing:
                    left = end - time.monotonic()
                    if left <= 0:
                        return bytes([TIMEOUT])
                    self.cond.wait(left)
                if key not in self.data:
                    return bytes([ERROR]) + blob(b"store server is shutting down")
                return bytes([OK]) + blob(self.data[key])
        if op == ADD:
            key, amount = r.key(), r.i64()
            r.end()
            with self.cond:
                try:
                    total = int(self.data.get(key, b"0")) + amount
                except ValueError:
                    return bytes([ERROR]) + blob(f"value of {key!r} is not an integer".encode())
                refused = self._put(key, str(total).encode())
            return refused or bytes([OK]) + I64.pack(total)
        if op == CHECK:
            keys = [r.key() for _ in range(r.u32())]
            r.end()
            with self.cond:
                return bytes([OK, all(k in self.data for k in keys)])
        if op == DELETE:
            key = r.key()
            r.end()
            with self.cond:
                old = self.data.pop(key, None)
                if old is not None:
                    self.used -= len(key) + len(old)
                return bytes([OK, old is not None])
        if op == HELLO:
            greeting = r.take(len(GREETING))
            r.end()
            if greeting[:4] != STORE_MAGIC:
                raise ProtocolError(f"not a gradcoll store client (greeting {greeting!r})")
            return bytes([OK]) + GREETING
        raise ProtocolError(f"unknown store op {op}")


class StoreServer(KeyValue):
    """The key-value server: one accept thread, one thread per client connection."""

    def __init__(self, host: str, port: int, max_frame: int, *, key: bytes | None = None,
                 max_bytes: int = MAX_BYTES, max_keys: int = MAX_KEYS) -> None:
        super().__init__(max_bytes, max_keys)
        self.max_frame, self.key = max_frame, key
        self.conns: set[socket.socket] = set()
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise UsageError(f"store: cannot listen on {host}:{port}: {exc.strerror or exc} (pick another port, or "
                             "port 0 for a free one)") from exc
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, name=f"gradcoll-store:{self.port}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return  # listening socket closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True).start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        nonce: bytes | None = None  # the server's nonce, once an AUTH exchange has begun
        authed = self.key is None
        try:
            while True:
                try:
                    payload = recv_frame(conn, self.max_frame if authed else PREAUTH_FRAME)
                    if not authed and payload[:1] == bytes([AUTH]):
                        reply, nonce, authed = self._auth(payload, nonce, addr)
                    elif not authed and payload[:1] != bytes([HELLO]):
                        raise ProtocolError("this store requires the group's secret (pass secret= or set "
                                            "GRADCOLL_SECRET); request refused")
                    else:
                        reply = self.handle(payload)
                except ProtocolError as exc:
                    if not authed:
                        log.warning("store: refused a client at %s: %s", addr, exc)
                    send_frame(conn, bytes([ERROR]) + blob(str(exc).encode()))
                    return  # a client that breaks the protocol is dropped
                send_frame(conn, reply)
        except (OSError, ConnectionError):
            return
        finally:
            with self.cond:
                self.conns.discard(conn)
                self.cond.notify_all()
            conn.close()

    def _auth(self, payload: bytes, nonce: bytes | None, addr: object) -> tuple[bytes, bytes | None, bool]:
        """One step of the AUTH exchange: (reply, the server's nonce, authenticated)."""
        assert self.key is not None
        r = Reader(payload[1:])
        if nonce is None:  # step 1: the client's nonce; answer with ours and our proof
            theirs = r.take(_auth.NONCE_SIZE)
            r.end()
            nonce = _auth.nonce() + theirs
            mine = _auth.proof(self.key, SERVER_PROOF, self.port, theirs, nonce[: _auth.NONCE_SIZE])
            return bytes([OK]) + nonce[: _auth.NONCE_SIZE] + mine, nonce, False
        proof = r.take(32)
        r.end()
        ours, theirs = nonce[: _auth.NONCE_SIZE], nonce[_auth.NONCE_SIZE :]
        if not _auth.same(proof, _auth.proof(self.key, CLIENT_PROOF, self.port, theirs, ours)):
            raise ProtocolError("wrong secret: the client's proof does not match")
        return bytes([OK]), nonce, True

    def close(self, grace: float) -> None:
        """Stop accepting; let connected clients finish for up to ``grace`` s; then drop them."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() (close alone does not)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5.0)
        end = time.monotonic() + grace
        with self.cond:
            # A client may still be reading the reply to its last request.
            while self.conns and time.monotonic() < end:
                self.cond.wait(end - time.monotonic())
            self.closing = True
            conns = list(self.conns)
            self.cond.notify_all()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

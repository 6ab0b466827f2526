"""The TCPStore server and the request codec it shares with the client (private).

Wire format (see ``gradcoll.store``): a frame is ``u32 big-endian length`` +
payload; request payload ``u8 op`` then fields, strings and blobs as ``u32
length`` + bytes (little-endian); response payload ``u8 status`` then the
op's answer. ``KeyValue`` is the table and the request handler without any
socket (what the fuzz tests drive); ``StoreServer`` adds the listening
socket, one accept thread and one thread per client connection.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from .._util import recv_exact
from ..errors import ProtocolError, UsageError

__all__ = ["KeyValue", "StoreServer", "Reader", "recv_frame", "send_frame", "blob", "MAX_FRAME", "STORE_MAGIC",
           "STORE_VERSION", "GREETING"]

#: Request ops.
SET, GET, ADD, CHECK, DELETE, HELLO = 1, 2, 3, 4, 5, 6
#: Response statuses.
OK, TIMEOUT, ERROR = 0, 1, 2
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
LEN = struct.Struct(">I")  # the frame's length prefix (big-endian)

#: Largest request or response frame (bytes) either side accepts.
MAX_FRAME = 64 << 20

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

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False

    def handle(self, payload: bytes) -> bytes:
        """The response payload to one request payload; a malformed request is a ProtocolError."""
        r = Reader(payload)
        op = r.take(1)[0]
        if op == SET:
            key, value = r.key(), r.blob()
            r.end()
            with self.cond:
                self.data[key] = value
                self.cond.notify_all()
            return bytes([OK])
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
                self.data[key] = str(total).encode()
                self.cond.notify_all()
            return bytes([OK]) + I64.pack(total)
        if op == CHECK:
            keys = [r.key() for _ in range(r.u32())]
            r.end()
            with self.cond:
                return bytes([OK, all(k in self.data for k in keys)])
        if op == DELETE:
            key = r.key()
            r.end()
            with self.cond:
                return bytes([OK, self.data.pop(key, None) is not None])
        if op == HELLO:
            greeting = r.take(len(GREETING))
            r.end()
            if greeting[:4] != STORE_MAGIC:
                raise ProtocolError(f"not a gradcoll store client (greeting {greeting!r})")
            return bytes([OK]) + GREETING
        raise ProtocolError(f"unknown store op {op}")


class StoreServer(KeyValue):
    """The key-value server: one accept thread, one thread per client connection."""

    def __init__(self, host: str, port: int, max_frame: int) -> None:
        super().__init__()
        self.max_frame = max_frame
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
                conn, _ = self.sock.accept()
            except OSError:
                return  # listening socket closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    reply = self.handle(recv_frame(conn, self.max_frame))
                except ProtocolError as exc:
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

"""Key-value stores used only to bootstrap a group (never on the data path).

Like torch.distributed's ``Store``: ``set``/``get``/``add``/``wait``/
``delete``. Transports exchange addresses, segment names and the like
through a store before any collective runs. Every blocking call takes a
timeout in seconds and raises [`CollectiveTimeout`][gradcoll.errors.CollectiveTimeout].

* [`HashStore`][gradcoll.store.HashStore]: threads of one process.
* [`TCPStore`][gradcoll.store.TCPStore]: a small key-value server (run by rank 0, bound to
  127.0.0.1 unless told otherwise) and its clients. Requests and responses
  are length-prefixed frames (below); the server answers a malformed or
  oversized request with an error and drops the connection.
* [`FileStore`][gradcoll.store.FileStore]: processes that share a file system; an append-only
  log guarded by ``flock``.

TCPStore wire format: a frame is ``u32 big-endian length`` + payload.
Request payload: ``u8 op`` then fields, strings and blobs as ``u32 length``
+ bytes (little-endian): SET key value | GET key u32 timeout_ms | ADD key
i64 amount | CHECK u32 n, n keys | DELETE key | HELLO magic ``GCST`` u16
version. Response payload: ``u8 status`` (0 ok, 1 timeout, 2 error) then
GET: value | ADD: i64 | CHECK, DELETE: u8 | HELLO: magic, version | error:
message. A client greets the server with HELLO as soon as it connects, so a
client that reached some other program (a web server, another job's store)
says so at once instead of waiting for its timeout.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator

from ..errors import CollectiveTimeout, GradcollError, ProtocolError, TransportBroken, UsageError, seconds

__all__ = ["Store", "HashStore", "PrefixStore", "TCPStore", "FileStore"]


class Store(abc.ABC):
    """Bootstrap key-value store interface."""

    timeout: float = 300.0

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it to be set."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); return the new value."""

    @abc.abstractmethod
    def check(self, keys: Iterable[str]) -> bool:
        """True when every key is set (no waiting)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key is set."""
        for k in list(keys):
            self.get(k, timeout)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for stores that hold nothing
        """Release resources (sockets, server threads)."""


class HashStore(Store):
    """In-process store for ranks that are threads of one process."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        end = time.monotonic() + limit
        with self._cond:
            while key not in self._data:
                left = end - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get")
                self._cond.wait(left)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            v = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(v).encode()
            self._cond.notify_all()
            return v

    def check(self, keys: Iterable[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None


class PrefixStore(Store):
    """A view of another store with every key prefixed (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def check(self, keys: Iterable[str]) -> bool:
        return self.store.check([self._k(k) for k in keys])

    def delete(self, key: str) -> bool:
        return self.store.delete(self._k(key))


# --------------------------------------------------------------------------
# TCPStore
# --------------------------------------------------------------------------

_SET, _GET, _ADD, _CHECK, _DELETE, _HELLO = 1, 2, 3, 4, 5, 6
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_LEN = struct.Struct(">I")

#: Largest request or response frame (bytes) either side accepts.
MAX_FRAME = 64 << 20

#: The greeting: magic and protocol version, sent by the client and echoed by the server.
STORE_MAGIC = b"GCST"
STORE_VERSION = 1
_GREETING = STORE_MAGIC + struct.pack("<H", STORE_VERSION)
#: Seconds a client waits for the server's answer to its greeting.
GREETING_TIMEOUT = 5.0


def _blob(b: bytes) -> bytes:
    return _U32.pack(len(b)) + b


class _Reader:
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
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def i64(self) -> int:
        value: int = _I64.unpack(self.take(8))[0]
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed")
        out += chunk
    return bytes(out)


def _recv_upto(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only when the peer closed the connection first."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > limit:
        raise ProtocolError(f"store frame of {n} bytes exceeds the {limit}-byte limit")
    return _recv_exact(sock, n)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


class _StoreServer:
    """The key-value server: one accept thread, one thread per client connection."""

    def __init__(self, host: str, port: int, max_frame: int) -> None:
        self.max_frame = max_frame
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
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
                    payload = _recv_frame(conn, self.max_frame)
                    reply = self._handle(_Reader(payload))
                except ProtocolError as exc:
                    _send_frame(conn, bytes([_ERROR]) + _blob(str(exc).encode()))
                    return  # a client that breaks the protocol is dropped
                _send_frame(conn, reply)
        except (OSError, ConnectionError):
            return
        finally:
            with self.cond:
                self.conns.discard(conn)
                self.cond.notify_all()
            conn.close()

    def _handle(self, r: _Reader) -> bytes:
        op = r.take(1)[0]
        if op == _SET:
            key, value = r.key(), r.blob()
            r.end()
            with self.cond:
                self.data[key] = value
                self.cond.notify_all()
            return bytes([_OK])
        if op == _GET:
            key, ms = r.key(), r.u32()
            r.end()
            end = time.monotonic() + ms / 1000.0
            with self.cond:
                while key not in self.data and not self.closing:
                    left = end - time.monotonic()
                    if left <= 0:
                        return bytes([_TIMEOUT])
                    self.cond.wait(left)
                if key not in self.data:
                    return bytes([_ERROR]) + _blob(b"store server is shutting down")
                return bytes([_OK]) + _blob(self.data[key])
        if op == _ADD:
            key, amount = r.key(), r.i64()
            r.end()
            with self.cond:
                try:
                    total = int(self.data.get(key, b"0")) + amount
                except ValueError:
                    return bytes([_ERROR]) + _blob(f"value of {key!r} is not an integer".encode())
                self.data[key] = str(total).encode()
                self.cond.notify_all()
            return bytes([_OK]) + _I64.pack(total)
        if op == _CHECK:
            keys = [r.key() for _ in range(r.u32())]
            r.end()
            with self.cond:
                return bytes([_OK, all(k in self.data for k in keys)])
        if op == _DELETE:
            key = r.key()
            r.end()
            with self.cond:
                return bytes([_OK, self.data.pop(key, None) is not None])
        if op == _HELLO:
            greeting = r.take(len(_GREETING))
            r.end()
            if greeting[:4] != STORE_MAGIC:
                raise ProtocolError(f"not a gradcoll store client (greeting {greeting!r})")
            return bytes([_OK]) + _GREETING
        raise ProtocolError(f"unknown store op {op}")

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


class TCPStore(Store):
    """Key-value store over TCP; the master (rank 0) also runs the server.

    ``port=0`` with ``is_master=True`` picks a free port (read it from
    ``.port``). Clients retry connecting until ``timeout``, so the master may
    start last. Thread-safe: calls from several threads are serialised.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, is_master: bool = False,
                 timeout: float = 300.0, max_frame: int = MAX_FRAME) -> None:
        self.host, self.timeout, self.max_frame = host, timeout, max_frame
        self._server = _StoreServer(host, port, max_frame) if is_master else None
        self.port = self._server.port if self._server else port
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._connect()

    def _connect(self) -> socket.socket:
        end = time.monotonic() + self.timeout
        pause = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, end - time.monotonic()))
            except OSError as exc:  # the master may not be listening yet: retry until the deadline
                if time.monotonic() + pause > end:
                    raise CollectiveTimeout(
                        f"store: could not reach {self.host}:{self.port} within {seconds(self.timeout)}s ({exc})",
                        op="store.connect",
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._greet(sock)
            except BaseException:
                sock.close()
                raise
            return sock

    def _greet(self, sock: socket.socket) -> None:
        """Send HELLO and check the answer: something that is not a gradcoll store is named at once."""
        where = f"{self.host}:{self.port}"
        hint = "is another program using that port? (check MASTER_ADDR/MASTER_PORT or init_method)"
        sock.settimeout(min(GREETING_TIMEOUT, self.timeout))
        try:
            _send_frame(sock, bytes([_HELLO]) + _GREETING)
            head = _recv_upto(sock, 4)
            want = 1 + len(_GREETING)
            if len(head) == 4 and _LEN.unpack(head)[0] == want:
                body = _recv_upto(sock, want)
                if len(body) == want and body[0] == _OK and body[1:5] == STORE_MAGIC:
                    (version,) = struct.unpack("<H", body[5:])
                    if version != STORE_VERSION:
                        raise ProtocolError(f"store: the store at {where} speaks version {version}, "
                                            f"this gradcoll speaks {STORE_VERSION}")
                    return
                head += body
        except TimeoutError:
            raise ProtocolError(f"store: {where} accepted the connection but did not answer the gradcoll store "
                                f"greeting within {seconds(GREETING_TIMEOUT)}s: it is not a gradcoll store; "
                                f"{hint}") from None
        except OSError as exc:
            raise ProtocolError(f"store: {where} dropped the connection during the gradcoll store greeting "
                                f"({exc}): it is not a gradcoll store; {hint}") from None
        if not head:
            raise ProtocolError(f"store: {where} closed the connection without answering the gradcoll store "
                                f"greeting: it is not a gradcoll store; {hint}")
        raise ProtocolError(f"store: {where} is not a gradcoll store (it answered {bytes(head[:24])!r}); {hint}")

    def _call(self, payload: bytes, what: str, timeout: float | None = None) -> _Reader:
        with self._lock:
            if self._sock is None:
                raise UsageError("store is closed")
            try:
                self._sock.settimeout(self.timeout if timeout is None else timeout)
                _send_frame(self._sock, payload)
                r = _Reader(_recv_frame(self._sock, self.max_frame))
            except TimeoutError as exc:
                raise CollectiveTimeout(f"store: {what} got no answer from {self.host}:{self.port}",
                                        op="store") from exc
            except (OSError, ConnectionError) as exc:
                raise TransportBroken(f"store: lost the server at {self.host}:{self.port} during {what}: {exc}") from exc
        status = r.take(1)[0]
        if status == _TIMEOUT:
            raise CollectiveTimeout(f"store: {what} timed out", op="store.get")
        if status == _ERROR:
            raise GradcollError(f"store: {what} failed: {r.blob().decode(errors='replace')}")
        return r

    @staticmethod
    def _key(key: str) -> bytes:
        if not isinstance(key, str):
            raise UsageError(f"store keys are str, got {type(key).__name__}")
        return _blob(key.encode("utf-8"))

    def set(self, key: str, value: bytes) -> None:
        self._call(bytes([_SET]) + self._key(key) + _blob(bytes(value)), f"set {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        ms = min(int(limit * 1000), 0xFFFFFFFF)
        try:
            return self._call(bytes([_GET]) + self._key(key) + _U32.pack(ms), f"get {key!r}", limit + 5.0).blob()
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get") from exc

    def add(self, key: str, amount: int) -> int:
        return self._call(bytes([_ADD]) + self._key(key) + _I64.pack(amount), f"add {key!r}").i64()

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        payload = bytes([_CHECK]) + _U32.pack(len(keys)) + b"".join(self._key(k) for k in keys)
        return bool(self._call(payload, "check").take(1)[0])

    def delete(self, key: str) -> bool:
        return bool(self._call(bytes([_DELETE]) + self._key(key), f"delete {key!r}").take(1)[0])

    def close(self, grace: float | None = None) -> None:
        """Close the connection; the master also stops the server. Idempotent.

        The master's server first waits up to ``grace`` seconds (default
        ``min(timeout, 5)``) for the other clients to disconnect, so none of
        them loses the reply to its last request.
        """
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        if self._server is not None:
            self._server.close(min(self.timeout, 5.0) if grace is None else grace)
            self._server = None


# --------------------------------------------------------------------------
# FileStore
# --------------------------------------------------------------------------

_REC = struct.Struct("<BII")  # op (1 set, 2 delete), key length, value length
_REFS = "__gradcoll_filestore_refs"


class FileStore(Store):
    """Store in one file shared by processes on one file system (an append-only, ``flock``-ed log).

    Waiting for a key polls the file with a growing pause (up to 50 ms).
    Every instance counts itself in the file; the last one to close deletes
    it, so a path can be reused by the next job.
    """

    def __init__(self, path: str, timeout: float = 300.0) -> None:
        self.path, self.timeout = path, timeout
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self.add(_REFS, 1)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Hold the thread lock and the file lock (shared or exclusive); yields the fd."""
        with self._lock:
            if self._fd is None:
                raise UsageError("store is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield self._fd
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _refresh(self, fd: int) -> None:
        """Apply the records other processes appended since the last read (locks held)."""
        size = os.fstat(fd).st_size
        if size <= self._offset:
            return
        raw = os.pread(fd, size - self._offset, self._offset)
        pos = 0
        while pos + _REC.size <= len(raw):
            op, klen, vlen = _REC.unpack_from(raw, pos)
            end = pos + _REC.size + klen + vlen
            if end > len(raw):
                break  # a record being written right now: read it next time
            key = raw[pos + _REC.size : pos + _REC.size + klen].decode("utf-8")
            if op == 1:
                self._data[key] = raw[end - vlen : end]
            else:
                self._data.pop(key, None)
            pos = end
        self._offset += pos

    @staticmethod
    def _append(fd: int, op: int, key: str, value: bytes = b"") -> None:
        k = key.encode("utf-8")
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, _REC.pack(op, len(k), len(value)) + k + value)

    def set(self, key: str, value: bytes) -> None:
        with self._locked(True) as fd:
            self._append(fd, 1, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        end = time.monotonic() + limit
        pause = 0.001
        while True:
            with self._locked(False) as fd:
                self._refresh(fd)
                if key in self._data:
                    return self._data[key]
            if time.monotonic() >= end:
                raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get")
            time.sleep(min(pause, max(0.0, end - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def add(self, key: str, amount: int) -> int:
        with self._locked(True) as fd:
            self._refresh(fd)
            value = int(self._data.get(key, b"0")) + amount
            self._append(fd, 1, key, str(value).encode())
            return value

    def check(self, keys: Iterable[str]) -> bool:
        with self._locked(False) as fd:
            self._refresh(fd)
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._locked(True) as fd:
            self._refresh(fd)
            existed = key in self._data
            self._append(fd, 2, key)
            return existed

    def close(self) -> None:
        """Drop this instance's reference; the last one deletes the file. Idempotent."""
        if self._fd is None:
            return
        with self._locked(True) as fd:
            self._refresh(fd)
            refs = int(self._data.get(_REFS, b"1")) - 1
            self._append(fd, 1, _REFS, str(refs).encode())
            if refs <= 0:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        os.close(self._fd)
        self._fd = None

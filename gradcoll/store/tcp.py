"""``TCPStore``: the client of the store server (``gradcoll.store._server``), which rank 0 also runs."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterable

from .. import _auth
from .._util import recv_upto
from ..errors import CollectiveTimeout, GradcollError, ProtocolError, TransportBroken, UsageError, seconds
from ._server import (
    ADD,
    AUTH,
    CHECK,
    CLIENT_PROOF,
    DELETE,
    ERROR,
    GET,
    GREETING,
    HELLO,
    I64,
    LEN,
    MAX_BYTES,
    MAX_FRAME,
    MAX_KEYS,
    OK,
    SERVER_PROOF,
    SET,
    STORE_MAGIC,
    STORE_VERSION,
    TIMEOUT,
    U32,
    Reader,
    StoreServer,
    blob,
    recv_frame,
    send_frame,
)
from .base import Store

__all__ = ["TCPStore", "GREETING_TIMEOUT"]

#: Seconds a client waits for the server's answer to its greeting.
GREETING_TIMEOUT = 5.0


class TCPStore(Store):
    """Key-value store over TCP; the master (rank 0) also runs the server.

    ``port=0`` with ``is_master=True`` picks a free port (read it from
    ``.port``). Clients retry connecting until ``timeout``, so the master may
    start last. Thread-safe: calls from several threads are serialised.

    ``secret`` (bytes or str; default ``$GRADCOLL_SECRET``, none if unset):
    the server refuses every request of a client that does not prove it
    knows the secret, and the client refuses a server that does not prove
    it (mutual HMAC challenge-response bound to both nonces and the port).
    The master's table holds at most ``max_bytes`` of keys and values and
    ``max_keys`` keys; a set past them raises GradcollError naming the limit.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, is_master: bool = False,
                 timeout: float = 300.0, max_frame: int = MAX_FRAME, secret: bytes | str | None = None,
                 max_bytes: int = MAX_BYTES, max_keys: int = MAX_KEYS) -> None:
        self.host, self.timeout, self.max_frame = host, timeout, max_frame
        self._secret = _auth.resolve(secret)
        self._server = (StoreServer(host, port, max_frame, key=self._secret, max_bytes=max_bytes, max_keys=max_keys)
                        if is_master else None)
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
                if self._secret is not None:
                    self._authenticate(sock)
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
            send_frame(sock, bytes([HELLO]) + GREETING)
            head = recv_upto(sock, 4)
            want = 1 + len(GREETING)
            if len(head) == 4 and LEN.unpack(head)[0] == want:
                body = recv_upto(sock, want)
                if len(body) == want and body[0] == OK and body[1:5] == STORE_MAGIC:
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

    def _authenticate(self, sock: socket.socket) -> None:
        """The client's side of the AUTH exchange (``gradcoll.store._server``): both ends prove the secret."""
        where = f"{self.host}:{self.port}"
        mine = _auth.nonce()
        try:
            send_frame(sock, bytes([AUTH]) + mine)
            r = Reader(recv_frame(sock, 1024))
            if r.take(1)[0] != OK:
                raise ProtocolError(f"store: the store at {where} does not take a secret, but this rank has one: "
                                    f"refusing it ({r.blob().decode(errors='replace')})")
            theirs, proof = r.take(_auth.NONCE_SIZE), r.take(32)
            if not _auth.same(proof, _auth.proof(self._secret or b"", SERVER_PROOF, self.port, mine, theirs)):
                raise ProtocolError(f"store: the store at {where} does not know the group's secret: refusing it")
            send_frame(sock, bytes([AUTH]) + _auth.proof(self._secret or b"", CLIENT_PROOF, self.port, mine, theirs))
            r = Reader(recv_frame(sock, 1024))
            if r.take(1)[0] != OK:
                raise ProtocolError(f"store: the store at {where} refused this rank's secret: "
                                    f"{r.blob().decode(errors='replace')}")
        except (OSError, ConnectionError) as exc:
            raise ProtocolError(f"store: {where} dropped the connection during authentication ({exc})") from None
        finally:
            sock.settimeout(None)

    def _call(self, payload: bytes, what: str, timeout: float | None = None) -> Reader:
        with self._lock:
            if self._sock is None:
                raise UsageError("store is closed")
            try:
                self._sock.settimeout(self.timeout if timeout is None else timeout)
                send_frame(self._sock, payload)
                r = Reader(recv_frame(self._sock, self.max_frame))
            except TimeoutError as exc:
                raise CollectiveTimeout(f"store: {what} got no answer from {self.host}:{self.port}",
                                        op="store") from exc
            except (OSError, ConnectionError) as exc:
                raise TransportBroken(f"store: lost the server at {self.host}:{self.port} during {what}: {exc}") from exc
        status = r.take(1)[0]
        if status == TIMEOUT:
            raise CollectiveTimeout(f"store: {what} timed out", op="store.get")
        if status == ERROR:
            raise GradcollError(f"store: {what} failed: {r.blob().decode(errors='replace')}")
        return r

    @staticmethod
    def _key(key: str) -> bytes:
        if not isinstance(key, str):
            raise UsageError(f"store keys are str, got {type(key).__name__}")
        return blob(key.encode("utf-8"))

    def set(self, key: str, value: bytes) -> None:
        self._call(bytes([SET]) + self._key(key) + blob(bytes(value)), f"set {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        ms = min(int(limit * 1000), 0xFFFFFFFF)
        try:
            return self._call(bytes([GET]) + self._key(key) + U32.pack(ms), f"get {key!r}", limit + 5.0).blob()
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get") from exc

    def add(self, key: str, amount: int) -> int:
        return self._call(bytes([ADD]) + self._key(key) + I64.pack(amount), f"add {key!r}").i64()

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        payload = bytes([CHECK]) + U32.pack(len(keys)) + b"".join(self._key(k) for k in keys)
        return bool(self._call(payload, "check").take(1)[0])

    def delete(self, key: str) -> bool:
        return bool(self._call(bytes([DELETE]) + self._key(key), f"delete {key!r}").take(1)[0])

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

"""The sync service over gRPC: one server-streaming method, no protoc.

Method ``/gradcoll.sync.GradientSync/SyncGradients`` takes one request
message and streams chunk messages then one summary message, all in the
``gradcoll.sync.wire`` format. It is registered with grpcio's generic
handlers on a ``grpc.aio`` server, so every waiting peer costs a coroutine,
not a thread. The server binds 127.0.0.1 unless told otherwise; with a
``token`` it refuses (UNAUTHENTICATED) every call whose ``authorization``
metadata is not ``Bearer <token>`` (compared in constant time). The token
travels in clear unless ``credentials`` (TLS) are given. With the group's
shared secret instead (``secret=`` or ``GRADCOLL_SECRET``, when no token is
given) the token is derived from it (``sync_token``): the secret itself
never travels, and the same secret serves the group, the node driver and
the sync service.

Failures travel as a gRPC status plus trailing metadata ``gradcoll-error``
naming the gradcoll exception class, which the client raises again.

Run a standalone server with ``python -m gradcoll.sync --store DIR``
(token from the ``GRADCOLL_SYNC_TOKEN`` environment variable).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from .. import _auth
from ..errors import CollectiveMismatch, CollectiveTimeout, GradcollError, NonFiniteError, ProtocolError, TransportError, UsageError
from . import wire
from .blockstore import BlockNotFound, CorruptBlock, FileBlockStore
from .messages import AuthenticationError
from .service import GradientSyncService

__all__ = ["GradientSyncServer", "ServerThread", "SERVICE", "METHOD", "ERROR_KINDS", "main", "sync_token"]

SERVICE = "gradcoll.sync.GradientSync"
METHOD = f"/{SERVICE}/SyncGradients"
#: Default cap on one gRPC message: a request holds the whole gradient
#: (8 bytes per element as Arrow), so 512 MiB is about 67M elements.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024
ERROR_METADATA = "gradcoll-error"

# Most specific first: the first isinstance match decides the status code.
_STATUS: Sequence[tuple[type[BaseException], grpc.StatusCode]] = (
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (NonFiniteError, grpc.StatusCode.INVALID_ARGUMENT),
    (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
    (CollectiveMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (CollectiveTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (BlockNotFound, grpc.StatusCode.DATA_LOSS),
    (ProtocolError, grpc.StatusCode.DATA_LOSS),
    (GradcollError, grpc.StatusCode.INTERNAL),
)
#: Exception classes a client may re-raise, by the name sent in ``gradcoll-error``.
ERROR_KINDS: dict[str, type[GradcollError]] = {cls.__name__: cls for cls, _ in _STATUS}  # type: ignore[misc]

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    cls, code = next((c, s) for c, s in _STATUS if isinstance(exc, c))
    await context.abort(code, str(exc), trailing_metadata=((ERROR_METADATA, cls.__name__),))


def sync_token(token: str | None, secret: bytes | str | None) -> str | None:
    """``token``, else the bearer token derived from the shared secret (``secret`` or ``GRADCOLL_SECRET``)."""
    if token is not None:
        return token
    key = _auth.resolve(secret)
    return None if key is None else _auth.derive(key, b"gradcoll-sync-token-v1").hex()


class GradientSyncServer:
    """Serves a GradientSyncService over gRPC on an asyncio loop (``await start()``)."""

    def __init__(
        self,
        service: GradientSyncService,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ServerCredentials | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        token = sync_token(token, secret)
        if token is not None and not token:
            raise UsageError("token must be None (no authentication) or a non-empty string")
        self.service = service
        self.host = host
        self.port = port
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._max = max_message_bytes
        self._credentials = credentials
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """``host:port`` for clients (the bound port once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and start serving; return the bound port."""
        options = [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ]
        server = grpc.aio.server(options=options)
        handler = grpc.unary_stream_rpc_method_handler(self._sync)  # raw bytes in and out: we parse
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"SyncGradients": handler}),))
        bound: int  # grpc's add_*_port return the bound port, 0 on failure
        try:
            if self._credentials is None:
                bound = server.add_insecure_port(self.address)
            else:
                bound = server.add_secure_port(self.address, self._credentials)
        except RuntimeError as exc:
            raise TransportError(f"gradient sync server cannot bind {self.address}: {exc}") from exc
        if not bound:
            raise TransportError(f"gradient sync server cannot bind {self.address}")
        self.port = bound
        await server.start()
        self._server = server
        log.info("gradient sync server listening on %s", self.address)
        return bound

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; running calls get ``grace`` seconds to finish."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        """Wait until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self._expected is None:
            return True
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def _sync(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if not self._authorized(context):
            await _abort(context, AuthenticationError("gradient sync server: missing or invalid token"))
        try:
            request = wire.decode_request(raw)
        except ProtocolError as exc:
            # The caller's bytes are malformed: for the caller that is misuse.
            await _abort(context, UsageError(f"malformed sync request: {exc}"))
        stream = self.service.stream(request)
        try:
            async for chunk in stream:
                yield wire.encode_response(chunk)
            assert stream.summary is not None
            yield wire.encode_response(stream.summary)
        except GradcollError as exc:
            await _abort(context, exc)
        except Exception as exc:  # a bug of ours: log it, tell the caller, keep serving
            log.exception("gradient sync server: internal error in session %r", request.session_id)
            await _abort(context, GradcollError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()


class ServerThread:
    """Runs a GradientSyncServer on its own event loop in a daemon thread (for synchronous programs)."""

    def __init__(self, service: GradientSyncService, **server_kwargs: Any) -> None:
        self.server = GradientSyncServer(service, **server_kwargs)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the running server."""
        return self.server.address

    def start(self, timeout: float = 10.0) -> int:
        """Start the server thread and wait until it listens; return the port."""
        self._thread = threading.Thread(target=self._main, name="gradcoll-sync-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise CollectiveTimeout(f"gradient sync server did not start within {timeout}s", op="server start")
        if self._error is not None:
            raise self._error
        return self.server.port

    def stop(self, timeout: float = 10.0, grace: float = 1.0) -> None:
        """Stop the server and join its thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._grace = grace
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CollectiveTimeout(f"gradient sync server did not stop within {timeout}s", op="server stop")

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # handed to start(), which re-raises it in the caller's thread
            self._error = exc
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._grace = 1.0
        await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(self._grace)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: serve a FileBlockStore-backed sync service until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m gradcoll.sync", description="gradcoll gradient sync server")
    p.add_argument("--store", required=True, help="directory of the FileBlockStore")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default: any free one, printed)")
    args = p.parse_args(argv)
    token = os.environ.get("GRADCOLL_SYNC_TOKEN") or None  # never on the command line: ps shows it

    async def run() -> None:
        server = GradientSyncServer(
            GradientSyncService(FileBlockStore(args.store)), host=args.host, port=args.port, token=token
        )
        await server.start()
        print(f"gradcoll-sync listening on {server.address}", flush=True)  # the readiness line
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(2.0)

    asyncio.run(run())

"""GradientSyncClient: the in-process service's API, served by a remote process over gRPC.

``sync_gradients(request, sink)``, ``stream(request)`` and ``collect(request)``
behave as on ``GradientSyncService``, with the same
objects and the same exceptions: the server's ``gradcoll-error`` trailing
metadata names the class to raise. Every chunk's CRC32 is checked as it
arrives. A request without ``peer_id`` gets one here (host, pid, random), so
the id names the calling process.

Every wait is bounded: connecting by ``connect_timeout``, the call by the
request's ``timeout_secs`` (the wait for peers) plus ``stream_timeout`` (the
transfer).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import grpc.aio

from ..errors import CollectiveTimeout, GradcollError, ProtocolError, TransportBroken, TransportClosed
from . import wire
from .accumulator import Aggregation
from .grpc_server import DEFAULT_MAX_MESSAGE_BYTES, ERROR_KINDS, ERROR_METADATA, METHOD, sync_token
from .messages import AuthenticationError, GradientChunkResponse, GradientSyncRequest, SyncResult, SyncStream, SyncSummary, new_peer_id

__all__ = ["GradientSyncClient"]

# Status codes that mean the link, not the request, failed.
_BY_CODE: dict[grpc.StatusCode, type[GradcollError]] = {
    grpc.StatusCode.UNAVAILABLE: TransportBroken,
    grpc.StatusCode.CANCELLED: TransportClosed,
    grpc.StatusCode.DEADLINE_EXCEEDED: CollectiveTimeout,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
}


def _error_from(exc: grpc.aio.AioRpcError, target: str) -> GradcollError:
    kind = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_METADATA:
            kind = ERROR_KINDS.get(value if isinstance(value, str) else value.decode(errors="replace"))
    cls = kind or _BY_CODE.get(exc.code(), ProtocolError)
    return cls(f"sync server {target}: {exc.details()} [{exc.code().name}]")


class GradientSyncClient:
    """Client of a remote GradientSyncService (``target`` is ``host:port``)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        stream_timeout: float = 300.0,
        send_timeout: float = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        token = sync_token(token, secret)  # no token: the one derived from the group's secret, if any
        self.target = target
        self.connect_timeout = connect_timeout
        self.stream_timeout = stream_timeout
        self.send_timeout = send_timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._credentials = credentials
        # grpc.aio channels belong to the loop that made them: one per loop.
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connected(self) -> grpc.aio.Channel:
        loop = asyncio.get_running_loop()
        if self._channel is not None and self._loop is loop:
            return self._channel
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self.target, options=self._options)
        else:
            channel = grpc.aio.secure_channel(self.target, self._credentials, options=self._options)
        try:
            # Retry-connect with a bounded deadline: gRPC redials on its own
            # until the server answers or the deadline passes.
            await asyncio.wait_for(channel.channel_ready(), self.connect_timeout)
        except asyncio.TimeoutError:
            await channel.close()
            raise TransportBroken(
                f"cannot reach the gradient sync server at {self.target} within {self.connect_timeout}s"
            ) from None
        self._channel, self._loop = channel, loop
        return channel

    async def wait_ready(self) -> None:
        """Connect now (raises TransportBroken after ``connect_timeout``)."""
        await self._connected()

    def stream(self, request: GradientSyncRequest) -> SyncStream:
        """``async for chunk in client.stream(request)``; ``.summary`` is set at the end."""
        if request.peer_id is None:
            request = dataclasses.replace(request, peer_id=new_peer_id())
        return SyncStream(self._run(request))

    async def sync_gradients(self, request: GradientSyncRequest, sink: asyncio.Queue[GradientChunkResponse | None]) -> SyncSummary:
        """Stream the session's chunks onto ``sink``, then ``None``; return the summary."""
        return await self.stream(request).pump(sink, self.send_timeout)

    async def collect(
        self,
        request: GradientSyncRequest,
        strategy: Aggregation | str | None = Aggregation.FEDAVG,
        *,
        weights: Mapping[str, float] | None = None,
    ) -> SyncResult:
        """Sync, reassemble every peer's gradient and aggregate them (FedAvg by default)."""
        return await self.stream(request).collect(strategy, weights=weights)

    async def _run(self, request: GradientSyncRequest) -> AsyncIterator[GradientChunkResponse | SyncSummary]:
        channel = await self._connected()
        call = channel.unary_stream(METHOD)(
            wire.encode_request(request),
            timeout=request.timeout_secs + self.stream_timeout,
            metadata=self._metadata,
        )
        try:
            async for raw in call:
                item = wire.decode_response(raw)
                if isinstance(item, GradientChunkResponse):
                    item.verify()  # a flipped bit in flight stops here
                yield item
                if isinstance(item, SyncSummary):
                    return
            raise ProtocolError(f"sync server {self.target} ended the stream without its summary")
        except grpc.aio.AioRpcError as exc:
            raise _error_from(exc, self.target) from exc
        finally:
            call.cancel()  # no-op after a normal end; frees the server's handler otherwise

    async def close(self) -> None:
        """Close the channel."""
        if self._channel is not None:
            channel, self._channel, self._loop = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> GradientSyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

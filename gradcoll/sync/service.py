"""GradientSyncService: peers of a session exchange gradients through one service.

A call (``sync_gradients``, ``stream`` or ``collect``) does, in order:

1. decode the caller's Arrow IPC gradient (malformed bytes: UsageError);
2. refuse it if it holds NaN/Inf or its length differs from the session's
   (errors name the session and the peer);
3. commit it to the block store, chunked under a manifest, and join the
   session under the caller's peer id;
4. wait, without polling, until ``min_peers`` *other* peers have joined or
   ``timeout_secs`` pass (``strict=True`` turns the timeout into
   CollectiveTimeout; otherwise the call goes on with what it has);
5. stream the caller's gradient as peer "local", then every other member's
   under its real peer id, in join order, each as chunks of 65,536 elements
   read back from the store (hash-verified) and carrying a CRC32;
6. end with a ``SyncSummary`` (who, how many, timed out).

``min_peers=0`` is the original's behaviour: the caller's gradient alone, as
"local". Peers in other processes reach the same service over gRPC
(``gradcoll.sync.grpc_server``); the registry is thread-safe, so one
service may serve several event loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

from .. import kernels
from ..errors import CollectiveTimeout, NonFiniteError, ProtocolError, UsageError
from .accumulator import Aggregation
from .arrow import load_gradient_from_arrow
from .blockstore import BlockStore
from .manifest import CHUNK_ELEMENTS, write_gradient
from .messages import LOCAL_PEER, GradientChunkResponse, GradientSyncRequest, SyncResult, SyncStream, SyncSummary, new_peer_id
from .sessions import Member, SessionRegistry

__all__ = ["GradientSyncService"]

log = logging.getLogger(__name__)


class GradientSyncService:
    """Session registry plus block store: the meeting point of a session's peers.

    ``store`` holds every committed gradient (a FileBlockStore lets other
    processes read the blocks too). ``max_timeout_secs`` bounds what a
    request may ask for; ``send_timeout`` bounds each put on a caller's sink;
    sessions idle for ``session_ttl`` seconds are forgotten, and with
    ``delete_expired_blocks`` their blocks are deleted too (only safe when
    no one else uses the store).
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        chunk_elements: int = CHUNK_ELEMENTS,
        check_finite: bool = True,
        session_ttl: float = 3600.0,
        max_timeout_secs: float = 3600.0,
        send_timeout: float = 60.0,
        delete_expired_blocks: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise UsageError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        for name, value in (("session_ttl", session_ttl), ("max_timeout_secs", max_timeout_secs)):
            if not value > 0:
                raise UsageError(f"{name} must be > 0, got {value!r}")
        if not send_timeout > 0:
            raise UsageError(f"send_timeout must be > 0, got {send_timeout!r}")
        self.store = store
        self.chunk_elements = chunk_elements
        self.check_finite = check_finite
        self.max_timeout_secs = max_timeout_secs
        self.send_timeout = send_timeout
        self.delete_expired_blocks = delete_expired_blocks
        self._registry = SessionRegistry(session_ttl, clock)

    # ---- public API -------------------------------------------------------

    async def sync_gradients(self, request: GradientSyncRequest, sink: asyncio.Queue[GradientChunkResponse | None]) -> SyncSummary:
        """Stream the session's chunks onto ``sink`` (an asyncio.Queue), then ``None``; return the summary."""
        return await self.stream(request).pump(sink, self.send_timeout)

    def stream(self, request: GradientSyncRequest) -> SyncStream:
        """``async for chunk in service.stream(request)``; ``.summary`` is set at the end."""
        if not isinstance(request, GradientSyncRequest):
            raise UsageError(f"expected a GradientSyncRequest, got {type(request).__name__}")
        return SyncStream(self._run(request))

    async def collect(
        self,
        request: GradientSyncRequest,
        strategy: Aggregation | str | None = Aggregation.FEDAVG,
        *,
        weights: Mapping[str, float] | None = None,
    ) -> SyncResult:
        """Sync, reassemble every peer's gradient and aggregate them (FedAvg by default)."""
        return await self.stream(request).collect(strategy, weights=weights)

    def session_peers(self, session_id: str) -> tuple[str, ...]:
        """Peer ids that have joined ``session_id``, in join order."""
        return tuple(m.peer_id for m in self._registry.members(session_id))

    def close_session(self, session_id: str, *, delete_blocks: bool = False) -> bool:
        """Forget a session (calls still running on it finish normally); True if it existed."""
        members = self._registry.forget(session_id)
        if delete_blocks:
            self._delete_blocks(members)
        return bool(members)

    # ---- one call ---------------------------------------------------------

    async def _run(self, request: GradientSyncRequest) -> AsyncIterator[GradientChunkResponse | SyncSummary]:
        sid = request.session_id
        if request.timeout_secs > self.max_timeout_secs:
            raise UsageError(f"timeout_secs={request.timeout_secs} exceeds this service's {self.max_timeout_secs}")
        peer = request.peer_id or new_peer_id()
        try:
            values = await asyncio.to_thread(load_gradient_from_arrow, request.local_gradient)
        except ProtocolError as exc:
            raise UsageError(f"session {sid!r}: peer {peer!r}: failed to decode local gradient: {exc}") from exc
        if self.check_finite:
            try:
                kernels.check_finite(values)
            except NonFiniteError as exc:
                raise NonFiniteError(
                    f"session {sid!r}: peer {peer!r} sent non-finite value {exc.value!r} at element {exc.index}",
                    index=exc.index,
                    value=exc.value,
                ) from exc
        self._registry.check_join(sid, peer, values.size)
        n = int(values.size)
        cid, manifest, crcs = await asyncio.to_thread(
            write_gradient, self.store, values, chunk_elements=self.chunk_elements
        )
        del values  # a large gradient need not stay in memory while we wait
        me = Member(peer, cid, n, manifest.chunks, crcs)
        expired = self._registry.join(sid, me)
        if expired and self.delete_expired_blocks:
            await asyncio.to_thread(self._delete_blocks, expired)
        log.debug("session %r: peer %r committed %s", sid, peer, cid)

        others, timed_out = await self._registry.wait_for_peers(sid, peer, request.min_peers, request.timeout_secs)
        if timed_out and request.strict:
            raise CollectiveTimeout(
                f"session {sid!r}: peer {peer!r} got {len(others)} of {request.min_peers} peers "
                f"within {request.timeout_secs}s",
                op="sync_gradients",
            )
        for name, member in [(LOCAL_PEER, me)] + [(m.peer_id, m) for m in others]:
            total = len(member.chunks)
            for i, (chunk_cid, crc) in enumerate(zip(member.chunks, member.crcs, strict=True)):
                # get() verifies the SHA-256, so these are the committed bytes
                # and the CRC taken at commit still holds: computed once, not
                # once per receiver.
                data = await asyncio.to_thread(self.store.get, chunk_cid)
                yield GradientChunkResponse(sid, i, total, data, name, crc)
        yield SyncSummary(sid, peer, request.min_peers, tuple(m.peer_id for m in others), timed_out, n)

    def _delete_blocks(self, members: list[Member]) -> None:
        # Chunks are content-addressed, so two gradients can share one (a
        # block of zeros, a repeated gradient): keep what a live member uses.
        keep = self._registry.referenced_blocks()
        for m in members:
            for b in m.blocks:
                if b not in keep:
                    self.store.delete(b)

"""The sync service's value types and the receiver's side of a chunk stream.

Requests, chunks and summaries are frozen dataclasses shared by the
in-process service and the gRPC client, so both hand out the same objects.
``reassemble`` rebuilds one peer's gradient from its chunks, in any
order, refusing duplicates, gaps and checksum failures;
``SyncStream`` is the async iterator both front ends return, with the
stream's ``SyncSummary`` available once it is exhausted.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import zlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CollectiveTimeout, GradcollError, ProtocolError, UsageError
from .accumulator import Aggregation, aggregate_gradients
from .arrow import value_views

__all__ = [
    "LOCAL_PEER",
    "GradientSyncRequest",
    "GradientChunkResponse",
    "SyncSummary",
    "SyncResult",
    "SyncStream",
    "AuthenticationError",
    "reassemble",
    "reassemble_all",
    "new_peer_id",
]

#: The peer id under which a caller's own gradient is streamed back to it.
LOCAL_PEER = "local"

_MAX_ID = 256  # longest session or peer id, in characters
_U32 = 2**32 - 1


class AuthenticationError(GradcollError, PermissionError):
    """The sync server refused the call: missing or wrong token."""


def new_peer_id() -> str:
    """A fresh peer id: ``hostname-pid-random``."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _check_id(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_ID:
        raise UsageError(f"{what} must be a non-empty string of at most {_MAX_ID} characters, got {value!r:.80}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class GradientSyncRequest:
    """Join sync session ``session_id`` with ``local_gradient`` (Arrow IPC bytes).

    Waits for ``min_peers`` other peers or ``timeout_secs``; ``strict=True``
    turns a timeout into [`CollectiveTimeout`][gradcoll.errors.CollectiveTimeout].
    ``peer_id`` names the caller (generated when None; "local" is reserved).
    """

    session_id: str
    local_gradient: bytes = field(repr=False)
    min_peers: int = 0
    timeout_secs: float = 30.0
    peer_id: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        _check_id("session_id", self.session_id)
        if not isinstance(self.local_gradient, (bytes, bytearray, memoryview)):
            raise UsageError(f"local_gradient must be Arrow IPC bytes, got {type(self.local_gradient).__name__}")
        if not _is_int(self.min_peers) or not 0 <= self.min_peers <= _U32:
            raise UsageError(f"min_peers must be an int in [0, 2**32), got {self.min_peers!r}")
        t = self.timeout_secs
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise UsageError(f"timeout_secs must be a finite number >= 0, got {t!r}")
        if self.peer_id is not None:
            _check_id("peer_id", self.peer_id)
            if self.peer_id == LOCAL_PEER:
                raise UsageError(f"peer_id {LOCAL_PEER!r} is reserved for the caller's own gradient")
        if not isinstance(self.strict, bool):
            raise UsageError(f"strict must be a bool, got {self.strict!r}")


@dataclass(frozen=True)
class GradientChunkResponse:
    """One chunk of one peer's gradient: Arrow IPC bytes plus their CRC32.

    The first five fields are the original's, in its order; ``checksum``,
    gradcoll's addition, is computed over ``data`` when not given.
    """

    session_id: str
    chunk_index: int
    total_chunks: int
    data: bytes = field(repr=False)
    peer_id: str
    checksum: int = -1  # -1: not given (a CRC32 is never negative)

    def __post_init__(self) -> None:
        if self.checksum == -1:
            object.__setattr__(self, "checksum", zlib.crc32(self.data))

    @classmethod
    def build(
        cls, session_id: str, chunk_index: int, total_chunks: int, data: bytes, peer_id: str
    ) -> GradientChunkResponse:
        """A chunk with its checksum computed over ``data``."""
        return cls(session_id, chunk_index, total_chunks, data, peer_id, zlib.crc32(data))

    def verify(self) -> None:
        """Raise ProtocolError unless the CRC32 of ``data`` matches ``checksum``."""
        actual = zlib.crc32(self.data)
        if actual != self.checksum:
            raise ProtocolError(
                f"session {self.session_id!r}: peer {self.peer_id!r} chunk {self.chunk_index}/{self.total_chunks} "
                f"failed its checksum (CRC32 {actual:#010x}, expected {self.checksum:#010x})"
            )


@dataclass(frozen=True)
class SyncSummary:
    """How a sync call ended: the caller's id and the peers it got."""

    session_id: str
    peer_id: str
    min_peers: int
    peers: tuple[str, ...]
    timed_out: bool
    elements: int

    @property
    def peers_received(self) -> int:
        """Number of peers whose gradients were streamed (the caller not counted)."""
        return len(self.peers)


@dataclass(frozen=True, eq=False)
class SyncResult:
    """Every gradient of a finished sync call, reassembled, and their aggregate."""

    summary: SyncSummary
    local: np.ndarray = field(repr=False)
    peers: Mapping[str, np.ndarray] = field(repr=False)
    aggregate: np.ndarray | None = field(repr=False)


def reassemble(chunks: Iterable[GradientChunkResponse]) -> np.ndarray:
    """Rebuild one peer's gradient from its chunks in any order (checks CRCs, duplicates, gaps)."""
    chunks = list(chunks)
    if not chunks:
        raise UsageError("reassemble needs the chunks of one peer, got none")
    first = chunks[0]
    who = f"session {first.session_id!r}: peer {first.peer_id!r}"
    total = first.total_chunks
    if not _is_int(total) or total < 1:
        raise ProtocolError(f"{who} announced {total!r} chunks")
    by_index: dict[int, GradientChunkResponse] = {}
    for c in chunks:
        if c.peer_id != first.peer_id or c.session_id != first.session_id:
            raise UsageError(
                f"reassemble got chunks of several peers or sessions: {who} and "
                f"session {c.session_id!r}: peer {c.peer_id!r}; group them first (reassemble_all)"
            )
        if c.total_chunks != total:
            raise ProtocolError(f"{who} chunk {c.chunk_index} says {c.total_chunks} chunks, chunk 0.. says {total}")
        if not _is_int(c.chunk_index) or not 0 <= c.chunk_index < total:
            raise ProtocolError(f"{who} sent chunk index {c.chunk_index!r} outside 0..{total - 1}")
        if c.chunk_index in by_index:
            raise ProtocolError(f"{who} sent chunk {c.chunk_index}/{total} twice")
        c.verify()
        by_index[c.chunk_index] = c
    missing = [i for i in range(total) if i not in by_index]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise ProtocolError(f"{who} is missing {len(missing)} of {total} chunks: {shown}")
    # Decode to views of the chunks' bytes, then copy once into the result.
    views = [v for i in range(total) for v in value_views(by_index[i].data)]
    out = np.empty(sum(v.size for v in views), dtype=np.float32)
    pos = 0
    for v in views:
        out[pos : pos + v.size] = v
        pos += v.size
    return out


def reassemble_all(chunks: Iterable[GradientChunkResponse]) -> dict[str, np.ndarray]:
    """Group chunks by peer (first-seen order) and reassemble each peer's gradient."""
    groups: dict[str, list[GradientChunkResponse]] = {}
    for c in chunks:
        groups.setdefault(c.peer_id, []).append(c)
    return {peer: reassemble(cs) for peer, cs in groups.items()}


class SyncStream:
    """Async iterator over a sync call's chunks; ``summary`` is set once it is exhausted."""

    def __init__(self, source: AsyncIterator[GradientChunkResponse | SyncSummary]) -> None:
        self._source = source
        self.summary: SyncSummary | None = None

    def __aiter__(self) -> SyncStream:
        return self

    async def __anext__(self) -> GradientChunkResponse:
        if self.summary is not None:
            raise StopAsyncIteration
        try:
            item = await self._source.__anext__()
        except StopAsyncIteration:
            raise ProtocolError("the chunk stream ended without its summary") from None
        if isinstance(item, SyncSummary):
            self.summary = item
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop the stream early and release what it holds."""
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> SyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def pump(self, sink: asyncio.Queue[GradientChunkResponse | None], send_timeout: float) -> SyncSummary:
        """Put every chunk on ``sink``, then the ``None`` sentinel (also on error); return the summary."""
        finished = False
        try:
            async for chunk in self:
                await _put(sink, chunk, send_timeout)
            finished = True
        finally:
            await self.aclose()
            if finished:
                await _put(sink, None, send_timeout)
            else:
                _close_sink(sink)
        assert self.summary is not None  # a finished stream always has its summary
        return self.summary

    async def collect(
        self, strategy: Aggregation | str | None = Aggregation.FEDAVG, *, weights: Mapping[str, float] | None = None
    ) -> SyncResult:
        """Drain the stream, reassemble every peer and aggregate (``strategy=None``: skip)."""
        pending: dict[str, list[GradientChunkResponse]] = {}
        grads: dict[str, np.ndarray] = {}
        async for chunk in self:
            if chunk.peer_id in grads:
                raise ProtocolError(
                    f"session {chunk.session_id!r}: peer {chunk.peer_id!r} sent chunk {chunk.chunk_index} "
                    "after all its chunks had arrived"
                )
            group = pending.setdefault(chunk.peer_id, [])
            group.append(chunk)
            if len(group) == chunk.total_chunks:
                # Peers arrive one after another: assembling each as soon as
                # it is complete keeps one peer's chunks in memory, not all.
                grads[chunk.peer_id] = reassemble(pending.pop(chunk.peer_id))
        for group in pending.values():
            reassemble(group)  # raises, naming the missing chunks
        assert self.summary is not None
        local = grads.pop(LOCAL_PEER, None)
        if local is None:
            raise ProtocolError(f"session {self.summary.session_id!r}: the stream held no chunk of the caller")
        agg = None
        if strategy is not None:
            contributions = {self.summary.peer_id: local, **grads}
            agg = aggregate_gradients(contributions, strategy, weights=weights, session_id=self.summary.session_id)
        return SyncResult(self.summary, local, grads, agg)


async def _put(sink: asyncio.Queue[GradientChunkResponse | None], item: GradientChunkResponse | None, send_timeout: float) -> None:
    try:
        await asyncio.wait_for(sink.put(item), send_timeout)
    except asyncio.TimeoutError:
        what = "the end-of-stream sentinel" if item is None else f"chunk {item.chunk_index} of peer {item.peer_id!r}"
        raise CollectiveTimeout(f"the sink took nothing for {send_timeout}s ({what})", op="sync_gradients") from None


def _close_sink(sink: asyncio.Queue[GradientChunkResponse | None]) -> None:
    # After an error the sentinel must still reach the consumer, or it waits
    # forever; a full bounded queue drops its oldest chunk to make room (the
    # stream failed, so that chunk is worthless anyway).
    try:
        sink.put_nowait(None)
    except asyncio.QueueFull:
        sink.get_nowait()
        sink.put_nowait(None)

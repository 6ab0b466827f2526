"""Bytes of the sync RPC (sans-I/O): requests, chunks and summaries to and from bytes.

gRPC already delimits messages, so a message is just:

    4 bytes  magic  b"GCSQ" (request) | b"GCSR" (response)
    1 byte   kind   1 = request, 2 = chunk, 3 = summary
    4 bytes  header length H, u32 big-endian (at most 64 KiB)
    H bytes  header, UTF-8 JSON object
    rest     payload: the request's Arrow IPC gradient, a chunk's Arrow bytes

Header fields: request ``session_id, min_peers, timeout_secs, peer_id,
strict``; chunk ``session_id, chunk_index, total_chunks, peer_id,
checksum``; summary ``session_id, peer_id, min_peers, peers, timed_out,
elements``. Every decoder checks every field's type and range and raises
[`ProtocolError`][gradcoll.errors.ProtocolError] for anything malformed, never another
exception. No socket or grpc object in here.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ..errors import ProtocolError, UsageError
from .messages import GradientChunkResponse, GradientSyncRequest, SyncSummary

__all__ = ["encode_request", "decode_request", "encode_response", "decode_response", "MAX_HEADER"]

MAX_HEADER = 64 * 1024
_REQ, _RESP = b"GCSQ", b"GCSR"
_KIND_REQUEST, _KIND_CHUNK, _KIND_SUMMARY = 1, 2, 3
_PREFIX = struct.Struct(">4sBI")
_U32 = 2**32 - 1


def _encode(magic: bytes, kind: int, header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_PREFIX.pack(magic, kind, len(head)), head, payload))


def _decode(data: Any, magic: bytes) -> tuple[int, dict[str, Any], memoryview]:
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise ProtocolError(f"a sync message must be bytes, got {type(data).__name__}") from None
    if len(view) < _PREFIX.size:
        raise ProtocolError(f"truncated sync message: {len(view)} bytes, the prefix alone is {_PREFIX.size}")
    got, kind, hlen = _PREFIX.unpack_from(view)
    if got != magic:
        raise ProtocolError(f"bad sync message magic {got!r}, expected {magic!r}")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(view):
        raise ProtocolError(f"sync message header of {hlen} bytes does not fit the {len(view)}-byte message")
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"sync message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("sync message header is not a JSON object")
    return kind, header, view[_PREFIX.size + hlen :]


def _field(header: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    if name not in header:
        raise ProtocolError(f"{what} header lacks {name!r}")
    v = header[name]
    # JSON true/false decode to bool, a subclass of int: refuse them where an int is meant.
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise ProtocolError(f"{what} header field {name!r} has the wrong type: {v!r:.80}")
    return v


def _u32(header: dict[str, Any], name: str, what: str) -> int:
    v: int = _field(header, name, (int,), what)
    if not 0 <= v <= _U32:
        raise ProtocolError(f"{what} header field {name!r}={v} is outside [0, 2**32)")
    return v


def encode_request(req: GradientSyncRequest) -> bytes:
    """Request bytes: header plus the Arrow IPC gradient."""
    header = {
        "session_id": req.session_id,
        "min_peers": req.min_peers,
        "timeout_secs": req.timeout_secs,
        "peer_id": req.peer_id,
        "strict": req.strict,
    }
    return _encode(_REQ, _KIND_REQUEST, header, bytes(req.local_gradient))


def decode_request(data: Any) -> GradientSyncRequest:
    """Parse request bytes; ProtocolError on anything malformed."""
    kind, h, payload = _decode(data, _REQ)
    if kind != _KIND_REQUEST:
        raise ProtocolError(f"expected a sync request (kind 1), got kind {kind}")
    what = "request"
    try:
        return GradientSyncRequest(
            session_id=_field(h, "session_id", (str,), what),
            local_gradient=bytes(payload),
            min_peers=_u32(h, "min_peers", what),
            timeout_secs=_field(h, "timeout_secs", (int, float), what),
            peer_id=_field(h, "peer_id", (str, type(None)), what),
            strict=_field(h, "strict", (bool,), what),
        )
    except UsageError as exc:  # values of the right type but out of range
        raise ProtocolError(f"invalid sync request: {exc}") from None


def encode_response(item: GradientChunkResponse | SyncSummary) -> bytes:
    """Response bytes for a chunk or the closing summary."""
    if isinstance(item, GradientChunkResponse):
        header = {
            "session_id": item.session_id,
            "chunk_index": item.chunk_index,
            "total_chunks": item.total_chunks,
            "peer_id": item.peer_id,
            "checksum": item.checksum,
        }
        return _encode(_RESP, _KIND_CHUNK, header, item.data)
    header = {
        "session_id": item.session_id,
        "peer_id": item.peer_id,
        "min_peers": item.min_peers,
        "peers": list(item.peers),
        "timed_out": item.timed_out,
        "elements": item.elements,
    }
    return _encode(_RESP, _KIND_SUMMARY, header)


def decode_response(data: Any) -> GradientChunkResponse | SyncSummary:
    """Parse response bytes; ProtocolError on anything malformed (the CRC is checked by the caller)."""
    kind, h, payload = _decode(data, _RESP)
    if kind == _KIND_CHUNK:
        what = "chunk"
        total = _u32(h, "total_chunks", what)
        index = _u32(h, "chunk_index", what)
        if not index < total:
            raise ProtocolError(f"chunk {index} of {total} is out of range")
        return GradientChunkResponse(
            session_id=_field(h, "session_id", (str,), what),
            chunk_index=index,
            total_chunks=total,
            data=bytes(payload),
            peer_id=_field(h, "peer_id", (str,), what),
            checksum=_u32(h, "checksum", what),
        )
    if kind == _KIND_SUMMARY:
        what = "summary"
        peers = _field(h, "peers", (list,), what)
        if not all(isinstance(p, str) for p in peers):
            raise ProtocolError("summary header field 'peers' must list strings")
        if len(payload):
            raise ProtocolError(f"a summary carries no payload, got {len(payload)} bytes")
        return SyncSummary(
            session_id=_field(h, "session_id", (str,), what),
            peer_id=_field(h, "peer_id", (str,), what),
            min_peers=_u32(h, "min_peers", what),
            peers=tuple(peers),
            timed_out=_field(h, "timed_out", (bool,), what),
            elements=_field(h, "elements", (int,), what),
        )
    raise ProtocolError(f"unknown sync response kind {kind}")

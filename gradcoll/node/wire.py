"""Node messages on top of a group's transport: JSON documents, activations, error reports.

The transport delivers messages of an exact, pre-agreed length, but a
stage spec or an activation has a length only the sender knows. So every
node message is two transport messages: a 16-byte header, then the body:

    4s magic "GCND" | u8 kind | u8 dtype | u16 reserved | u64 body bytes   (little-endian)

``kind`` is JSON (UTF-8 object with a ``"type"`` field), ARRAY (a flat
activation, ``dtype`` 1/2/3 = float16/32/64) or ERROR (UTF-8 text: the
sender's stage failed). Node messages use tags of their own (0x3E00000x),
apart from every collective's. Bodies are bounded before anything is
allocated, JSON is only ever parsed as data, and nothing is unpickled.

Waiting for the header is the one place a serving loop idles. With a
``NodeControl`` it waits in slices of
``control.poll`` seconds and looks at the stop flag between them; the
transport cancels a receive that times out before any byte of it arrived
and keeps the link, and the 40 bytes of header frame go out in one segment,
so a slice never ends mid-message in practice.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.tags import NODE_BODY, NODE_HEADER
from ..errors import CollectiveTimeout, ProtocolError, TransportClosed
from ..group.process_group import ProcessGroup
from ..transport.base import Request
from .control import NodeControl
from .errors import RemoteStageError

__all__ = ["Message", "send_json", "send_array", "isend_array", "send_error", "recv_message", "recv_json",
           "JSON", "ARRAY", "ERROR", "MAX_JSON_BYTES", "MAX_ARRAY_BYTES"]

_HDR = struct.Struct("<4sBBHQ")
_MAGIC = b"GCND"
# Strict tags in the front ends' range of the tag registry: a node frame where a collective frame is due
# (or vice versa) drops the link.
HEADER_TAG, BODY_TAG = NODE_HEADER, NODE_BODY
JSON, ARRAY, ERROR = 1, 2, 3
_KINDS = {JSON: "json", ARRAY: "activation", ERROR: "error report"}
_CODES: dict[np.dtype[Any], int] = {np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
_DTYPES: dict[int, np.dtype[Any]] = {code: dt for dt, code in _CODES.items()}

#: Largest JSON document or error text accepted from a peer.
MAX_JSON_BYTES = 16 << 20
#: Largest activation accepted from a peer.
MAX_ARRAY_BYTES = 1 << 31


@dataclass(frozen=True)
class Message:
    """A received node message: ``kind`` JSON/ARRAY/ERROR and its decoded body."""

    kind: int
    body: Any


def _send(group: ProcessGroup, peer: int, kind: int, code: int, body: Any, timeout: float | None) -> None:
    t, limit = group.transport, group.timeout if timeout is None else timeout
    view = memoryview(body).cast("B")
    t.send(peer, _HDR.pack(_MAGIC, kind, code, 0, view.nbytes), HEADER_TAG, limit)
    t.send(peer, view, BODY_TAG, limit)


def send_json(group: ProcessGroup, peer: int, doc: dict[str, Any], timeout: float | None = None) -> None:
    """Send a JSON object (it must carry a ``"type"``) to ``peer``."""
    _send(group, peer, JSON, 0, json.dumps(doc, allow_nan=False).encode(), timeout)


def send_array(group: ProcessGroup, peer: int, x: np.ndarray, timeout: float | None = None) -> None:
    """Send a float activation (flattened) to ``peer``."""
    a = np.ascontiguousarray(x).reshape(-1)
    _send(group, peer, ARRAY, _code(a), a, timeout)


def isend_array(group: ProcessGroup, peer: int, x: np.ndarray) -> tuple[list[Request], np.ndarray]:
    """Start sending an activation; wait on the requests, keep the array alive until then."""
    a = np.ascontiguousarray(x).reshape(-1)
    t = group.transport
    hdr = _HDR.pack(_MAGIC, ARRAY, _code(a), 0, a.nbytes)
    return [t.isend(peer, hdr, HEADER_TAG), t.isend(peer, a, BODY_TAG)], a


def send_error(group: ProcessGroup, peer: int, text: str, timeout: float | None = None) -> None:
    """Tell ``peer`` that this rank's stage failed, with ``text`` as the reason."""
    _send(group, peer, ERROR, 0, text.encode()[:MAX_JSON_BYTES], timeout)


def _code(a: np.ndarray) -> int:
    code = _CODES.get(a.dtype)
    if code is None:
        raise ProtocolError(f"activations are float16/32/64, not {a.dtype}")
    return code


def recv_message(group: ProcessGroup, peer: int, *, control: NodeControl | None = None,
                 timeout: float | None = None) -> Message | None:
    """Receive one node message from ``peer``; None if ``control`` was stopped while waiting.

    Transport errors (closed, broken, timed out) propagate; a malformed
    header or body is a ProtocolError naming the peer.
    """
    t, limit = group.transport, group.timeout if timeout is None else timeout
    hdr = bytearray(_HDR.size)
    if control is None:
        t.recv(peer, hdr, HEADER_TAG, limit)
    else:
        while True:
            if control.stopped:
                return None
            try:
                t.recv(peer, hdr, HEADER_TAG, control.poll)
                break
            except CollectiveTimeout:
                continue  # idle: look at the stop flag again
    magic, kind, code, _, nbytes = _HDR.unpack(hdr)
    where = f"rank {group.rank}: message from peer {peer}"
    if magic != _MAGIC or kind not in _KINDS:
        raise ProtocolError(f"{where} is not a node message (magic {magic!r}, kind {kind})")
    if kind == ARRAY:
        dt = _DTYPES.get(code)
        if dt is None or nbytes % dt.itemsize or nbytes > MAX_ARRAY_BYTES:
            raise ProtocolError(f"{where}: bad activation header (dtype code {code}, {nbytes} bytes)")
        out = np.empty(nbytes // dt.itemsize, dt)
        _body(group, peer, out, limit)
        return Message(ARRAY, out)
    if nbytes > MAX_JSON_BYTES:
        raise ProtocolError(f"{where}: {_KINDS[kind]} of {nbytes} bytes exceeds {MAX_JSON_BYTES}")
    raw = bytearray(nbytes)
    _body(group, peer, raw, limit)
    if kind == ERROR:
        return Message(ERROR, raw.decode(errors="replace"))
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and huge ints
        raise ProtocolError(f"{where}: body is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str):
        raise ProtocolError(f"{where}: JSON message without a \"type\"")
    return Message(JSON, doc)


def _body(group: ProcessGroup, peer: int, out: Any, limit: float) -> None:
    try:
        group.transport.recv(peer, out, BODY_TAG, limit)
    except TransportClosed as exc:
        # A sender flushes both halves before it closes, so this is a torn message, not an orderly end.
        raise ProtocolError(f"rank {group.rank}: peer {peer} closed the link between a message header "
                            "and its body") from exc


def recv_json(group: ProcessGroup, peer: int, expect: str, *, control: NodeControl | None = None,
              timeout: float | None = None) -> dict[str, Any] | None:
    """Receive a JSON message of type ``expect`` from ``peer`` (None if stopped).

    An error report raises RemoteStageError; any other message a ProtocolError.
    """
    msg = recv_message(group, peer, control=control, timeout=timeout)
    if msg is None:
        return None
    if msg.kind == ERROR:
        raise RemoteStageError(f"rank {peer} reported: {msg.body}", rank=peer)
    if msg.kind != JSON or msg.body["type"] != expect:
        got = _KINDS[msg.kind] if msg.kind != JSON else f"a {msg.body['type']!r} message"
        raise ProtocolError(f"rank {group.rank}: expected a {expect!r} message from peer {peer}, got {got}")
    doc: dict[str, Any] = msg.body
    return doc

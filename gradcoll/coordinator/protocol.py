"""Coordinator protocol v1 as a sans-I/O codec: message objects to bytes and back, no sockets.

Byte-compatible with entrenar's gradient server (docs/wire.md). A frame is a u32
BIG-endian payload length, then the payload: a tag byte and the message's
fields, every one LITTLE-endian. A string is ``u32 length + UTF-8``, an f32
vector ``u64 count + count * f32``, component sizes ``u32 count + count * u32``.
Tags 0x01..0x0B are entrenar's; gradcoll's additions take new tags (0x80..)
and are only ever sent to a peer that announced them (see ``Extension``):

* ``Abort`` (0x80): the coordinator gave up; carries a code, the
  culprit worker, the step and the reason.
* ``AuthChallenge`` / ``AuthResponse`` (0x81 / 0x82): the HMAC
  join handshake when a shared secret is configured.
* ``Heartbeat`` keeps entrenar's tag 0x06, which entrenar defines but
  never sends; gradcoll peers actually send it.

``encode`` / ``encode_parts`` build frames (the latter without
copying the gradient). ``FrameDecoder`` takes bytes (``feed``) or lends
its buffer to the caller's ``recv_into`` (``get_buffer`` / ``buffer_updated``,
the shape of asyncio's BufferedProtocol) and returns complete messages. A
``sink`` lets the caller choose where a gradient vector lands, so the
coordinator receives each worker's gradient straight into its row of the
reduction buffer. Decoding errors are [`ProtocolError`][gradcoll.errors.ProtocolError]
with entrenar's texts ("empty payload", "unknown message tag: 0x..",
"truncated <field>", "invalid utf8", "message too large: N bytes"); bytes
after the last field of a message are ignored, as entrenar does. The
message classes live in ``gradcoll.coordinator.messages`` and are re-exported here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ProtocolError, UsageError
from .messages import (
    ABORT_AUTH,
    ABORT_DEAD,
    ABORT_ERROR,
    ABORT_MISMATCH,
    ABORT_NONFINITE,
    ABORT_PROTOCOL,
    ABORT_TIMEOUT,
    DEFAULT_MAX_FRAME,
    FLAG_SECRET,
    MESSAGE_TYPES,
    Abort,
    AuthChallenge,
    AuthResponse,
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    Extension,
    GradientPayload,
    Heartbeat,
    JoinAccepted,
    JoinRequest,
    Message,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
    as_f32_vector,
)

__all__ = [
    "encode", "encode_parts", "frame_size", "FrameDecoder", "Sink", "LENGTH",
    # re-exported from .messages, so the codec's users need one import
    "DEFAULT_MAX_FRAME", "Message", "Extension", "FLAG_SECRET", "MESSAGE_TYPES", "as_f32_vector",
    "JoinRequest", "JoinAccepted", "ShardAssignment", "GradientPayload", "AveragedGradient", "Heartbeat",
    "Shutdown", "BlockGradientPayload", "AveragedBlockGradient", "NonBlockGradientPayload",
    "AveragedNonBlockGradient", "Abort", "AuthChallenge", "AuthResponse",
    "ABORT_ERROR", "ABORT_NONFINITE", "ABORT_MISMATCH", "ABORT_TIMEOUT", "ABORT_DEAD", "ABORT_PROTOCOL",
    "ABORT_AUTH",
]

LENGTH = struct.Struct(">I")  # the only big-endian field: the frame length
_FIXED = {"u8": struct.Struct("<B"), "u32": struct.Struct("<I"), "u64": struct.Struct("<Q"),
          "f32": struct.Struct("<f"), "ou32": struct.Struct("<I"), "ou64": struct.Struct("<Q")}
_NONE = {"ou32": 2**32 - 1, "ou64": 2**64 - 1}  # "no value" of the optional integer fields
_PREFIX = {"str": _FIXED["u32"], "bytes": _FIXED["u32"], "sizes": _FIXED["u32"], "f32vec": _FIXED["u64"]}
_WIDTH = {"str": 1, "bytes": 1, "sizes": 4, "f32vec": 4}
_MIN_ROOM = 4096  # compact the staging buffer when less than this is free at its end


# -- encoding -------------------------------------------------------------------
def encode_parts(msg: Message, max_frame_bytes: int | None = DEFAULT_MAX_FRAME) -> list[Any]:
    """The frame of ``msg`` as buffers to send in order; gradient vectors are views, not copies.

    Raises [`UsageError`][gradcoll.errors.UsageError], before anything is built,
    when a field does not fit its wire type or the payload would exceed
    ``max_frame_bytes`` (the peer would refuse it).
    """
    parts: list[Any] = []
    head = bytearray((msg.TAG,))
    for name, kind in msg.FIELDS:
        v = getattr(msg, name)
        try:
            if kind in _FIXED:
                head += _FIXED[kind].pack(_NONE[kind] if v is None and kind in _NONE else v)
            elif kind == "str":
                b = v.encode("utf-8")
                head += _FIXED["u32"].pack(len(b)) + b
            elif kind == "bytes":
                head += _FIXED["u32"].pack(len(v)) + bytes(v)
            elif kind == "sizes":
                head += _FIXED["u32"].pack(len(v)) + struct.pack(f"<{len(v)}I", *v)
            elif kind == "f32vec":
                head += _FIXED["u64"].pack(v.size)
                parts.append(head)
                parts.append(memoryview(v.view(np.uint8)))
                head = bytearray()
            elif kind == "ext" and v is not None:
                head += v.to_bytes()
        except (struct.error, OverflowError, TypeError, AttributeError) as e:
            raise UsageError(f"{type(msg).__name__}.{name} = {v!r} does not fit the wire type {kind}: {e}") from None
    parts.append(head)
    size = sum(len(p) if isinstance(p, bytearray) else p.nbytes for p in parts)
    if max_frame_bytes is not None and size > max_frame_bytes:
        raise UsageError(f"{type(msg).__name__} payload of {size} bytes exceeds max_frame_bytes={max_frame_bytes}; "
                         "the peer would refuse it (raise max_frame_bytes on both sides)")
    parts[0][:0] = LENGTH.pack(size)
    return [p for p in parts if len(p)]


def encode(msg: Message, max_frame_bytes: int | None = DEFAULT_MAX_FRAME) -> bytes:
    """The whole frame of ``msg`` as one bytes object (length prefix included)."""
    return b"".join(encode_parts(msg, max_frame_bytes))


def frame_size(msg: Message) -> int:
    """Bytes on the wire for ``msg``, length prefix included."""
    return sum(len(p) if isinstance(p, bytearray) else p.nbytes for p in encode_parts(msg, None))


# -- decoding -------------------------------------------------------------------
#: ``sink(message class, fields decoded so far, element count)`` -> a float32 array to land the vector in, or None.
Sink = Callable[[type, dict[str, Any], int], "np.ndarray | None"]


class FrameDecoder:
    """Bytes in, messages out. One per connection; after a ProtocolError it stays failed.

    ``max_frame_bytes`` may be changed between frames (a coordinator keeps it
    small until a peer has joined). See the module docstring for ``sink``.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME, *, sink: Sink | None = None,
                 buffer_size: int = 64 * 1024) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.sink = sink
        self._buf = bytearray(max(buffer_size, 2 * _MIN_ROOM))
        self._r = self._w = 0  # unparsed bytes are _buf[_r:_w]
        self._left: int | None = None  # payload bytes left in the current frame; None between frames
        self._cls: type[Message] | None = None
        self._idx = 0
        self._vals: dict[str, Any] = {}
        self._body: memoryview | None = None  # destination of a variable-length field's bytes
        self._body_obj: Any = None
        self._body_off = 0
        self._direct = False  # the last get_buffer() lent the body itself
        self._error: ProtocolError | None = None

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has been received (a close now would cut a message)."""
        return self._left is not None or self._r < self._w

    def feed(self, data: Any) -> list[Message]:
        """Decode ``data`` (any bytes-like); returns the messages it completed."""
        mv, out = memoryview(data).cast("B"), []
        while len(mv):
            dst = self.get_buffer()
            k = min(len(dst), len(mv))
            dst[:k] = mv[:k]
            out += self.buffer_updated(k)
            mv = mv[k:]
        return out

    def get_buffer(self) -> memoryview:
        """A writable buffer for the next bytes (``recv_into`` it, then call ``buffer_updated``)."""
        if self._error is not None:
            raise self._error
        if self._body is not None and self._r == self._w:
            self._direct = True  # large payloads go straight to their destination, no staging copy
            return self._body[self._body_off :]
        self._direct = False
        if self._r == self._w:
            self._r = self._w = 0
        elif len(self._buf) - self._w < _MIN_ROOM:
            n = self._w - self._r
            self._buf[:n] = self._buf[self._r : self._w]
            self._r, self._w = 0, n
        return memoryview(self._buf)[self._w :]

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last ``get_buffer``; returns the messages completed."""
        if self._direct:
            self._body_off += nbytes
        else:
            self._w += nbytes
        return self._parse()

    # -- the state machine ----------------------------------------------------
    def _fail(self, text: str) -> None:
        self._error = ProtocolError(text)
        raise self._error

    def _take(self, n: int) -> int:
        at = self._r
        self._r += n
        self._left -= n  # type: ignore[operator]
        return at

    def _parse(self) -> list[Message]:
        out: list[Message] = []
        buf = self._buf
        while True:
            avail = self._w - self._r
            if self._body is not None:
                take = min(avail, len(self._body) - self._body_off)
                if take:
                    self._body[self._body_off : self._body_off + take] = buf[self._r : self._r + take]
                    self._r += take
                    self._body_off += take
                if self._body_off < len(self._body):
                    return out
                self._end_body()
            elif self._left is None:
                if avail < 4:
                    return out
                (n,) = LENGTH.unpack_from(buf, self._r)
                self._r += 4
                if n == 0:
                    self._fail("empty payload")
                if n > self.max_frame_bytes:
                    self._fail(f"message too large: {n} bytes")
                self._left, self._cls = n, None
            elif self._cls is None:
                if avail < 1:
                    return out
                tag = buf[self._take(1)]
                cls = MESSAGE_TYPES.get(tag)
                if cls is None:
                    self._fail(f"unknown message tag: 0x{tag:02x}")
                self._cls, self._idx, self._vals = cls, 0, {}
            elif self._idx == len(self._cls.FIELDS):
                self._take(min(avail, self._left))  # trailing bytes are ignored
                if self._left:
                    return out
                out.append(self._cls(**self._vals))
                self._left, self._cls, self._vals = None, None, {}
            elif not self._field(avail):
                return out

    def _field(self, avail: int) -> bool:
        """Decode (or start decoding) the next field; False when more bytes are needed."""
        name, kind = self._cls.FIELDS[self._idx]  # type: ignore[union-attr]
        left = self._left or 0
        if kind == "ext":  # everything left in the frame
            self._start_body(name, kind, bytearray(left))
            return True
        st = _FIXED.get(kind) or _PREFIX[kind]
        if st.size > left:
            self._fail(f"truncated {name}")
        if avail < st.size:
            return False
        (v,) = st.unpack_from(self._buf, self._take(st.size))
        if kind in _FIXED:
            self._vals[name] = None if _NONE.get(kind) == v else v
            self._idx += 1
            return True
        if v * _WIDTH[kind] > self._left:  # checked before allocating anything
            self._fail(f"truncated {name}")
        dest: Any
        if kind == "f32vec":
            dest = self._vector_destination(v)
        elif kind == "sizes":
            dest = np.empty(v, "<u4")
        else:
            dest = bytearray(v)
        self._start_body(name, kind, dest)
        return True

    def _vector_destination(self, count: int) -> np.ndarray:
        assert self._cls is not None
        dest = self.sink(self._cls, self._vals, count) if self.sink is not None else None
        if dest is None:
            return np.empty(count, "<f4")
        if (not isinstance(dest, np.ndarray) or dest.dtype != np.dtype("<f4") or dest.shape != (count,)
                or not dest.flags.c_contiguous or not dest.flags.writeable):
            raise UsageError(f"sink must return a writable contiguous float32 array of {count} elements")
        return dest

    def _start_body(self, name: str, kind: str, dest: Any) -> None:
        self._body_obj = (name, kind, dest)
        raw: Any = dest.view(np.uint8) if isinstance(dest, np.ndarray) else dest
        self._body = memoryview(raw)
        self._body_off = 0
        self._left -= self._body.nbytes  # type: ignore[operator]

    def _end_body(self) -> None:
        name, kind, dest = self._body_obj
        self._body, self._body_obj = None, None
        if kind == "str":
            try:
                dest = dest.decode("utf-8")
            except UnicodeDecodeError:
                self._fail("invalid utf8")
        elif kind == "bytes":
            dest = bytes(dest)
        elif kind == "sizes":
            dest = tuple(dest.tolist())
        elif kind == "ext":
            dest = Extension.parse(bytes(dest))
        self._vals[name] = dest
        self._idx += 1

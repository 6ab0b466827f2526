"""The transport frame codec: headers, handshake records, tag ranges and what a receive makes of a frame.

Sans-I/O: these functions take and return bytes, headers and verdicts and
never touch a socket, a segment, a thread or a clock, so they are tested and
fuzzed on their own (like h11's). The transports (``tcp``, ``shm`` through
``gradcoll.transport._engine``; ``inproc`` and the simulated network for
their matching) do the I/O around them. Byte layouts: ``docs/wire.md``.

Byte-stream transports put a 24-byte header before every payload so a
receiver can check, before trusting the bytes, that it gets exactly the
message it expects:

    u8 kind | 3 pad | u32 tag | u64 seq | u64 length      (little-endian)

``kind`` is ``DATA`` for a message, ``CLOSE`` for an orderly close or
``ABORT`` when the sender dropped the link after an error (its ``tag``
holds an ``ABORT_*`` reason code); nothing follows CLOSE or ABORT. ``seq``
counts messages per ordered pair from 0. The TCP handshake is a 32-byte
``HELLO`` record.

A receive finds exactly the tag and length it expects, or the link is
dropped with an ABORT, except between *lenient* tags (``>= LENIENT_TAG``,
the collectives' own): there the unexpected frame is read in whole, the
receive fails with ``FrameMismatch`` carrying it, and the link stays in
step. That is how a collective learns of another rank's different call or
alarm without losing the link it needs to agree on the error.
[`classify`][gradcoll.transport.frame.classify] says which case a header
is.

There is no incremental parser that buffers a stream: the transports read a
header straight into its 24 bytes and the payload straight into the caller's
buffer (no staging copy), so the codec decodes in place
(``unpack_header(buf, offset)``) instead.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import CollectiveMismatch, ProtocolError, UsageError

__all__ = [
    "DATA", "CLOSE", "ABORT", "ABORT_ERROR", "ABORT_MISMATCH", "ABORT_TIMEOUT", "ABORT_PROTOCOL", "ABORT_REASONS",
    "HEADER", "HEADER_SIZE", "MAX_TAG", "LENIENT_TAG", "Header", "pack_header", "unpack_header", "check_tag",
    "abort_reason", "EXPECTED", "STRAY", "CLOSED", "ABORTED", "MISMATCH", "classify", "mismatch_error",
    "check_header", "FrameMismatch", "lenient_mismatch", "HELLO", "ACK", "HELLO_AUTH", "ACK_AUTH", "HELLO_SIZE", "MAGIC", "VERSION",
    "Hello", "pack_hello", "unpack_hello",
]

DATA = 1
CLOSE = 2
ABORT = 3

ABORT_ERROR = 0
ABORT_MISMATCH = 1
ABORT_TIMEOUT = 2
ABORT_PROTOCOL = 3
#: ABORT reason code -> the words a receiver's error uses ("dropped the link after <reason> on its side").
ABORT_REASONS = {
    ABORT_ERROR: "an error",
    ABORT_MISMATCH: "a collective mismatch",
    ABORT_TIMEOUT: "a timeout",
    ABORT_PROTOCOL: "a protocol error",
}

#: Message header: kind, tag, seq, payload length.
HEADER = struct.Struct("<B3xIQQ")
HEADER_SIZE = HEADER.size  # 24

#: Largest user tag; fits an MPI tag on every implementation we know of.
MAX_TAG = 2**31 - 2

#: Tags from here up are *lenient*: when a receive posted with a lenient tag meets
#: a frame with another lenient tag or length, the frame is consumed and the
#: receive fails with ``FrameMismatch`` carrying it; the link stays usable.
#: Collectives use these so a mismatch or an alarm never costs the link.
LENIENT_TAG = 1 << 30

MAGIC = b"GCTP"
VERSION = 1
HELLO = 1
ACK = 2
#: The same, from a rank that holds the group's secret: a mutual HMAC proof follows (gradcoll.transport.tcp_connect).
HELLO_AUTH = 3
ACK_AUTH = 4
#: Handshake record: magic, version, kind, rank, world size, 16-byte group token.
HELLO_STRUCT = struct.Struct("<4sHHII16s")
HELLO_SIZE = HELLO_STRUCT.size  # 32


class Header(NamedTuple):
    """A decoded message header."""

    kind: int
    tag: int
    seq: int
    length: int


class Hello(NamedTuple):
    """A decoded handshake record."""

    kind: int
    rank: int
    size: int
    token: bytes


def check_tag(tag: int) -> int:
    """Return ``tag`` if it is a valid user tag, else raise UsageError."""
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise UsageError(f"tag must be an int in [0, {MAX_TAG}], got {tag!r}")
    return tag


def pack_header(seq: int, tag: int, length: int, kind: int = DATA) -> bytes:
    """Encode a message header (24 bytes)."""
    return HEADER.pack(kind, tag, seq, length)


def unpack_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> Header:
    """Decode the header at ``buf[offset:offset + 24]``; an unknown kind is a ProtocolError."""
    kind, tag, seq, length = HEADER.unpack_from(buf, offset)
    if kind not in (DATA, CLOSE, ABORT):
        raise ProtocolError(f"unknown frame kind {kind} (seq {seq}, tag {tag}, {length} bytes)")
    return Header(kind, tag, seq, length)


def abort_reason(code: int) -> str:
    """The words for an ABORT reason code (an unknown code reads as "an error")."""
    return ABORT_REASONS.get(code, ABORT_REASONS[ABORT_ERROR])


# -- what a receive makes of a header -----------------------------------------------
#: ``classify`` verdicts.
EXPECTED = "expected"  # the DATA frame the receive waits for: read its payload
STRAY = "stray"  # another lenient frame met by a lenient receive: read it whole, fail with FrameMismatch
CLOSED = "closed"  # the peer closed the link in order: TransportClosed
ABORTED = "aborted"  # the peer dropped the link; ``tag`` is the reason: TransportBroken
MISMATCH = "mismatch"  # anything else: CollectiveMismatch, and the stream is out of step


def classify(got: Header, *, seq: int, tag: int, length: int) -> str:
    """What a receive expecting DATA (``seq``, ``tag``, ``length``) does with the frame ``got``.

    One of ``EXPECTED``, ``STRAY``, ``CLOSED``, ``ABORTED``, ``MISMATCH``.
    A frame is ``STRAY`` only when it is in sequence and both its tag and the
    expected one are lenient (``>= LENIENT_TAG``).
    """
    if got.kind == CLOSE:
        return CLOSED
    if got.kind == ABORT:
        return ABORTED
    if got.seq == seq and got.tag == tag and got.length == length:
        return EXPECTED
    if got.seq == seq and got.tag >= LENIENT_TAG and tag >= LENIENT_TAG:
        return STRAY
    return MISMATCH


def mismatch_error(got: Header, *, seq: int, tag: int, length: int, rank: int, peer: int,
                   transport: str) -> CollectiveMismatch:
    """The ``CollectiveMismatch`` of a receive (``seq``, ``tag``, ``length``) that met ``got``, naming both sides."""
    return CollectiveMismatch(
        f"rank {rank}: recv from peer {peer} expected seq {seq} tag {tag} ({length} bytes), "
        f"but peer {peer} sent seq {got.seq} tag {got.tag} ({got.length} bytes) "
        f"({transport} transport; the ranks are running different collectives)"
    )


def check_header(
    got: Header, *, seq: int, tag: int, length: int, rank: int, peer: int, transport: str
) -> None:
    """Raise CollectiveMismatch unless ``got`` is the DATA message (seq, tag, length) we expect."""
    if got.kind == DATA and got.seq == seq and got.tag == tag and got.length == length:
        return
    raise mismatch_error(got, seq=seq, tag=tag, length=length, rank=rank, peer=peer, transport=transport)


class FrameMismatch(CollectiveMismatch):
    """A lenient receive met another frame: it was consumed, the link is intact.

    ``peer``, ``tag`` and ``payload`` describe the frame that arrived instead.
    """

    def __init__(self, message: str, *, peer: int, tag: int, payload: bytes) -> None:
        super().__init__(message)
        self.peer, self.tag, self.payload = peer, tag, payload


def lenient_mismatch(rank: int, peer: int, seq: int, tag: int, length: int, got_tag: int, payload: bytes,
                     transport: str) -> FrameMismatch:
    """The FrameMismatch for a lenient receive (``tag``, ``length``) that got ``got_tag``/``payload``."""
    return FrameMismatch(
        f"rank {rank}: recv from peer {peer} expected seq {seq} tag {tag} ({length} bytes), but peer {peer} "
        f"sent seq {seq} tag {got_tag} ({len(payload)} bytes) ({transport} transport; the ranks are running "
        "different collectives)",
        peer=peer, tag=got_tag, payload=payload,
    )


# -- the TCP handshake record -------------------------------------------------------
def pack_hello(kind: int, rank: int, size: int, token: bytes) -> bytes:
    """Encode a handshake record (``token`` is 16 bytes identifying the group)."""
    if len(token) != 16:
        raise UsageError("handshake token must be 16 bytes")
    return HELLO_STRUCT.pack(MAGIC, VERSION, kind, rank, size, token)


def unpack_hello(buf: bytes | bytearray | memoryview) -> Hello:
    """Decode a handshake record; a stranger or another version is a ProtocolError."""
    if len(buf) != HELLO_SIZE:
        raise ProtocolError(f"handshake of {len(buf)} bytes, expected {HELLO_SIZE}")
    magic, version, kind, rank, size, token = HELLO_STRUCT.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"not a gradcoll peer (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"peer speaks transport protocol v{version}, we speak v{VERSION}")
    if kind not in (HELLO, ACK, HELLO_AUTH, ACK_AUTH):
        raise ProtocolError(f"unknown handshake kind {kind}")
    return Hello(kind, rank, size, token)

"""The sync RPC's bytes: round trips and defensive parsing (sans-I/O, no network)."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("pyarrow")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradcoll.errors import ProtocolError  # noqa: E402
from gradcoll.sync import GradientChunkResponse, GradientSyncRequest, SyncSummary  # noqa: E402
from gradcoll.sync.wire import decode_request, decode_response, encode_request, encode_response  # noqa: E402


def test_request_round_trip():
    req = GradientSyncRequest("round-7", b"\x00ARROW-ish\xff", 3, 2.5, peer_id="host-1-ab", strict=True)
    assert decode_request(encode_request(req)) == req
    plain = GradientSyncRequest("r", b"", 0, 30)
    assert decode_request(encode_request(plain)) == plain


def test_chunk_and_summary_round_trip():
    chunk = GradientChunkResponse.build("s", 1, 3, b"payload", "peer-a")
    assert decode_response(encode_response(chunk)) == chunk
    summary = SyncSummary("s", "me", 2, ("a", "b"), True, 10)
    assert decode_response(encode_response(summary)) == summary


def _msg(magic: bytes, kind: int, header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">4sBI", magic, kind, len(header)) + header + payload


def _req_header(override: str) -> bytes:
    """A request whose header is valid except for the one field in ``override``."""
    fields = {"session_id": '"s"', "min_peers": "0", "timeout_secs": "1", "peer_id": "null", "strict": "false"}
    name, value = override.split(": ", 1)
    fields[name.strip('"')] = value
    return _msg(b"GCSQ", 1, ("{" + ",".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode())


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"GCSQ",
        _msg(b"XXXX", 1, b"{}"),
        _msg(b"GCSQ", 2, b"{}"),
        struct.pack(">4sBI", b"GCSQ", 1, 1 << 30) + b"{}",
        _msg(b"GCSQ", 1, b"\xff\xfe"),
        _msg(b"GCSQ", 1, b"[1, 2]"),
        _msg(b"GCSQ", 1, b'{"session_id": "s"}'),
        _req_header('"min_peers": true'),
        _req_header('"min_peers": -1'),
        _req_header('"timeout_secs": NaN'),
        _req_header('"session_id": ""'),
        _req_header('"peer_id": "local"'),
        _req_header('"strict": 0'),
        _msg(b"GCSQ", 1, b"[" * 100_000),
    ],
)
def test_malformed_requests_raise_protocol_error(raw):
    with pytest.raises(ProtocolError):
        decode_request(raw)


@pytest.mark.parametrize(
    "header",
    [
        b'{"session_id": "s", "chunk_index": 3, "total_chunks": 3, "peer_id": "p", "checksum": 0}',
        b'{"session_id": "s", "chunk_index": 0, "total_chunks": 1, "peer_id": 5, "checksum": 0}',
        b'{"session_id": "s", "chunk_index": 0, "total_chunks": 1, "peer_id": "p", "checksum": 4294967296}',
    ],
)
def test_malformed_chunks_raise_protocol_error(header):
    with pytest.raises(ProtocolError):
        decode_response(_msg(b"GCSR", 2, header))


def test_unknown_kind_and_summary_with_payload():
    with pytest.raises(ProtocolError, match="unknown"):
        decode_response(_msg(b"GCSR", 9, b"{}"))
    head = b'{"session_id":"s","peer_id":"p","min_peers":0,"peers":[],"timed_out":false,"elements":0}'
    with pytest.raises(ProtocolError, match="payload"):
        decode_response(_msg(b"GCSR", 3, head, b"x"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash(raw):
    for decode, magic in ((decode_request, b"GCSQ"), (decode_response, b"GCSR")):
        for data in (raw, magic + raw):
            try:
                decode(data)
            except ProtocolError:
                pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255))
def test_flipping_any_byte_of_a_chunk_is_caught(pos, mask):
    chunk = GradientChunkResponse.build("s", 0, 1, bytes(range(200)), "p")
    raw = bytearray(encode_response(chunk))
    i = len(raw) - 200 + pos % 200
    raw[i] ^= mask or 1
    try:
        decoded = decode_response(bytes(raw))
    except ProtocolError:
        return
    with pytest.raises(ProtocolError, match="checksum"):
        decoded.verify()

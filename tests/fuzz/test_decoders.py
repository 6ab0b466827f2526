"""Every decoder that reads a peer's bytes, fuzzed: a correct decode or the documented error, nothing else.

Inputs are random bytes and mutations of valid messages (flipped bytes,
truncations, extensions). The only acceptable outcomes are a successful decode
or ``gradcoll.ProtocolError`` (the remote-fault class); any other exception,
a hang (pytest-timeout) or runaway memory is a failure.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.errors import CollectiveMismatch, ProtocolError
from gradcoll.transport import frame as fr

pytestmark = pytest.mark.timeout(900)
FUZZ = settings.get_profile("gradcoll-fuzz")


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and valid bytes with flips, cuts and junk appended."""

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        b = bytearray(valid)
        for _ in range(draw(st.integers(0, 4))):
            if b:
                i = draw(st.integers(0, len(b) - 1))
                b[i] = draw(st.integers(0, 255))
        cut = draw(st.integers(0, len(b)))
        tail = draw(st.binary(max_size=16))
        return bytes(b[:cut]) + (tail if draw(st.booleans()) else b"")

    return st.one_of(st.binary(max_size=256), mutate())


# -- transport frames ---------------------------------------------------------------
@FUZZ
@given(st.binary(min_size=fr.HEADER.size, max_size=fr.HEADER.size))
def test_transport_header(data: bytes) -> None:
    try:
        h = fr.unpack_header(data)
    except ProtocolError:
        return
    assert h.kind in (fr.DATA, fr.CLOSE, fr.ABORT)
    packed = fr.pack_header(h.seq, h.tag, h.length, h.kind)
    assert packed[:1] + packed[4:] == data[:1] + data[4:]  # bytes 1-3 are padding


_TAGS = st.sampled_from([0, 7, fr.LENIENT_TAG - 1, fr.LENIENT_TAG, fr.LENIENT_TAG + 1, fr.MAX_TAG])


_HEADERS = st.one_of(
    st.binary(min_size=fr.HEADER.size, max_size=fr.HEADER.size),
    st.builds(fr.pack_header, st.integers(0, 3), _TAGS, st.integers(0, 3), st.integers(0, 4)),  # near misses
)


@FUZZ
@given(_HEADERS, st.integers(0, 3), _TAGS, st.integers(0, 3))
def test_what_a_receive_makes_of_any_header(data: bytes, seq: int, tag: int, length: int) -> None:
    """``classify`` of every decodable header: one verdict, the one the frame's kind, sequence and tags call for."""
    try:
        got = fr.unpack_header(data)
    except ProtocolError:
        return
    verdict = fr.classify(got, seq=seq, tag=tag, length=length)
    try:
        fr.check_header(got, seq=seq, tag=tag, length=length, rank=0, peer=1, transport="fuzz")
        matches = True
    except CollectiveMismatch as exc:
        matches = False
        assert f"expected seq {seq} tag {tag} ({length} bytes)" in str(exc)
    assert (verdict == fr.EXPECTED) == matches
    if got.kind != fr.DATA:
        assert verdict == (fr.CLOSED if got.kind == fr.CLOSE else fr.ABORTED)
    elif verdict == fr.STRAY:
        assert got.seq == seq and min(got.tag, tag) >= fr.LENIENT_TAG and (got.tag, got.length) != (tag, length)
    elif not matches:
        assert verdict == fr.MISMATCH


@FUZZ
@given(mutations(fr.pack_hello(fr.HELLO, 3, 8, b"0123456789abcdef")))
def test_transport_handshake(data: bytes) -> None:
    try:
        h = fr.unpack_hello(data)
    except ProtocolError:
        return
    assert fr.pack_hello(h.kind, h.rank, h.size, h.token) == data


# -- gradient sync messages and Arrow data ---------------------------------------------
def _sync_valid() -> tuple[bytes, bytes]:
    from gradcoll.sync import GradientChunkResponse, GradientSyncRequest, store_gradient_as_arrow
    from gradcoll.sync.wire import encode_request, encode_response

    arrow = store_gradient_as_arrow(np.arange(5, dtype=np.float32))
    req = encode_request(GradientSyncRequest("s", arrow, 1, 5))
    resp = encode_response(GradientChunkResponse("s", 0, 1, arrow, "peer-a", 123))
    return req, resp


@pytest.fixture(scope="module")
def sync_valid() -> tuple[bytes, bytes]:
    pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install 'gradcoll[arrow]'")
    return _sync_valid()


def test_sync_messages(sync_valid: tuple[bytes, bytes]) -> None:
    from gradcoll.sync.wire import decode_request, decode_response

    req, resp = sync_valid

    @FUZZ
    @given(mutations(req), mutations(resp))
    def run(a: bytes, b: bytes) -> None:
        for fn, data in ((decode_request, a), (decode_response, b)):
            try:
                fn(data)
            except ProtocolError:
                pass

    run()


def test_arrow_gradients() -> None:
    pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install 'gradcoll[arrow]'")
    from gradcoll.sync import load_gradient_from_arrow, store_gradient_as_arrow

    valid = store_gradient_as_arrow(np.linspace(-1, 1, 7, dtype=np.float32))

    @FUZZ
    @given(mutations(valid))
    def run(data: bytes) -> None:
        try:
            out = load_gradient_from_arrow(data)
        except ProtocolError:
            return
        assert out.dtype == np.float32

    run()


# -- rendezvous store requests ---------------------------------------------------------
def test_store_requests() -> None:
    from gradcoll.store import _server

    kv = _server.KeyValue()  # the request handler alone, no sockets
    kv.data, kv.closing = {"k": b"1"}, True  # closing: a GET never waits

    valid = bytes([_server.SET]) + _server.blob(b"key") + _server.blob(b"value")

    @FUZZ
    @given(mutations(valid))
    def run(payload: bytes) -> None:
        try:
            reply = kv.handle(payload)
        except ProtocolError:
            return
        assert isinstance(reply, bytes) and reply
        assert len(kv.data) < 10_000

    run()


# -- store values a rank parses (written by peers, or by anyone who reaches an open store) -------
def test_store_values() -> None:
    import socket

    from gradcoll.group._claims import Claim, parse_join
    from gradcoll.observe.control import _address as control_address
    from gradcoll.transport import shm_segment
    from gradcoll.transport.tcp_connect import _address as tcp_address

    host = socket.gethostname()
    parsers = [
        (lambda b: tcp_address(b, "tcp/0"), b"127.0.0.1 5001 " + b"ab" * 16),
        (lambda b: control_address(b, 0), b"127.0.0.1 5001"),
        (lambda b: shm_segment._name(b, "shm/0-1", 1, 0), f"{host} gcshm-12-abcdefabcdef-0-1".encode()),
        (lambda b: parse_join(b, 1), b"4\nargument"),
        (lambda b: Claim.decode(b, "claims/1/1"), Claim("h", "pid:[1]", 12, "345", "ab" * 8).encode()),
    ]
    for parse, valid in parsers:
        assert parse(valid)  # the valid value decodes

        @FUZZ
        @given(mutations(valid))
        def run(raw: bytes) -> None:
            try:
                parse(raw)
            except ProtocolError:
                pass

        run()

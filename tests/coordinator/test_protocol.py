"""Coordinator protocol v1, bytes only: hand-written frames from docs/wire.md, decoding errors, the frame cap.

No sockets here: the codec is sans-I/O, so every test pushes bytes into a
FrameDecoder (often one byte at a time) and compares what comes out.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.coordinator.protocol import (
    ABORT_NONFINITE,
    FLAG_SECRET,
    Abort,
    AuthChallenge,
    AuthResponse,
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    Extension,
    FrameDecoder,
    GradientPayload,
    Heartbeat,
    JoinAccepted,
    JoinRequest,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
    encode,
    encode_parts,
    frame_size,
)
from gradcoll.errors import ProtocolError, UsageError


def h(text: str) -> bytes:
    """Hex with spaces and comments (``# ...`` to the end of a line) -> bytes."""
    return bytes.fromhex("".join(line.split("#")[0] for line in text.splitlines()))


# Little-endian f32 constants, written out by hand.
F1, F2, F3, F1_5, F2_5, FM1, F0_5 = "0000803f", "00000040", "00004040", "0000c03f", "00002040", "000080bf", "0000003f"
NAN, NEG0, INF, NINF = "0000c07f", "00000080", "0000807f", "000080ff"

# (message, its frame as written by hand from the table in docs/wire.md)
FRAMES = [
    (JoinRequest("n1", 2, "cpu"), h("""
        00000012            # length 18, BIG-endian
        01                  # JoinRequest
        02000000 6e31       # node_id "n1"
        02000000            # gpu_count 2
        03000000 637075     # backend "cpu"
    """)),
    (JoinAccepted(1, 3), h("00000009 02 01000000 03000000")),
    (ShardAssignment(7, 50, 100), h("00000019 03 0700000000000000 3200000000000000 6400000000000000")),
    (GradientPayload(3, 1, [1.0, float("nan"), -0.0, float("inf")], 0.5, 7, 9), h(f"""
        00000039                                # 57 = 1+8+4+8+4*4+4+8+8
        04 0300000000000000 01000000            # tag, step 3, worker 1
        0400000000000000 {F1} {NAN} {NEG0} {INF} # 4 gradients
        {F0_5} 0700000000000000 0900000000000000 # loss 0.5, correct 7, total 9
    """)),
    (AveragedGradient(3, [1.5, 2.5], 2.0), h(f"0000001d 05 0300000000000000 0200000000000000 {F1_5} {F2_5} {F2}")),
    (Heartbeat("n1", 1000), h("0000000f 06 02000000 6e31 e803000000000000")),
    (Shutdown(), h("00000001 07")),
    (BlockGradientPayload(2, 0, 5, 8, [1, 2], [1.0, 2.0, 3.0]), h(f"""
        00000035 08 0200000000000000 00000000 05000000 08000000  # step 2, worker 0, block 5 of 8
        02000000 01000000 02000000                               # component sizes [1, 2]
        0300000000000000 {F1} {F2} {F3}
    """)),
    (AveragedBlockGradient(2, 5, [1, 2], [1.0, 2.0, 3.0]),
     h(f"0000002d 09 0200000000000000 05000000 02000000 01000000 02000000 0300000000000000 {F1} {F2} {F3}")),
    (NonBlockGradientPayload(4, 1, 2, [-1.0]), h(f"0000001a 0a 0400000000000000 01000000 02 0100000000000000 {FM1}")),
    (AveragedNonBlockGradient(4, 2, [-1.0]), h(f"00000016 0b 0400000000000000 02 0100000000000000 {FM1}")),
    # gradcoll's additions, on new tags
    (Abort(ABORT_NONFINITE, None, 5, "x"), h("00000013 80 01 ffffffff 0500000000000000 01000000 78")),
    (AuthChallenge(b"\x01\x02", b"\x03"), h("0000000c 81 02000000 0102 01000000 03")),
    (AuthResponse(b""), h("00000005 82 00000000")),
]


@pytest.mark.parametrize("msg,frame", FRAMES, ids=[type(m).__name__ for m, _ in FRAMES])
def test_hand_written_frames(msg, frame):
    assert encode(msg) == frame
    assert FrameDecoder().feed(frame) == [msg]
    assert frame_size(msg) == len(frame)


def test_every_frame_split_at_every_byte():
    stream = b"".join(f for _, f in FRAMES)
    d, out = FrameDecoder(), []
    for i in range(len(stream)):
        out += d.feed(stream[i : i + 1])
    assert out == [m for m, _ in FRAMES]
    assert not d.in_frame


@pytest.mark.parametrize("n", [0, 1, 2, 1000])
def test_gradient_payload_frame_size(n):
    msg = GradientPayload(1, 0, np.ones(n, np.float32), 0.0, 0, 0)
    assert len(encode(msg)) == 4 + 1 + 8 + 4 + 8 + 4 * n + 4 + 8 + 8


def test_special_floats_round_trip_bit_for_bit():
    bits = np.array([0x7FC00000, 0x7F800001, 0xFFC00123, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001],
                    dtype="<u4")
    grads = bits.view("<f4")
    for loss in (float("nan"), float("inf"), float("-inf"), -0.0):
        msg = GradientPayload(9, 2, grads, loss, 1, 2)
        (back,) = FrameDecoder().feed(encode(msg))
        assert back.gradients.view("<u4").tolist() == bits.tolist()
        assert struct.pack("<f", back.loss) == struct.pack("<f", loss)
        assert back == msg
    assert GradientPayload(0, 0, [-0.0], 0, 0, 0) != GradientPayload(0, 0, [0.0], 0, 0, 0)
    (neg,) = FrameDecoder().feed(h(f"00000016 0b 0000000000000000 00 0100000000000000 {NINF}"))
    assert neg.gradients[0] == -np.inf


@pytest.mark.parametrize("frame,error", [
    (h("00000000"), "empty payload"),
    (h("00000001 0c"), "unknown message tag: 0x0c"),
    (h("00000001 ff"), "unknown message tag: 0xff"),
    (h("0000000d 03 0700000000000000 32000000"), "truncated shard_start"),
    (h("00000015 04 0100000000000000 00000000 6400000000000000"), "truncated gradients"),
    (h("00000007 01 04000000 6e31"), "truncated node_id"),
    (h("00000011 01 02000000 fffe 01000000 00000000"), "invalid utf8"),
    (h("05f5e101 07"), "message too large: 100000001 bytes"),
])
def test_decoding_errors_use_entrenars_texts(frame, error):
    d = FrameDecoder()
    with pytest.raises(ProtocolError, match=error):
        d.feed(frame)
    with pytest.raises(ProtocolError, match=error):  # a failed decoder stays failed
        d.feed(b"\x00")


def test_the_cap_is_checked_before_reading_the_payload():
    d = FrameDecoder(max_frame_bytes=100)
    assert d.feed(encode(AveragedGradient(0, np.zeros(18, np.float32), 0.0))) != []  # 93 bytes: fine
    with pytest.raises(ProtocolError, match="message too large: 101 bytes"):
        d.feed(h("00000065"))  # just the length prefix


def test_trailing_bytes_are_ignored():
    stream = h("0000000c 02 01000000 03000000 abcdef") + encode(Shutdown())
    assert FrameDecoder().feed(stream) == [JoinAccepted(1, 3), Shutdown()]


def test_the_extension_trailer_keeps_the_v1_prefix():
    plain = encode(JoinRequest("n1", 2, "cpu"))
    ext = Extension(1, FLAG_SECRET, bytes(range(16)))
    full = encode(JoinRequest("n1", 2, "cpu", ext))
    trailer = b"GCX" + h("01 01000000 10") + bytes(range(16))
    # Same fields, longer length: an entrenar reader decodes the v1 message and ignores the rest.
    assert full == struct.pack(">I", len(plain) - 4 + len(trailer)) + plain[4:] + trailer
    assert FrameDecoder().feed(full) == [JoinRequest("n1", 2, "cpu", ext)]
    assert FrameDecoder().feed(encode(JoinAccepted(0, 1, Extension()))) == [JoinAccepted(0, 1, Extension())]


def test_encode_refuses_a_frame_the_peer_would_refuse():
    msg = GradientPayload(1, 0, np.zeros(10, np.float32), 0.0, 0, 0)
    payload = frame_size(msg) - 4
    assert len(encode(msg, max_frame_bytes=payload)) == payload + 4
    with pytest.raises(UsageError, match="exceeds max_frame_bytes"):
        encode_parts(msg, max_frame_bytes=payload - 1)


@pytest.mark.parametrize("msg", [
    NonBlockGradientPayload(0, 0, 256, [1.0]),  # component is a u8
    ShardAssignment(-1, 0, 1),
    JoinAccepted(2**32, 1),
    BlockGradientPayload(0, 0, 0, 1, [2**32], [1.0]),
])
def test_values_that_do_not_fit_their_wire_type(msg):
    with pytest.raises(UsageError, match="does not fit"):
        encode(msg)


def test_encode_parts_does_not_copy_the_gradient():
    g = np.arange(5, dtype=np.float32)
    parts = encode_parts(AveragedGradient(0, g, 0.0))
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.float32), g) for p in parts)


def test_sink_lands_the_vector_in_place():
    row = np.full(3, -1.0, np.float32)
    seen = []

    def sink(cls, vals, count):
        seen.append((cls, dict(vals), count))
        return row if cls is BlockGradientPayload else None

    frames = [f for m, f in FRAMES if isinstance(m, (BlockGradientPayload, AveragedGradient))]
    msgs = FrameDecoder(sink=sink).feed(b"".join(frames))
    block = next(m for m in msgs if isinstance(m, BlockGradientPayload))
    assert block.gradients is row and row.tolist() == [1.0, 2.0, 3.0]
    assert seen[-1] == (BlockGradientPayload, {"step": 2, "worker_id": 0, "block_idx": 5, "num_blocks": 8,
                                               "component_sizes": (1, 2)}, 3)
    with pytest.raises(UsageError, match="sink must return"):
        FrameDecoder(sink=lambda *a: np.zeros(2, np.float64)).feed(frames[0])


def test_get_buffer_lends_the_destination_of_large_vectors():
    g = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    frame = encode(AveragedGradient(1, g, 0.25))
    d, out, pos = FrameDecoder(), [], 0
    direct = 0
    while pos < len(frame):
        buf = d.get_buffer()
        direct += len(buf) > 64 * 1024  # bigger than the staging buffer: the vector itself
        k = min(len(buf), len(frame) - pos, 50_000)
        buf[:k] = frame[pos : pos + k]
        pos += k
        out += d.buffer_updated(k)
    assert direct and out == [AveragedGradient(1, g, 0.25)]


@st.composite
def messages(draw):
    vec = st.lists(st.floats(width=32, allow_nan=True), max_size=20)
    u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
    sizes = st.lists(st.integers(0, 2**32 - 1), max_size=9)
    return draw(st.one_of(
        st.builds(GradientPayload, u64, u32, vec, st.floats(width=32), u64, u64),
        st.builds(AveragedGradient, u64, vec, st.floats(width=32)),
        st.builds(BlockGradientPayload, u64, u32, u32, u32, sizes, vec),
        st.builds(NonBlockGradientPayload, u64, u32, st.integers(0, 255), vec),
        st.builds(JoinRequest, st.text(max_size=20), u32, st.text(max_size=8)),
        st.builds(Heartbeat, st.text(max_size=20), u64),
        st.builds(Abort, st.integers(0, 255), st.one_of(st.none(), st.integers(0, 2**32 - 2)),
                  st.one_of(st.none(), st.integers(0, 2**64 - 2)), st.text(max_size=30)),
    ))


@settings(max_examples=60, deadline=None)
@given(st.lists(messages(), min_size=1, max_size=5), st.integers(1, 17))
def test_any_messages_in_any_chunks(msgs, chunk):
    stream = b"".join(encode(m) for m in msgs)
    d, out = FrameDecoder(), []
    for i in range(0, len(stream), chunk):
        out += d.feed(stream[i : i + chunk])
    assert out == msgs

"""More decoders that read a peer's bytes: coordinator frames and the node driver's messages and JSON specs.

Same rule as test_decoders.py: a correct decode or the documented error,
nothing else. Coordinator frames: ``ProtocolError``. Node messages
(:func:`gradcoll.node.wire.recv_message`, over a scripted transport):
``ProtocolError``. Stage specs, train specs and caps: ``UsageError`` (which
the receiving side turns into a ``ProtocolError`` naming the peer), for caps
also ``KeyError`` (``collect_caps`` converts both). The ``@example``\\ s pin
inputs that once broke a decoder (deep or huge JSON, non-list ops, huge
integers, odd dtypes, empty parameter pairs), so they stay fixed.
"""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradcoll.errors import CollectiveMismatch, ProtocolError, UsageError
from tests.fuzz.test_decoders import mutations

pytestmark = pytest.mark.timeout(900)
FUZZ = settings.get_profile("gradcoll-fuzz")
MAX_FRAME = 4096  # small, so a lying length prefix can never make the decoder allocate much


# -- coordinator frames -----------------------------------------------------------------
def _frames() -> list[bytes]:
    from gradcoll.coordinator import protocol as p

    ext = p.Extension(flags=1, nonce=b"n" * 16)
    msgs = [p.JoinRequest("node-a", 2, "cpu", ext), p.JoinAccepted(1, 3, ext), p.ShardAssignment(4, 0, 50),
            p.GradientPayload(4, 1, np.arange(5, dtype=np.float32), 0.5, 3, 50),
            p.AveragedGradient(4, np.ones(3, np.float32), 0.25), p.Heartbeat("node-a", 123), p.Shutdown(),
            p.BlockGradientPayload(4, 1, 2, 3, (1, 2), np.ones(3, np.float32)),
            p.AveragedBlockGradient(4, 2, (3,), np.ones(3, np.float32)),
            p.NonBlockGradientPayload(4, 1, 2, np.ones(2, np.float32)),
            p.AveragedNonBlockGradient(4, 2, np.ones(2, np.float32)),
            p.Abort(2, 1, 4, "mismatch"), p.AuthChallenge(b"x" * 32, b"y" * 32), p.AuthResponse(b"z" * 32)]
    return [p.encode(m) for m in msgs]


FRAMES = _frames()


@FUZZ
@given(st.sampled_from(FRAMES).flatmap(mutations), st.lists(st.integers(1, 64), max_size=8))
def test_coordinator_frames(data: bytes, cuts: list[int]) -> None:
    from gradcoll.coordinator.protocol import FrameDecoder, Message, encode

    dec = FrameDecoder(MAX_FRAME)
    got: list[Message] = []
    try:
        at = 0
        for c in cuts + [len(data)]:  # the same bytes in arbitrary pieces
            got += dec.feed(data[at : at + c])
            at += c
    except ProtocolError:
        with pytest.raises(ProtocolError):  # it stays failed
            dec.feed(b"\0\0\0\1\7")
        return
    for m in got:
        assert isinstance(m, Message)
        assert len(encode(m, None)) <= 4 + MAX_FRAME + 4 + 9 + 255  # an extension may come back in canonical form


def test_every_valid_coordinator_frame_decodes() -> None:
    from gradcoll.coordinator.protocol import FrameDecoder, encode

    for f in FRAMES:
        (m,) = FrameDecoder(MAX_FRAME).feed(f)
        assert encode(m) == f


# -- node messages over a scripted transport -------------------------------------------------
class _Scripted:
    """A transport that delivers one header and one body, with the transport's exact-length rule."""

    def __init__(self, header: bytes, body: bytes) -> None:
        self.frames = [header, body]

    def recv(self, peer: int, out: Any, tag: int, timeout: float | None = None) -> int:
        frame = self.frames.pop(0)
        view = memoryview(out).cast("B")
        if len(frame) != len(view):
            raise CollectiveMismatch(f"expected {len(view)} bytes, got {len(frame)}")  # what tcp/shm raise
        view[:] = frame
        return len(frame)

    def send(self, peer: int, buf: Any, tag: int, timeout: float | None = None) -> None:
        pass


def _group(header: bytes, body: bytes, rank: int = 1) -> Any:
    return SimpleNamespace(rank=rank, size=2, timeout=1.0, transport=_Scripted(header, body))


_HDR = struct.Struct("<4sBBHQ")
_JSON_VALID = json.dumps({"type": "stage", "spec": {"ops": [{"op": "scale", "factor": 2.0}]}}).encode()


@st.composite
def _node_message(draw: st.DrawFn) -> tuple[bytes, bytes]:
    body = draw(st.one_of(mutations(_JSON_VALID), st.binary(max_size=64),
                          st.sampled_from([b"[" * 50_000, b"1" * 5_000, b'{"type": "x", "a": ' + b"9" * 5000 + b"}"])))
    magic = draw(st.sampled_from([b"GCND", b"GCNX", b"\0\0\0\0"]))
    kind, code = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    nbytes = draw(st.one_of(st.just(len(body)), st.integers(0, 2**64 - 1)))
    return _HDR.pack(magic, kind, code, 0, nbytes), body


@FUZZ
@given(_node_message())
@example((_HDR.pack(b"GCND", 1, 0, 0, 50_000), b"[" * 50_000))
@example((_HDR.pack(b"GCND", 1, 0, 0, 5_000), b"1" * 5_000))
def test_node_messages(msg: tuple[bytes, bytes]) -> None:
    from gradcoll.node import wire

    header, body = msg
    try:
        out = wire.recv_message(_group(header, body), 0)
    except (ProtocolError, CollectiveMismatch):
        return
    assert out is not None and out.kind in (wire.JSON, wire.ARRAY, wire.ERROR)


# -- JSON specs -----------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mutated_doc(valid: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Random JSON values, and ``valid`` with keys replaced by random values, dropped or added (one level down too)."""

    @st.composite
    def mutate(draw: st.DrawFn) -> Any:
        doc = json.loads(json.dumps(valid))
        for _ in range(draw(st.integers(1, 3))):
            target = doc
            nested = [k for k, v in doc.items() if isinstance(v, dict)]
            if nested and draw(st.booleans()):
                target = doc[draw(st.sampled_from(nested))]
            keys = sorted(target)
            action = draw(st.integers(0, 2))
            if action == 0 and keys:
                target[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
            elif action == 1 and keys:
                del target[draw(st.sampled_from(keys))]
            else:
                target[draw(st.text(max_size=6))] = draw(JSON_VALUES)
        return doc

    return st.one_of(JSON_VALUES, mutate())


STAGE = {"stage_id": "s1", "device": "auto", "dtype": "float32",
         "ops": [{"op": "linear", "weight": "file:///w.npy", "bias": "file:///b.npy"}, {"op": "scale", "factor": 0.5}]}
TRAIN = {"ops": [{"op": "linear", "weight": "w"}], "params": {"w": "file:///w.npy"}, "lr": [0.1, 0.05],
         "data": {"x": "file:///x.npy", "y": "file:///y.npy", "shard_start": 0, "shard_len": 4},
         "momentum": 0.9, "batch": 2, "loss": "mse", "dtype": "float32", "deterministic": True}
CAPS = {"rank": 1, "role": {"kind": "worker", "fixed": None}, "devices": ["cpu"], "platform": "linux"}


@FUZZ
@given(_mutated_doc(STAGE))
@example({"ops": 5})
@example({"ops": [{"op": "scale", "factor": 10**400}]})
@example({"dtype": {"x": [1]}})
def test_stage_specs(doc: Any) -> None:
    from gradcoll.node import StageSpec

    try:
        spec = StageSpec.from_dict(doc)
    except UsageError:
        return
    assert StageSpec.from_json(spec.to_json()) == spec


@FUZZ
@given(_mutated_doc(TRAIN))
@example({**TRAIN, "ops": None})
@example({**TRAIN, "momentum": 10**400})
@example({**TRAIN, "params": [[]]})
def test_train_specs(doc: Any) -> None:
    from gradcoll.node import TrainSpec

    try:
        spec = TrainSpec.from_dict(doc)
    except UsageError:
        return
    assert TrainSpec.from_json(spec.to_json()) == spec


@FUZZ
@given(_mutated_doc(CAPS))
def test_caps(doc: Any) -> None:
    from gradcoll.node import NodeCaps

    try:
        caps = NodeCaps.from_dict(doc)
    except (UsageError, KeyError):
        return
    assert NodeCaps.from_dict(caps.to_dict()) == caps

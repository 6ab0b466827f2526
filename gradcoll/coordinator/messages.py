"""The messages of coordinator protocol v1 (entrenar's tags 0x01..0x0B) and gradcoll's additions (0x80..).

Each message is a frozen dataclass whose ``TAG`` and ``FIELDS`` (name, wire
kind) describe its bytes; ``gradcoll.coordinator.protocol`` turns them into frames and back.
Wire kinds: ``u8``/``u32``/``u64``/``f32`` (little-endian), ``ou32``/``ou64``
(an optional integer, all ones meaning None), ``str`` (u32 length + UTF-8),
``bytes`` (u32 length + bytes), ``sizes`` (u32 count + u32 each),
``f32vec`` (u64 count + f32 each) and ``ext`` (gradcoll's optional trailer,
``Extension``). Equality is bit-exact: NaN equals the same NaN, -0.0
differs from 0.0.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..errors import UsageError

__all__ = [
    "DEFAULT_MAX_FRAME", "Message", "Extension", "FLAG_SECRET", "MESSAGE_TYPES", "as_f32_vector",
    "JoinRequest", "JoinAccepted", "ShardAssignment", "GradientPayload", "AveragedGradient", "Heartbeat",
    "Shutdown", "BlockGradientPayload", "AveragedBlockGradient", "NonBlockGradientPayload",
    "AveragedNonBlockGradient", "Abort", "AuthChallenge", "AuthResponse",
    "ABORT_ERROR", "ABORT_NONFINITE", "ABORT_MISMATCH", "ABORT_TIMEOUT", "ABORT_DEAD", "ABORT_PROTOCOL",
    "ABORT_AUTH",
]

#: entrenar's reader refuses payloads longer than this; the default cap of both sides.
DEFAULT_MAX_FRAME = 100_000_000

ABORT_ERROR, ABORT_NONFINITE, ABORT_MISMATCH, ABORT_TIMEOUT, ABORT_DEAD, ABORT_PROTOCOL, ABORT_AUTH = range(7)

#: Extension flag: this side holds a shared secret and will authenticate.
FLAG_SECRET = 1


def as_f32_vector(x: Any, what: str = "gradients") -> np.ndarray:
    """``x`` as a 1-D C-contiguous little-endian float32 array (no copy when it already is one)."""
    try:
        a = np.asarray(x, dtype="<f4")
    except (TypeError, ValueError) as e:
        raise UsageError(f"{what} must be an array of numbers: {e}") from None
    if a.ndim != 1:
        a = a.reshape(-1)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


@dataclass(frozen=True)
class Extension:
    """gradcoll's trailer after JoinRequest / JoinAccepted; entrenar ignores trailing bytes, so v1 peers never see it.

    Layout: ``b"GCX" | u8 version | u32 flags | u8 nonce length | nonce``.
    """

    version: int = 1
    flags: int = 0
    nonce: bytes = b""

    MAGIC: ClassVar[bytes] = b"GCX"

    def to_bytes(self) -> bytes:
        """The trailer's bytes."""
        if len(self.nonce) > 255:
            raise UsageError("extension nonce is longer than 255 bytes")
        return self.MAGIC + struct.pack("<BIB", self.version, self.flags, len(self.nonce)) + self.nonce

    @classmethod
    def parse(cls, data: bytes) -> "Extension | None":
        """The trailer in ``data``, or None when ``data`` is not one (plain trailing bytes are ignored)."""
        if len(data) < 9 or not data.startswith(cls.MAGIC):
            return None
        version, flags, n = struct.unpack_from("<BIB", data, 3)
        if version < 1 or len(data) < 9 + n:
            return None
        return cls(version, flags, bytes(data[9 : 9 + n]))


Fields = tuple[tuple[str, str], ...]


class Message:
    """Base of every protocol message: ``TAG`` and ``FIELDS`` (name, wire kind) describe its bytes."""

    TAG: ClassVar[int]
    FIELDS: ClassVar[Fields] = ()

    def __post_init__(self) -> None:
        for name, kind in self.FIELDS:
            v = getattr(self, name)
            if kind == "f32vec":
                object.__setattr__(self, name, as_f32_vector(v, name))
            elif kind == "sizes":
                object.__setattr__(self, name, tuple(int(s) for s in v))
            elif kind == "f32":
                object.__setattr__(self, name, float(v))

    def __eq__(self, other: object) -> bool:  # bit-exact, so NaN == NaN and -0.0 != 0.0
        if type(other) is not type(self):
            return NotImplemented
        for name, kind in self.FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if kind == "f32vec":
                if a.shape != b.shape or a.tobytes() != b.tobytes():
                    return False
            elif kind == "f32":
                if struct.pack("<f", a) != struct.pack("<f", b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class JoinRequest(Message):
    """Worker -> coordinator: first message of a connection."""

    TAG: ClassVar[int] = 0x01
    FIELDS: ClassVar[Fields] = (("node_id", "str"), ("gpu_count", "u32"), ("backend", "str"), ("ext", "ext"))

    node_id: str
    gpu_count: int
    backend: str
    ext: Extension | None = None


@dataclass(frozen=True, eq=False)
class JoinAccepted(Message):
    """Coordinator -> worker: your id and the cluster size."""

    TAG: ClassVar[int] = 0x02
    FIELDS: ClassVar[Fields] = (("worker_id", "u32"), ("total_workers", "u32"), ("ext", "ext"))

    worker_id: int
    total_workers: int
    ext: Extension | None = None


@dataclass(frozen=True, eq=False)
class ShardAssignment(Message):
    """Coordinator -> worker: the samples ``[shard_start, shard_end)`` to train on at ``step``."""

    TAG: ClassVar[int] = 0x03
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("shard_start", "u64"), ("shard_end", "u64"))

    step: int
    shard_start: int
    shard_end: int


@dataclass(frozen=True, eq=False)
class GradientPayload(Message):
    """Worker -> coordinator: a whole gradient with the shard's loss and accuracy counts."""

    TAG: ClassVar[int] = 0x04
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("worker_id", "u32"), ("gradients", "f32vec"), ("loss", "f32"),
                                ("correct", "u64"), ("total", "u64"))

    step: int
    worker_id: int
    gradients: np.ndarray
    loss: float
    correct: int
    total: int


@dataclass(frozen=True, eq=False)
class AveragedGradient(Message):
    """Coordinator -> worker: the averaged gradient and the sample-weighted loss."""

    TAG: ClassVar[int] = 0x05
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("gradients", "f32vec"), ("global_loss", "f32"))

    step: int
    gradients: np.ndarray
    global_loss: float


@dataclass(frozen=True, eq=False)
class Heartbeat(Message):
    """Either direction, between gradcoll peers only: "still alive"."""

    TAG: ClassVar[int] = 0x06
    FIELDS: ClassVar[Fields] = (("node_id", "str"), ("timestamp_ms", "u64"))

    node_id: str
    timestamp_ms: int


@dataclass(frozen=True, eq=False)
class Shutdown(Message):
    """Coordinator -> worker: training is over."""

    TAG: ClassVar[int] = 0x07
    FIELDS: ClassVar[Fields] = ()


@dataclass(frozen=True, eq=False)
class BlockGradientPayload(Message):
    """Worker -> coordinator: one transformer block's gradient (its components concatenated)."""

    TAG: ClassVar[int] = 0x08
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("worker_id", "u32"), ("block_idx", "u32"), ("num_blocks", "u32"),
                                ("component_sizes", "sizes"), ("gradients", "f32vec"))

    step: int
    worker_id: int
    block_idx: int
    num_blocks: int
    component_sizes: tuple[int, ...]
    gradients: np.ndarray


@dataclass(frozen=True, eq=False)
class AveragedBlockGradient(Message):
    """Coordinator -> worker: one block's averaged gradient."""

    TAG: ClassVar[int] = 0x09
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("block_idx", "u32"), ("component_sizes", "sizes"), ("gradients", "f32vec"))

    step: int
    block_idx: int
    component_sizes: tuple[int, ...]
    gradients: np.ndarray


@dataclass(frozen=True, eq=False)
class NonBlockGradientPayload(Message):
    """Worker -> coordinator: a non-block component (0 lm_head, 1 final_norm, 2 embedding)."""

    TAG: ClassVar[int] = 0x0A
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("worker_id", "u32"), ("component", "u8"), ("gradients", "f32vec"))

    step: int
    worker_id: int
    component: int
    gradients: np.ndarray


@dataclass(frozen=True, eq=False)
class AveragedNonBlockGradient(Message):
    """Coordinator -> worker: a non-block component's averaged gradient."""

    TAG: ClassVar[int] = 0x0B
    FIELDS: ClassVar[Fields] = (("step", "u64"), ("component", "u8"), ("gradients", "f32vec"))

    step: int
    component: int
    gradients: np.ndarray


@dataclass(frozen=True, eq=False)
class Abort(Message):
    """Coordinator -> gradcoll worker: the cluster stops; ``code`` is an ``ABORT_*`` value."""

    TAG: ClassVar[int] = 0x80
    FIELDS: ClassVar[Fields] = (("code", "u8"), ("culprit", "ou32"), ("step", "ou64"), ("reason", "str"))

    code: int
    culprit: int | None
    step: int | None
    reason: str


@dataclass(frozen=True, eq=False)
class AuthChallenge(Message):
    """Coordinator -> worker: a fresh nonce and the coordinator's proof that it knows the secret."""

    TAG: ClassVar[int] = 0x81
    FIELDS: ClassVar[Fields] = (("nonce", "bytes"), ("proof", "bytes"))

    nonce: bytes
    proof: bytes


@dataclass(frozen=True, eq=False)
class AuthResponse(Message):
    """Worker -> coordinator: the worker's proof (empty when it has no secret)."""

    TAG: ClassVar[int] = 0x82
    FIELDS: ClassVar[Fields] = (("mac", "bytes"),)

    mac: bytes


#: Message classes by tag.
MESSAGE_TYPES: dict[int, type[Message]] = {
    c.TAG: c for c in (JoinRequest, JoinAccepted, ShardAssignment, GradientPayload, AveragedGradient, Heartbeat,
                       Shutdown, BlockGradientPayload, AveragedBlockGradient, NonBlockGradientPayload,
                       AveragedNonBlockGradient, Abort, AuthChallenge, AuthResponse)
}

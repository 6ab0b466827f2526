"""Shared-secret authentication: the key, the proofs of the handshakes, and keyed integrity tags.

The bottom of the package (it imports nothing of gradcoll's but the
errors), so the store, the transports, the control channel and the front
ends all prove the same secret the same way. No I/O here: callers move the
bytes.

A *proof* is HMAC-SHA256 over a label that names the protocol and the role
of the prover (``b"gradcoll-tcp-listener-v2"``), then every field the
handshake binds, each length-prefixed so no two field lists share an
encoding: the group's session id, both rank numbers, both sides' fresh
nonces, the address dialled. A proof made for one role, one session, one
pair of ranks or one connection is therefore worthless for any other: a
stranger can neither replay a recorded handshake nor relay a live one to
a rank it was not meant for. Proofs are compared in constant time
(``same``).

An *integrity tag* (``Tagger``) is a truncated HMAC-SHA256 (16 bytes) with
a key derived for one direction of one link; the data it covers includes
the frame's sequence number, so a frame cut, replayed, reordered or
altered fails its check.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from .errors import UsageError

__all__ = ["ENV", "resolve", "derive", "proof", "same", "nonce", "Tagger", "MAC_SIZE", "NONCE_SIZE"]

#: The environment variable every front end reads the shared secret from when none is passed.
ENV = "GRADCOLL_SECRET"
#: Bytes of an integrity tag, and of a handshake nonce.
MAC_SIZE = 16
NONCE_SIZE = 16


def resolve(secret: bytes | str | None, env: str = ENV) -> bytes | None:
    """The key for ``secret`` (a str is its UTF-8 bytes), else ``$GRADCOLL_SECRET``, else None (no secret)."""
    if secret is None:
        secret = os.environ.get(env) or None
        if secret is None:
            return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise UsageError(f"secret must be bytes or str, got {type(secret).__name__}")
    if not secret:
        raise UsageError("secret must not be empty (pass None for no authentication)")
    return bytes(secret)


def _encode(parts: tuple[bytes | str | int, ...]) -> bytes:
    out = bytearray()
    for p in parts:
        b = p.encode("utf-8") if isinstance(p, str) else p.to_bytes(8, "little", signed=True) if isinstance(p, int) \
            else bytes(p)
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def derive(key: bytes, label: bytes, *parts: bytes | str | int) -> bytes:
    """A 32-byte key (or proof) for ``label`` and ``parts``: HMAC-SHA256 of their unambiguous encoding."""
    return hmac.new(key, label + b"\0" + _encode(parts), hashlib.sha256).digest()


def proof(key: bytes, role: bytes, *fields: bytes | str | int) -> bytes:
    """The proof that the holder of ``key`` plays ``role`` in the handshake bound to ``fields``."""
    return derive(key, role, *fields)


def same(a: bytes, b: bytes) -> bool:
    """Constant-time equality of two proofs or tags."""
    return hmac.compare_digest(bytes(a), bytes(b))


def nonce() -> bytes:
    """A fresh random handshake nonce."""
    return secrets.token_bytes(NONCE_SIZE)


class Tagger:
    """Integrity tags for one direction of one link: ``tag(seq, *chunks)`` over the frame's bytes."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def begin(self, seq: int, *chunks: bytes | bytearray | memoryview) -> "hmac.HMAC":
        """A running tag of frame ``seq`` over ``chunks`` so far: ``update`` it with the rest, ``digest()[:16]``."""
        h = self._base.copy()
        h.update(seq.to_bytes(8, "little"))
        for c in chunks:
            h.update(c)
        return h

    def tag(self, seq: int, *chunks: bytes | bytearray | memoryview) -> bytes:
        """The 16-byte tag of frame ``seq`` made of ``chunks`` (the header, then the payload)."""
        return self.begin(seq, *chunks).digest()[:MAC_SIZE]

    def check(self, seq: int, tag: bytes | bytearray | memoryview, *chunks: bytes | bytearray | memoryview) -> bool:
        """True when ``tag`` is the tag of frame ``seq`` made of ``chunks``."""
        return hmac.compare_digest(self.tag(seq, *chunks), bytes(tag))

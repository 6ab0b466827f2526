"""Proofs of the group's secret kept inside a shared mapping: the pair segments' and the windows'.

A file in ``/dev/shm`` is found by name, and anyone running as this user
can create, replace or rewrite one; the O_NOFOLLOW / owner / 0600 checks of
the attacher only keep other users and links out. With the group's
secret, the creator of a mapping writes ``_auth.proof(key, role, name,
*ranks)`` (32 bytes) at a fixed offset before it tells anyone the name,
and each attacher checks it before it writes anything into the mapping,
then writes its own proof (another role) at its own offset, which the
creator checks before it trusts the attacher. The proof is bound to the
file's name and the ranks it was made for, so a proof copied from another
segment or window, or from another pair of ranks, does not verify.

The bytes move through ``memoryview`` casts, so the same two functions
serve Python's ``mmap`` (the pair segments) and the ctypes arrays the
windows are mapped as.
"""

from __future__ import annotations

from typing import Any

from .. import _auth

__all__ = ["PROOF_BYTES", "write", "check"]

#: Bytes of one proof in the mapping (an HMAC-SHA256 digest).
PROOF_BYTES = 32


def _proof(key: bytes, role: bytes, name: str, ranks: tuple[int, ...]) -> bytes:
    return _auth.proof(key, role, name, *ranks)


def write(buf: Any, at: int, key: bytes, role: bytes, name: str, *ranks: int) -> None:
    """Write the proof of ``role`` for the mapping ``name`` and ``ranks`` at byte ``at`` of ``buf``."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        view[at : at + PROOF_BYTES] = _proof(key, role, name, ranks)


def check(buf: Any, at: int, key: bytes, role: bytes, name: str, *ranks: int) -> bool:
    """True when byte ``at`` of ``buf`` holds the proof of ``role`` for ``name`` and ``ranks``."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        found = bytes(view[at : at + PROOF_BYTES])
    return _auth.same(found, _proof(key, role, name, ranks))

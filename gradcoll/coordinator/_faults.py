"""How failures cross the wire: exception -> Abort code on the coordinator, Abort -> exception on a worker.

Also the HMAC proofs of the join handshake. Both sides prove they hold the
shared secret over both nonces and the worker's node id, with a different
label per direction so one side's proof can never be replayed as the other's.
"""

from __future__ import annotations

import hashlib
import hmac

from ..errors import CollectiveMismatch, CollectiveTimeout, GradcollError, NonFiniteError, ProtocolError, TransportBroken, TransportError
from .protocol import ABORT_AUTH, ABORT_DEAD, ABORT_ERROR, ABORT_MISMATCH, ABORT_NONFINITE, ABORT_PROTOCOL, ABORT_TIMEOUT, Abort

__all__ = [
    "abort_code", "culprit", "reworded", "error_from_abort", "jidoka_text", "coordinator_proof", "worker_proof",
    "proof_matches",
]


def jidoka_text(worker: int, step: int) -> str:
    """entrenar's halt text (contract F-DP-003); log alerts match on it, so it never changes."""
    return f"JIDOKA HALT: worker {worker} sent non-finite gradient at step {step}"


def abort_code(exc: BaseException) -> int:
    """The ``ABORT_*`` code that tells a worker what kind of failure stopped the cluster."""
    for cls, code in ((NonFiniteError, ABORT_NONFINITE), (CollectiveMismatch, ABORT_MISMATCH),
                      (CollectiveTimeout, ABORT_TIMEOUT), (TransportError, ABORT_DEAD),
                      (ProtocolError, ABORT_PROTOCOL)):
        if isinstance(exc, cls):
            return code
    return ABORT_ERROR


def culprit(exc: BaseException) -> int | None:
    """The worker an error blames, if it names one."""
    for attr in ("contributor", "peer"):
        v = getattr(exc, attr, None)
        if v is not None:
            return int(v)
    missing = getattr(exc, "missing", None)
    return missing[0] if missing else None


def reworded(e: BaseException, text: str, worker: int | None) -> GradcollError:
    """The same kind of error as ``e`` with a message naming the operation and the worker."""
    if isinstance(e, CollectiveTimeout):
        return CollectiveTimeout(text, missing=[] if worker is None else [worker], op=e.op)
    if isinstance(e, TransportError):
        # A worker never closes in the middle of training on purpose: closed counts as broken.
        return TransportBroken(text, peer=worker)
    if isinstance(e, (ProtocolError, CollectiveMismatch)):
        out = type(e)(text)
        setattr(out, "peer", worker)  # noqa: B010 - the culprit, carried in the Abort
        return out
    return e if isinstance(e, GradcollError) else TransportBroken(text, peer=worker)


def error_from_abort(msg: Abort, who: str) -> GradcollError:
    """The exception a worker raises for the coordinator's Abort (same class as the coordinator's)."""
    text = f"{who}: the coordinator aborted the cluster: {msg.reason}"
    if msg.code == ABORT_NONFINITE:
        # Keep the halt text first, as the coordinator's own error has it.
        return NonFiniteError(f"{msg.reason} (relayed to {who})", contributor=msg.culprit, step=msg.step)
    if msg.code == ABORT_MISMATCH:
        return CollectiveMismatch(text)
    if msg.code == ABORT_TIMEOUT:
        return CollectiveTimeout(text, missing=[] if msg.culprit is None else [msg.culprit], op="coordinator")
    if msg.code == ABORT_DEAD:
        return TransportBroken(text, peer=msg.culprit)
    if msg.code in (ABORT_PROTOCOL, ABORT_AUTH):
        return ProtocolError(text)
    return GradcollError(text)


def _mac(label: bytes, secret: bytes, client_nonce: bytes, server_nonce: bytes, node_id: str) -> bytes:
    node = node_id.encode("utf-8")
    data = b"".join((label, len(client_nonce).to_bytes(1, "little"), client_nonce,
                     len(server_nonce).to_bytes(1, "little"), server_nonce, node))
    return hmac.new(secret, data, hashlib.sha256).digest()


def coordinator_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, node_id: str) -> bytes:
    """The coordinator's proof that it knows ``secret`` (sent in AuthChallenge)."""
    return _mac(b"gradcoll-coordinator-v1\0", secret, client_nonce, server_nonce, node_id)


def worker_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, node_id: str) -> bytes:
    """The worker's proof that it knows ``secret`` (sent in AuthResponse)."""
    return _mac(b"gradcoll-worker-v1\0", secret, client_nonce, server_nonce, node_id)


def proof_matches(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)

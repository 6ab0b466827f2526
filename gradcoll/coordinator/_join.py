"""Admission to a coordinator cluster: join requests, the HMAC handshake, refusals.

The coordinator's ``wait_for_workers`` loop asks ``Admission.ready`` for
the joining connections that have something to act on (a message, an error,
a missed deadline) and hands each to ``Admission.handshake``, so joins
progress side by side and a silent stranger holds up no one. Worker ids are
given in the order joins complete. A refused connection is logged (logger
``gradcoll.coordinator``, WARNING), told why if it is a gradcoll peer, and
closed; the coordinator keeps waiting for real workers.
"""

from __future__ import annotations

import secrets
import threading
import time

from .._util import Deadline
from ..errors import CollectiveTimeout, GradcollError
from ._conn import POLL_S
from ._faults import coordinator_proof, proof_matches, worker_proof
from ._peers import Peer, log
from .config import DistributedConfig
from .protocol import ABORT_AUTH, ABORT_PROTOCOL, FLAG_SECRET, Abort, AuthChallenge, AuthResponse, Extension, JoinAccepted, JoinRequest, Message

__all__ = ["Admission", "HANDSHAKE_S", "LINGER_S"]

HANDSHAKE_S = 10.0  # a connection must complete its join within this (or timeout_s, if shorter)
LINGER_S = 2.0  # after telling a peer to stop, how long to wait for it to close before closing anyway


class Admission:
    """Turns accepted connections into workers; shares ``pending`` and ``workers`` with the server."""

    def __init__(self, config: DistributedConfig, cond: threading.Condition, pending: list[Peer],
                 workers: list[Peer]) -> None:
        self.config = config
        self.cond = cond
        self.pending = pending
        self.workers = workers

    def ready(self, deadline: Deadline) -> list[Peer]:
        """Wait until some joining connection has something to act on (a message, an error, a missed deadline)."""
        cfg = self.config
        with self.cond:
            while True:
                now = time.monotonic()
                ready = [p for p in self.pending if p.inbox or p.error or now > p.join_by]
                if ready:
                    return ready
                if deadline.expired():
                    names = ", ".join(p.label for p in self.workers) or "none"
                    raise CollectiveTimeout(
                        f"coordinator: wait_for_workers: {len(self.workers)} of {cfg.expect_workers} workers "
                        f"joined within {cfg.timeout_s}s (joined: {names})",
                        missing=list(range(len(self.workers), cfg.expect_workers)), op="wait_for_workers")
                self.cond.wait(min(deadline.remaining() or POLL_S, POLL_S))

    def handshake(self, p: Peer) -> None:
        """Act on what a joining connection sent: answer, admit or refuse it."""
        with self.cond:
            msg = p.inbox.popleft() if p.inbox else None
        if msg is None:
            self.refuse(p, str(p.error) if p.error else f"did not complete its join within {self.handshake_s}s")
        elif p.state == "joining" and isinstance(msg, JoinRequest):
            p.node_id, p.gpu_count, p.backend, p.ext = msg.node_id, msg.gpu_count, msg.backend, msg.ext
            if self.config.secret_key is None:
                self._admit(p)
            elif p.ext is None:
                self.refuse(p, "a secret is configured and this peer cannot authenticate (plain entrenar worker?)")
            else:
                p.server_nonce = secrets.token_bytes(32)
                proof = coordinator_proof(self.config.secret_key, p.ext.nonce, p.server_nonce, p.node_id)
                p.state = "auth"
                self._send_or_refuse(p, AuthChallenge(p.server_nonce, proof))
        elif p.state == "auth" and isinstance(msg, AuthResponse):
            key, nonce = self.config.secret_key, p.ext.nonce if p.ext is not None else b""
            assert key is not None  # the auth state is only entered with a secret
            if not msg.mac:
                self.refuse(p, "it has no secret (set DistributedConfig.secret on the worker)")
            elif not proof_matches(worker_proof(key, nonce, p.server_nonce, p.node_id), msg.mac):
                self.refuse(p, "authentication failed (wrong secret)")
            else:
                self._admit(p)
        else:
            want = "JoinRequest" if p.state == "joining" else "AuthResponse"
            self.refuse(p, f"sent {type(msg).__name__} where {want} was expected", ABORT_PROTOCOL)

    def _admit(self, p: Peer) -> None:
        ext = Extension(flags=FLAG_SECRET if self.config.secret else 0) if p.gradcoll else None
        wid = len(self.workers)
        if self._send_or_refuse(p, JoinAccepted(wid, self.config.expect_workers, ext)):
            with self.cond:
                self.pending.remove(p)
                p.joined(wid, self.config.max_frame_bytes)
                self.workers.append(p)
            log.info("coordinator: %s joined from %s (%d GPUs, backend %s, %s peer)", p.label, p.addr, p.gpu_count,
                     p.backend, "gradcoll" if p.gradcoll else "entrenar v1")

    def _send_or_refuse(self, p: Peer, msg: Message) -> bool:
        try:
            p.conn.send(msg, self.handshake_s, None)
            p.join_by = time.monotonic() + self.handshake_s
            return True
        except GradcollError as e:
            self.refuse(p, f"could not answer it: {e}")
            return False

    def refuse(self, p: Peer, reason: str, code: int = ABORT_AUTH) -> None:
        """Log why ``p`` may not join, tell it (a gradcoll peer) and close it."""
        log.warning("coordinator: refused %s: %s", p.label, reason)
        with self.cond:
            if p in self.pending:
                self.pending.remove(p)
        if p.gradcoll and p.alive:
            try:
                p.conn.send(Abort(code, None, None, f"coordinator refused {p.label}: {reason}"), POLL_S * 10, None)
            except GradcollError:
                pass
        p.retire(min(LINGER_S, self.config.timeout_s))

    @property
    def handshake_s(self) -> float:
        """How long one connection may take to join."""
        return min(HANDSHAKE_S, self.config.timeout_s)

"""WorkerClient: entrenar's worker, joining a GradientServer (gradcoll's or entrenar's own).

The client speaks protocol v1. Its JoinRequest carries gradcoll's extension
trailer (entrenar ignores trailing bytes); only a coordinator that answers
with the trailer too is sent heartbeats, so a gradcoll worker can join an
entrenar coordinator. Every receive is bounded by ``timeout_s``, and by
``heartbeat_timeout_ms`` of silence from a gradcoll coordinator. An Abort
from the coordinator becomes the coordinator's own kind of error (a NaN halt
is a NonFiniteError with the "JIDOKA HALT" text); any communication failure
poisons the client (later calls raise GroupPoisoned). One thread drives a
client; a background thread only sends heartbeats.
"""

from __future__ import annotations

import collections
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from .._util import Deadline
from ..errors import CollectiveMismatch, CollectiveTimeout, GradcollError, GroupPoisoned, ProtocolError, TransportBroken, TransportClosed, UsageError
from ._conn import POLL_S, Conn, dial_once, tune
from ._faults import coordinator_proof, error_from_abort, proof_matches, worker_proof
from .config import DistributedConfig, Role, parse_addr
from .protocol import (
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
    Message,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
    encode_parts,
)
from .results import AveragedBlockResult, AveragedNonBlockResult, AveragedResult

__all__ = ["WorkerClient"]

_Payload = GradientPayload | BlockGradientPayload | NonBlockGradientPayload


def _dial(host: str, port: int, deadline: Deadline) -> socket.socket:
    """Connect, retrying while the coordinator is not listening yet, until the deadline."""
    delay = 0.01
    while True:
        try:
            sock = dial_once(host, port, max(min(deadline.remaining() or 5.0, 5.0), 0.01))
            tune(sock)
            return sock
        except OSError as e:
            if deadline.expired():
                raise CollectiveTimeout(f"worker: could not connect to the coordinator at {host}:{port} within "
                                        f"{deadline.timeout}s (last error: {e.strerror or e})", op="connect") from e
            time.sleep(min(delay, deadline.remaining() or delay))  # back off between connection attempts
            delay = min(delay * 2, 0.5)


class WorkerClient:
    """A worker of a coordinator cluster (entrenar's ``WorkerClient``); build it with ``connect``."""

    def __init__(self, config: DistributedConfig, conn: Conn, worker_id: int, total_workers: int,
                 coordinator_ext: Extension | None, pending: collections.deque[Message]) -> None:
        self.config = config
        self._conn = conn
        self._id = worker_id
        self._total = total_workers
        self._gradcoll = coordinator_ext is not None
        self._pending = pending
        self._who = f"worker {worker_id} (node {config.node_id})"
        conn.name = "the coordinator"
        # Replies expected, oldest first: (message class, step, block/component, length).
        self._outstanding: collections.deque[tuple[type, int, int | None, int]] = collections.deque()
        self._poison: BaseException | None = None
        self._closed = False
        self._shutdown = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if self._gradcoll:  # an entrenar coordinator would take a heartbeat for a protocol error
            self._beat = threading.Thread(target=self._beat_loop, daemon=True, name=f"gradcoll-worker-{worker_id}-beat")
            self._beat.start()

    @classmethod
    def connect(cls, config: DistributedConfig, gpu_count: int = 1, backend: str = "cpu") -> "WorkerClient":
        """Connect to ``config.coordinator_addr`` and complete the join (and, with a secret, the HMAC handshake)."""
        if config.role is not Role.WORKER:
            raise UsageError("WorkerClient.connect needs a worker config (DistributedConfig.worker)")
        host, port = parse_addr(config.coordinator_addr, "coordinator_addr")
        deadline = Deadline(config.timeout_s)
        nonce, secret = secrets.token_bytes(16), config.secret_key
        request = JoinRequest(config.node_id, gpu_count, backend, Extension(flags=FLAG_SECRET if secret else 0,
                                                                            nonce=nonce))
        parts = encode_parts(request, config.max_frame_bytes)  # refuse bad arguments before connecting
        conn = Conn(_dial(host, port, deadline), f"the coordinator at {host}:{port}",
                    FrameDecoder(config.max_frame_bytes))
        pending: collections.deque[Message] = collections.deque()
        who = f"worker (node {config.node_id})"
        try:
            conn.send_parts(parts, deadline.remaining() or POLL_S)
            authed = False
            while True:
                msg = _next(conn, pending, who, "join", deadline, None)
                if isinstance(msg, AuthChallenge):
                    if secret is None:
                        conn.send(AuthResponse(b""), deadline.remaining() or POLL_S, None)
                        raise ProtocolError(f"{who}: the coordinator at {host}:{port} requires a shared secret "
                                            "(set DistributedConfig.secret)")
                    if not proof_matches(coordinator_proof(secret, nonce, msg.nonce, config.node_id), msg.proof):
                        raise ProtocolError(f"{who}: the coordinator at {host}:{port} could not prove it knows the "
                                            "shared secret; refusing to join")
                    conn.send(AuthResponse(worker_proof(secret, nonce, msg.nonce, config.node_id)),
                              deadline.remaining() or POLL_S, None)
                    authed = True
                elif isinstance(msg, JoinAccepted):
                    if secret is not None and not authed:
                        raise ProtocolError(f"{who}: the coordinator at {host}:{port} accepted us without "
                                            "authenticating (no secret configured there?); refusing to join")
                    return cls(config, conn, msg.worker_id, msg.total_workers, msg.ext, pending)
                else:
                    raise ProtocolError(f"{who}: expected JoinAccepted from the coordinator, got {type(msg).__name__}")
        except BaseException:
            conn.close()
            raise

    def worker_id(self) -> int:
        """This worker's id (0-based, in join order)."""
        return self._id

    def total_workers(self) -> int:
        """Number of workers in the cluster."""
        return self._total

    # -- shards -----------------------------------------------------------------------
    def receive_shard(self) -> ShardAssignment | None:
        """The next ShardAssignment, or None when the coordinator shut the cluster down."""
        def run() -> ShardAssignment | None:
            msg = self._next("receive_shard")
            if isinstance(msg, Shutdown):
                self._finish()
                return None
            if not isinstance(msg, ShardAssignment):
                raise CollectiveMismatch(f"{self._who}: receive_shard: expected ShardAssignment from the "
                                         f"coordinator, got {type(msg).__name__}")
            return msg
        return cast("ShardAssignment | None", self._guard("receive_shard", run))

    # -- whole gradients --------------------------------------------------------------
    def send_gradients(self, step: int, gradients: Any, loss: float, correct: int, total: int) -> None:
        """Send this worker's gradient for ``step`` with its shard's loss and accuracy counts."""
        self._send("send_gradients", GradientPayload(step, self._id, gradients, loss, correct, total),
                   AveragedGradient, None)

    def receive_averaged(self) -> AveragedResult:
        """The averaged gradient of the last step sent (the cluster's mean)."""
        m = self._receive("receive_averaged", AveragedGradient, None)
        return AveragedResult(m.step, m.gradients, m.global_loss)

    # -- per-block gradients (v2 DDP) ----------------------------------------------------
    def send_block_gradient(self, step: int, block_idx: int, num_blocks: int, gradients: Any,
                            component_sizes: Any) -> None:
        """Send block ``block_idx``'s gradient: its components concatenated, ``component_sizes`` elements each."""
        msg = BlockGradientPayload(step, self._id, block_idx, num_blocks, component_sizes, gradients)
        if sum(msg.component_sizes) != msg.gradients.size:
            raise UsageError(f"{self._who}: component_sizes {list(msg.component_sizes)} sum to "
                             f"{sum(msg.component_sizes)} but gradients has {msg.gradients.size} elements")
        if not 0 <= block_idx < num_blocks:
            raise UsageError(f"{self._who}: block_idx {block_idx} is not in [0, num_blocks={num_blocks})")
        self._send("send_block_gradient", msg, AveragedBlockGradient, block_idx)

    def receive_averaged_block(self) -> AveragedBlockResult:
        """The averaged gradient of the oldest block sent."""
        m = self._receive("receive_averaged_block", AveragedBlockGradient, "block_idx")
        return AveragedBlockResult(m.step, m.block_idx, m.gradients, m.component_sizes)

    def send_non_block_gradient(self, step: int, component: int, gradients: Any) -> None:
        """Send a non-block component's gradient (0 lm_head, 1 final_norm, 2 embedding)."""
        self._send("send_non_block_gradient", NonBlockGradientPayload(step, self._id, component, gradients),
                   AveragedNonBlockGradient, component)

    def receive_averaged_non_block(self) -> AveragedNonBlockResult:
        """The averaged gradient of the oldest non-block component sent."""
        m = self._receive("receive_averaged_non_block", AveragedNonBlockGradient, "component")
        return AveragedNonBlockResult(m.step, m.component, m.gradients)

    # -- plumbing ---------------------------------------------------------------------
    def _send(self, op: str, msg: _Payload, reply: type, idx: int | None) -> None:
        parts = encode_parts(msg, self.config.max_frame_bytes)  # UsageError here leaves the stream untouched

        def run() -> None:
            try:
                self._conn.send_parts(parts, self.config.timeout_s)
            except GradcollError as e:
                # The coordinator may have aborted and closed while we were sending: prefer its reason.
                raise self._abort_waiting() or _reword(e, f"{self._who}: {op} step {msg.step}: {e}") from e
            self._outstanding.append((reply, msg.step, idx, msg.gradients.size))
        self._guard(op, run)

    def _receive(self, op: str, cls: Any, idx_field: str | None) -> Any:
        def run() -> Any:
            m: Any = self._next(op)
            if isinstance(m, Shutdown):
                self._finish()
                raise TransportClosed(f"{self._who}: {op}: shutdown during AllReduce")
            if not isinstance(m, cls):
                raise CollectiveMismatch(f"{self._who}: {op}: expected {cls.__name__} from the coordinator, "
                                         f"got {type(m).__name__}")
            if self._outstanding:
                ecls, step, idx, n = self._outstanding.popleft()
                got_idx = getattr(m, idx_field) if idx_field else None
                if (ecls, step, idx, n) != (cls, m.step, got_idx, m.gradients.size):
                    raise CollectiveMismatch(
                        f"{self._who}: {op}: the coordinator answered step {m.step}"
                        + (f" {idx_field} {got_idx}" if idx_field else "") + f" with {m.gradients.size} elements; "
                        f"the oldest unanswered send was {ecls.__name__} step {step}"
                        + (f" {idx_field} {idx}" if idx is not None else "") + f" with {n} elements")
            return m
        return self._guard(op, run)

    def _next(self, op: str) -> Message:
        hb = self.config.heartbeat_timeout_s if self._gradcoll else None
        return _next(self._conn, self._pending, self._who, op, Deadline(self.config.timeout_s), hb)

    def _guard(self, op: str, fn: Callable[[], Any]) -> Any:
        if self._poison is not None:
            raise GroupPoisoned(f"{self._who}: {op}: this client failed earlier ({self._poison}); "
                                "connect a new one") from self._poison
        if self._closed:
            why = "the coordinator shut the cluster down" if self._shutdown else "the client is closed"
            raise TransportClosed(f"{self._who}: {op}: {why}")
        try:
            return fn()
        except UsageError:
            raise
        except GradcollError as e:
            if not self._closed:
                self._poison = e
                self.close()
            raise

    def _abort_waiting(self) -> GradcollError | None:
        deadline = Deadline(min(1.0, self.config.timeout_s))
        try:
            while not deadline.expired():
                for m in list(self._pending) + self._conn.recv_messages():
                    if isinstance(m, Abort):
                        return error_from_abort(m, self._who)
        except GradcollError:
            pass
        return None

    def _finish(self) -> None:
        self._shutdown = True
        self.close()

    def _beat_loop(self) -> None:
        cfg = self.config
        while not self._stop.wait(cfg.heartbeat_interval_s):
            try:
                self._conn.try_send(Heartbeat(cfg.node_id, int(time.time() * 1000)), cfg.heartbeat_timeout_s)
            except GradcollError:
                return  # the main thread's next call reports the broken link

    def close(self) -> None:
        """Close the connection (the coordinator sees the worker leave). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(POLL_S * 20)
        self._conn.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " poisoned" if self._poison else " closed" if self._closed else ""
        return f"<WorkerClient {self._who} of {self._total}{state}>"


def _next(conn: Conn, pending: collections.deque[Message], who: str, op: str, deadline: Deadline,
          heartbeat_timeout: float | None) -> Message:
    """The next message that is not a heartbeat; an Abort is raised as the coordinator's error."""
    while True:
        while pending:
            m = pending.popleft()
            if isinstance(m, Abort):
                raise error_from_abort(m, who)
            if not isinstance(m, Heartbeat):
                return m
        if deadline.expired():
            raise CollectiveTimeout(f"{who}: {op}: nothing from the coordinator within {deadline.timeout}s", op=op)
        silent = time.monotonic() - conn.last_rx
        if heartbeat_timeout is not None and silent > heartbeat_timeout:
            raise CollectiveTimeout(f"{who}: {op}: the coordinator is dead: no heartbeat for {silent * 1000:.0f} ms",
                                    op=op)
        try:
            pending.extend(conn.recv_messages())
        except GradcollError as e:
            raise _reword(e, f"{who}: {op}: {e}") from e


def _reword(e: GradcollError, text: str) -> GradcollError:
    if isinstance(e, CollectiveTimeout):
        return CollectiveTimeout(text, op=e.op)
    if isinstance(e, (TransportBroken, TransportClosed, ProtocolError)):
        return type(e)(text)
    return e

"""GradientServer: entrenar's coordinator as a thin front end over gradcoll's star shape and fused kernel.

Each collect is the star algorithm's gather-reduce-broadcast with the
coordinator as root: every worker's gradient lands (through its connection's
reader thread, concurrently) in its row of a preallocated ``n x count``
float32 buffer; one call of [`gradcoll.kernels.mean_reduce`][gradcoll.kernels.mean_reduce] averages
the rows in worker order and checks every element for NaN/Inf; the
broadcast sends the result to all workers at once. Unlike
``star_allreduce`` the root contributes no row, and
the wire is entrenar's protocol rather than gradcoll's transport frames.

Every wait is bounded by ``timeout_s``; a gradcoll worker that sends nothing
(not even a heartbeat) for ``heartbeat_timeout_ms`` is dead. Any failure
(mismatch, halt, dead worker, timeout) first tells every worker why (an
Abort, or Shutdown to a plain entrenar worker), then raises, and poisons the
server: later calls raise GroupPoisoned. See docs/coordinator.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import kernels
from .._util import Deadline
from ..errors import GradcollError, GroupPoisoned, NonFiniteError, TransportBroken, TransportClosed, UsageError
from ..kernels.workspace import Workspace
from ._collect import check_same_shape, gather, halt_error
from ._conn import POLL_S, congestion, set_congestion
from ._faults import abort_code, culprit, reworded
from ._join import LINGER_S, Admission
from ._peers import Peer, Slot, log
from .config import DistributedConfig, Role, parse_addr, shard_bounds
from .protocol import (
    ABORT_PROTOCOL,
    Abort,
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    GradientPayload,
    Heartbeat,
    Message,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
    encode_parts,
)
from .results import AllReduceResult, BlockAllReduceResult, NonBlockAllReduceResult

__all__ = ["GradientServer"]



class GradientServer:
    """The coordinator of a data-parallel cluster (entrenar's ``GradientServer``); build it with ``bind``."""

    def __init__(self, config: DistributedConfig, listener: socket.socket) -> None:
        self.config = config
        self._listener = listener
        self._cond = threading.Condition()
        self._pending: list[Peer] = []  # connections that have not joined yet
        self._workers: list[Peer] = []  # joined workers, by id
        self._admission = Admission(config, self._cond, self._pending, self._workers)
        self._all: list[Peer] = []  # every connection ever accepted, for close()
        self._joining = True
        self._total_samples = 0
        self._counts: dict[tuple[type, int | None], int] = {}
        self._ws = Workspace()
        self._poison: BaseException | None = None
        self._shut = False
        self._closed = False
        self._stop = threading.Event()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="gradcoll-coordinator-accept"),
                         threading.Thread(target=self._heartbeat_loop, daemon=True, name="gradcoll-coordinator-beat")]
        for t in self._threads:
            t.start()

    @classmethod
    def bind(cls, config: DistributedConfig) -> "GradientServer":
        """Listen on ``config.bind_addr`` (port 0 picks a free port, see ``local_addr``)."""
        if config.role is not Role.COORDINATOR:
            raise UsageError("GradientServer.bind needs a coordinator config (DistributedConfig.coordinator)")
        host, port = parse_addr(config.bind_addr, "bind_addr")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            listener = socket.create_server((host, port), family=family, backlog=max(16, 2 * config.expect_workers))
        except OSError as e:
            raise TransportBroken(f"coordinator: cannot listen on {host}:{port}: {e.strerror or e}") from e
        try:  # the workers' connections take it from the listener as they open (docs/transports.md, tcp)
            set_congestion(listener, congestion(host))
        except BaseException:
            listener.close()
            raise
        listener.settimeout(POLL_S)
        return cls(config, listener)

    def local_addr(self) -> tuple[str, int]:
        """The ``(host, port)`` the server listens on."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def worker_count(self) -> int:
        """Number of workers that have joined."""
        return len(self._workers)

    def set_total_samples(self, n: int) -> None:
        """Set the dataset size that ``send_shard_assignments`` splits."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise UsageError(f"total_samples must be a non-negative int, got {n!r}")
        self._total_samples = int(n)

    # -- joining -------------------------------------------------------------------
    def wait_for_workers(self) -> None:
        """Accept connections until ``expect_workers`` workers joined (ids 0, 1, .. in join order)."""
        self._usable("wait_for_workers")
        if not self._joining:
            return
        deadline = Deadline(self.config.timeout_s)
        try:
            while len(self._workers) < self.config.expect_workers:
                for p in self._admission.ready(deadline):  # several joins progress at once
                    self._admission.handshake(p)
        except GradcollError as exc:
            self._fail(exc)
        with self._cond:
            self._joining = False
            late = list(self._pending)
        for p in late:
            self._admission.refuse(p, f"the cluster is full ({self.config.expect_workers} workers joined)",
                                   ABORT_PROTOCOL)
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self._workers), thread_name_prefix="gradcoll-send")

    # -- shards ------------------------------------------------------------------------
    def send_shard_assignments(self, step: int) -> None:
        """Send every worker its sample range for ``step`` (``shard_policy`` decides the layout)."""
        self._usable("send_shard_assignments")
        n, policy = len(self._workers), self.config.shard_policy
        if n == 0:
            raise UsageError("coordinator: send_shard_assignments: no workers joined (call wait_for_workers() first)")
        frames = [encode_parts(ShardAssignment(step, *shard_bounds(self._total_samples, n, i, step, policy)), None)
                  for i in range(n)]
        self._send_all("send_shard_assignments", step, lambda i: frames[i])

    # -- collect and reduce ------------------------------------------------------------
    def collect_and_reduce(self, step: int) -> AllReduceResult:
        """Receive every worker's GradientPayload for ``step`` and average it (Jidoka halt on NaN/Inf, F-DP-003)."""
        msgs, avg, ms = self._collect("collect_and_reduce", step, GradientPayload, None, None)
        total = sum(m.total for m in msgs)
        loss = sum(float(m.loss) * m.total for m in msgs) / total if total else 0.0
        # Rounded to f32 as on the wire, so the coordinator and every worker see the same number.
        return AllReduceResult(avg, float(np.float32(loss)), sum(m.correct for m in msgs), total, ms)

    def broadcast_averaged(self, step: int, result: AllReduceResult) -> None:
        """Send ``result`` to every worker as the AveragedGradient of ``step``."""
        self._broadcast("broadcast_averaged", step, AveragedGradient(step, result.avg_gradients, result.global_loss))

    def collect_and_reduce_block(self, step: int, block_idx: int) -> BlockAllReduceResult:
        """Receive every worker's gradient of block ``block_idx`` and average it (C-DDP-001)."""
        msgs, avg, ms = self._collect("collect_and_reduce_block", step, BlockGradientPayload, "block_idx", block_idx)
        return BlockAllReduceResult(block_idx, avg, msgs[0].component_sizes, ms)

    def broadcast_averaged_block(self, step: int, result: BlockAllReduceResult) -> None:
        """Send a block's averaged gradient to every worker."""
        self._broadcast("broadcast_averaged_block", step,
                        AveragedBlockGradient(step, result.block_idx, result.component_sizes, result.avg_gradients))

    def collect_and_reduce_non_block(self, step: int, expected_component: int) -> NonBlockAllReduceResult:
        """Receive every worker's gradient of a non-block component (0 lm_head, 1 final_norm, 2 embedding)."""
        if not isinstance(expected_component, (int, np.integer)) or not 0 <= expected_component <= 255:
            raise UsageError(f"expected_component must be a u8, got {expected_component!r}")
        _, avg, ms = self._collect("collect_and_reduce_non_block", step, NonBlockGradientPayload, "component",
                                   int(expected_component))
        return NonBlockAllReduceResult(int(expected_component), avg, ms)

    def broadcast_averaged_non_block(self, step: int, result: NonBlockAllReduceResult) -> None:
        """Send a non-block component's averaged gradient to every worker."""
        self._broadcast("broadcast_averaged_non_block", step,
                        AveragedNonBlockGradient(step, result.component, result.avg_gradients))

    def _collect(self, op: str, step: int, cls: type, idx_field: str | None,
                 idx: int | None) -> tuple[list[Any], np.ndarray, float]:
        self._usable(op)
        t0 = time.perf_counter()
        peers, n = self._workers, len(self._workers)
        if n == 0:
            raise UsageError(f"coordinator: {op}: no workers joined (call wait_for_workers() first)")
        where = f"{op} step {step}" + (f" {idx_field.replace('_idx', '')} {idx}" if idx_field else "")
        count = self._counts.get((cls, idx))
        rows = None if count is None else self._ws.get("rows", (n, count), np.float32)
        slots: list[Slot | None] = [None] * n
        got: list[Any] = [None] * n
        try:
            with self._cond:
                for i, p in enumerate(peers):
                    if rows is not None and not p.inbox:  # a queued message already arrived elsewhere
                        slots[i] = p.slot = Slot(cls, step, idx_field, idx, rows[i])
            gather(self._cond, self.config, where, step, (cls, idx_field, idx), peers, slots, got)
            ref = got[0]
            for m, p in zip(got[1:], peers[1:], strict=True):
                check_same_shape(where, ref, m, p)
            count = ref.gradients.size
            if rows is None or rows.shape[1] != count:
                rows = self._ws.get("rows", (n, count), np.float32)
            for i, (m, s) in enumerate(zip(got, slots, strict=True)):
                if s is None or m.gradients is not s.row:  # it did not land in place: copy it
                    np.copyto(rows[i], m.gradients)
            self._counts[(cls, idx)] = count
            avg = np.empty(count, np.float32)
            try:
                kernels.mean_reduce(rows, out=avg, op="mean", check_finite=True)
            except NonFiniteError as e:
                raise halt_error(where, step, e, peers) from e
        except GradcollError as exc:
            if not isinstance(exc, UsageError):
                self._fail(exc, step)
            raise
        return got, avg, (time.perf_counter() - t0) * 1000.0

    # -- sending ------------------------------------------------------------------------
    def _broadcast(self, op: str, step: int, msg: Message) -> None:
        self._usable(op)
        parts = encode_parts(msg, self.config.max_frame_bytes)  # one frame for all: the gradient is never copied
        self._send_all(op, step, lambda i: parts)

    def _send_all(self, op: str, step: int, frame_for: Callable[[int], list[Any]]) -> None:
        """Send every worker its frame at the same time (a slow reader delays only itself)."""
        peers, where = self._workers, f"{op} step {step}"

        def send(i: int, p: Peer) -> None:
            if not p.alive:
                raise TransportBroken(f"{p.label} is gone: {p.error or p.conn.broken}", peer=p.worker_id)
            p.conn.send_parts(frame_for(i), self.config.timeout_s)

        errors: list[tuple[Peer, BaseException]] = []
        if len(peers) == 1 or self._pool is None:
            for i, p in enumerate(peers):
                try:
                    send(i, p)
                except GradcollError as e:
                    errors.append((p, e))
        else:
            futures = [(p, self._pool.submit(send, i, p)) for i, p in enumerate(peers)]
            for p, f in futures:
                # Each send is bounded by timeout_s (waiting for the link's lock, then for the bytes to go).
                exc = f.exception(timeout=2 * self.config.timeout_s + 1.0)
                if exc is not None:
                    errors.append((p, exc))
        if errors:
            bad, err = errors[0]
            self._fail(reworded(err, f"{where}: {err}", bad.worker_id), step)  # err names the worker

    # -- failure and shutdown -------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Tell every worker to stop with ``reason`` (an Abort), then poison this server."""
        if self._poison is None and not self._closed:
            try:
                self._fail(GradcollError(f"coordinator: aborted: {reason}"))
            except GradcollError:
                pass

    def _fail(self, exc: BaseException, step: int | None = None) -> None:
        """Tell every worker why the cluster stops, retire every connection, poison the server, raise ``exc``."""
        if self._poison is None:
            self._poison = exc
            log.error("coordinator: stopping the cluster: %s", exc)
            abort = Abort(abort_code(exc), culprit(exc), step, str(exc))
            self._tell_all(lambda p: abort if p.gradcoll else Shutdown(), self._workers + self._pending)
        raise exc

    def _tell_all(self, msg_for: Callable[[Peer], Message], peers: list[Peer]) -> None:
        def tell(p: Peer) -> None:
            if p.alive:
                try:
                    p.conn.send(msg_for(p), min(self.config.timeout_s, LINGER_S), None)
                except GradcollError:
                    pass  # it cannot be told; retiring closes the link, which it sees
            p.retire(min(LINGER_S, self.config.timeout_s))

        with cf.ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
            list(pool.map(tell, peers))

    def shutdown_workers(self) -> None:
        """Send Shutdown to every worker (training is over); the server cannot collect afterwards."""
        if self._shut or self._poison is not None or self._closed:
            return
        self._shut = True
        self._tell_all(lambda p: Shutdown(), self._workers + self._pending)

    def close(self) -> None:
        """Shut the workers down if not done yet, then release the socket and threads. Idempotent."""
        if self._closed:
            return
        self.shutdown_workers()
        with self._cond:  # the accept loop adds (started) peers under this lock, and none once stopped
            self._closed = True
            self._stop.set()
            peers = list(self._all)
        for p in peers:
            p.retire(0.0)
        for p in peers:
            p.thread.join(LINGER_S + 1.0)
            p.stop()
        for t in self._threads:
            t.join(POLL_S * 10)
        self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> "GradientServer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not isinstance(exc, GradcollError):
            self.abort(f"{exc_type.__name__}: {exc}")
        self.close()

    def _usable(self, op: str) -> None:
        if self._poison is not None:
            raise GroupPoisoned(f"coordinator: {op}: the cluster was stopped by an earlier failure "
                                f"({self._poison}); build a new server") from self._poison
        if self._shut or self._closed:
            raise TransportClosed(f"coordinator: {op}: the workers were shut down")

    # -- background threads ------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                if self._stop.is_set():  # close() has taken its list of peers: this one would never be stopped
                    sock.close()
                    return
                if self._joining and self._poison is None:
                    p = Peer(sock, addr, self._cond)
                    p.join_by = time.monotonic() + self._admission.handshake_s
                    p.start()  # started before close() can see it (it joins every peer's thread)
                    self._pending.append(p)
                    self._all.append(p)
                    self._cond.notify_all()
                    continue
            log.warning("coordinator: refused a connection from %s: the cluster is already formed", addr)
            sock.close()

    def _heartbeat_loop(self) -> None:
        cfg = self.config
        while not self._stop.wait(cfg.heartbeat_interval_s):
            for p in list(self._workers):
                if p.gradcoll and p.alive:
                    try:
                        p.conn.try_send(Heartbeat(cfg.node_id, int(time.time() * 1000)), cfg.heartbeat_timeout_s)
                    except GradcollError:
                        pass  # the reader or the next send reports it

"""GradientServer + WorkerClient over real sockets on 127.0.0.1, workers as threads: parity and behaviour.

Parity cases are entrenar's own tests (docs/coordinator.md). The helpers at the top
(``Workers``, ``RawWorker``) are shared with the other coordinator test files.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gradcoll.coordinator import BLOCK_COMPONENTS, DistributedConfig, GradientServer, ShardAssignment, WorkerClient, shard_bounds
from gradcoll.coordinator.protocol import FrameDecoder, JoinAccepted, JoinRequest, Message, encode
from gradcoll.errors import GroupPoisoned, NonFiniteError, TransportClosed, UsageError

TIMEOUT = 5.0


def server_config(n: int, **kw: Any) -> DistributedConfig:
    kw.setdefault("timeout_s", TIMEOUT)
    return DistributedConfig.coordinator("127.0.0.1:0", n, **kw)


def worker_config(addr: Any, **kw: Any) -> DistributedConfig:
    kw.setdefault("timeout_s", TIMEOUT)
    return DistributedConfig.worker(addr, **kw)


class Workers:
    """``n`` worker threads, each running ``fn(client)`` on its own WorkerClient; outcomes by worker id."""

    def __init__(self, addr: Any, fn: Callable[[WorkerClient], Any], n: int, **cfg: Any) -> None:
        self.outcomes: list[tuple[int | None, Any]] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(addr, fn, cfg), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, addr: Any, fn: Callable[[WorkerClient], Any], cfg: dict[str, Any]) -> None:
        wid, value = None, None
        try:
            with WorkerClient.connect(worker_config(addr, **cfg), 1, "cpu") as c:
                wid = c.worker_id()
                value = fn(c)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            value = e
        with self._lock:
            self.outcomes.append((wid, value))

    def join(self, timeout: float = 15.0) -> dict[int | None, Any]:
        """Outcomes (value or exception) by worker id, once every thread is done."""
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a worker thread hangs"
        return dict(self.outcomes)

    def values(self) -> dict[int | None, Any]:
        """Outcomes by worker id; re-raises the first worker exception."""
        out = self.join()
        for v in out.values():
            if isinstance(v, BaseException):
                raise v
        return out

    def errors(self) -> list[BaseException]:
        """Every worker's exception (each worker is expected to fail)."""
        out = self.join()
        assert all(isinstance(v, BaseException) for v in out.values()), out
        return list(out.values())


class RawWorker:
    """A peer that speaks protocol v1 by hand over a plain socket (entrenar stands in)."""

    def __init__(self, addr: Any) -> None:
        self.sock = socket.create_connection(addr, timeout=TIMEOUT)
        self.dec = FrameDecoder()
        self.queue: list[Message] = []

    def send(self, msg: Message | bytes) -> None:
        self.sock.sendall(msg if isinstance(msg, bytes) else encode(msg, None))

    def frame(self) -> bytes:
        """The next whole frame, exactly as received."""
        head = self._exact(4)
        return head + self._exact(int.from_bytes(head, "big"))

    def recv(self) -> Message:
        (msg,) = self.dec.feed(self.frame())
        return msg

    def join(self, node: str = "raw", ext: Any = None) -> JoinAccepted:
        self.send(JoinRequest(node, 1, "cpu", ext))
        msg = self.recv()
        assert isinstance(msg, JoinAccepted), msg
        self.worker_id = msg.worker_id
        return msg

    def at_eof(self) -> bool:
        """True once the other side closed (after everything it sent was read)."""
        return self.sock.recv(1) == b""

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, f"connection closed after {len(buf)} of {n} bytes"
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def serve(srv: GradientServer, body: Callable[[GradientServer], Any]) -> threading.Thread:
    """Run ``body(srv)`` in a thread (for tests whose main thread is a worker); errors end up in ``.error``."""
    def run() -> None:
        try:
            body(srv)
        except BaseException as e:  # noqa: BLE001
            t.error = e  # type: ignore[attr-defined]
    t = threading.Thread(target=run, daemon=True)
    t.error = None  # type: ignore[attr-defined]
    t.start()
    return t


# -- parity with entrenar's tests -----------------------------------------------------------
def test_two_workers_average_and_count_samples():
    data = {0: ([1.0, 2.0], 0.5, 30), 1: ([2.0, 3.0], 1.5, 40)}

    def worker(c: WorkerClient) -> Any:
        shard = c.receive_shard()
        grads, loss, correct = data[c.worker_id()]
        c.send_gradients(shard.step, grads, loss, correct, shard.shard_end - shard.shard_start)
        avg = c.receive_averaged()
        assert c.receive_shard() is None  # Shutdown
        return shard, avg

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        assert srv.worker_count() == 2
        srv.set_total_samples(100)
        srv.send_shard_assignments(0)
        res = srv.collect_and_reduce(0)
        srv.broadcast_averaged(0, res)
        srv.shutdown_workers()
        out = ws.values()
    assert res.avg_gradients.tolist() == [1.5, 2.5]
    assert (res.total_samples, res.total_correct) == (100, 70)
    assert res.global_loss == pytest.approx((0.5 * 50 + 1.5 * 50) / 100)
    assert res.allreduce_ms > 0
    for wid, (shard, avg) in out.items():
        assert shard == ShardAssignment(0, 50 * wid, 50 * wid + 50)
        assert avg.gradients.tolist() == [1.5, 2.5] and avg.step == 0 and avg.global_loss == res.global_loss


def test_blocks_of_one_and_three_average_to_two():
    sizes = [4, 2, 2, 4, 8, 8, 8, 1, 1]

    def worker(c: WorkerClient) -> Any:
        c.send_block_gradient(5, 3, 4, np.full(38, 1.0 + 2 * c.worker_id(), np.float32), sizes)
        return c.receive_averaged_block()

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        res = srv.collect_and_reduce_block(5, 3)
        srv.broadcast_averaged_block(5, res)
        out = ws.values()
    assert res.block_idx == 3 and res.component_sizes == tuple(sizes) and (res.avg_gradients == 2.0).all()
    for r in out.values():
        assert (r.step, r.block_idx, r.component_sizes) == (5, 3, tuple(sizes)) and (r.gradients == 2.0).all()


def test_single_worker_block_round_trip_is_exact():
    sizes = [4, 2, 2, 4, 8, 8, 8, 1, 1]
    assert len(sizes) == len(BLOCK_COMPONENTS)
    g = np.random.default_rng(1).standard_normal(sum(sizes)).astype(np.float32)

    def worker(c: WorkerClient) -> Any:
        c.send_block_gradient(0, 0, 1, g, sizes)
        return c.receive_averaged_block().gradients

    with GradientServer.bind(server_config(1)) as srv:
        ws = Workers(srv.local_addr(), worker, 1)
        srv.wait_for_workers()
        srv.broadcast_averaged_block(0, srv.collect_and_reduce_block(0, 0))
        assert ws.values()[0].tobytes() == g.tobytes()


def test_nan_halts_with_jidoka_text_everywhere():
    def worker(c: WorkerClient) -> Any:
        g = [1.0, np.nan] if c.worker_id() == 1 else [1.0, 2.0]
        c.send_gradients(7, g, 0.1, 1, 1)
        c.receive_averaged()

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        with pytest.raises(NonFiniteError, match="JIDOKA HALT: worker 1 sent non-finite gradient at step 7") as ei:
            srv.collect_and_reduce(7)
        assert ei.value.contributor == 1 and ei.value.index == 1
        errs = ws.errors()
        with pytest.raises(GroupPoisoned):
            srv.collect_and_reduce(8)
    for e in errs:
        assert isinstance(e, NonFiniteError) and str(e).startswith("JIDOKA HALT: worker 1 sent non-finite gradient "
                                                                    "at step 7")


# -- a whole training step, shards, the rank-0 pattern ---------------------------------------
def test_blocks_in_reverse_then_components():
    nb, sizes = 3, [2, 1]

    def worker(c: WorkerClient) -> Any:
        got = []
        while (shard := c.receive_shard()) is not None:
            w = c.worker_id() + 1.0
            for b in reversed(range(nb)):
                c.send_block_gradient(shard.step, b, nb, [w * b, w, -w], sizes)
                got.append(c.receive_averaged_block().gradients.tolist())
            for comp in (0, 1, 2):
                c.send_non_block_gradient(shard.step, comp, np.full(comp + 1, w))
                got.append(c.receive_averaged_non_block().gradients.tolist())
        return got

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        srv.set_total_samples(10)
        for step in range(2):
            srv.send_shard_assignments(step)
            for b in reversed(range(nb)):
                srv.broadcast_averaged_block(step, srv.collect_and_reduce_block(step, b))
            for comp in (0, 1, 2):
                res = srv.collect_and_reduce_non_block(step, comp)
                assert res.component == comp
                srv.broadcast_averaged_non_block(step, res)
        srv.shutdown_workers()
        out = ws.values()
    want = [[1.5 * b, 1.5, -1.5] for b in reversed(range(nb))] + [[1.5] * (c + 1) for c in range(3)]
    assert out[0] == out[1] == want * 2


def test_gradients_land_in_place_and_lengths_may_change_between_steps():
    def worker(c: WorkerClient) -> Any:
        out = []
        for step, n in enumerate([4, 4, 4, 6, 2]):
            c.send_gradients(step, np.arange(n, dtype=np.float32) * (c.worker_id() + 1), 0.0, 0, 1)
            out.append(c.receive_averaged().gradients.tolist())
        return out

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        for step in range(5):
            srv.broadcast_averaged(step, srv.collect_and_reduce(step))
        out = ws.values()
    assert out[0] == out[1] == [(np.arange(n) * 1.5).tolist() for n in [4, 4, 4, 6, 2]]


def test_a_worker_may_send_ahead():
    def worker(c: WorkerClient) -> Any:
        for b in (1, 0):
            c.send_block_gradient(0, b, 2, [float(b + c.worker_id())], [1])
        return [c.receive_averaged_block().gradients[0] for _ in range(2)]

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        for b in (1, 0):
            srv.broadcast_averaged_block(0, srv.collect_and_reduce_block(0, b))
        assert ws.values()[0] == [1.5, 0.5]


@pytest.mark.parametrize("policy", ["fixed", "epoch"])
def test_shard_policies(policy):
    def worker(c: WorkerClient) -> Any:
        out = []
        while (s := c.receive_shard()) is not None:
            out.append((s.shard_start, s.shard_end))
        return out

    with GradientServer.bind(server_config(3, shard_policy=policy)) as srv:
        ws = Workers(srv.local_addr(), worker, 3)
        srv.wait_for_workers()
        srv.set_total_samples(11)
        for step in range(3):
            srv.send_shard_assignments(step)
    out = ws.values()
    slices = [(0, 3), (3, 6), (6, 11)]  # the last worker takes the remainder
    for wid, got in out.items():
        want = [slices[wid]] * 3 if policy == "fixed" else [slices[(wid + s) % 3] for s in range(3)]
        assert got == want


def test_shard_bounds_errors_are_usage_errors():
    with pytest.raises(UsageError, match="no workers joined"):
        shard_bounds(10, 0, 0)
    with pytest.raises(UsageError, match="fewer than the 4 workers"):
        shard_bounds(3, 4, 0)
    with GradientServer.bind(server_config(2)) as srv:
        with pytest.raises(UsageError, match="no workers joined"):
            srv.send_shard_assignments(0)  # before wait_for_workers: a clear error, not a crash
        ws = Workers(srv.local_addr(), lambda c: c.receive_shard(), 2)
        srv.wait_for_workers()
        srv.set_total_samples(1)
        with pytest.raises(UsageError, match="total_samples=1 is fewer than the 2 workers"):
            srv.send_shard_assignments(0)
        srv.set_total_samples(2)
        srv.send_shard_assignments(0)  # the server is still usable: misuse does not poison it
        assert all(isinstance(v, ShardAssignment) for v in ws.values().values())


def test_rank0_runs_the_server_in_a_thread_and_computes_too():
    def coordinate(srv: GradientServer) -> None:
        srv.wait_for_workers()
        srv.set_total_samples(8)
        srv.send_shard_assignments(0)
        srv.broadcast_averaged(0, srv.collect_and_reduce(0))
        srv.shutdown_workers()

    with GradientServer.bind(server_config(2)) as srv:
        t = serve(srv, coordinate)
        other = Workers(srv.local_addr(), lambda c: (c.receive_shard(), c.send_gradients(0, [3.0], 1, 1, 4),
                                                     c.receive_averaged(), c.receive_shard()), 1)
        with WorkerClient.connect(worker_config(srv.local_addr()), 1, "cpu") as me:
            shard = me.receive_shard()
            me.send_gradients(0, [1.0], 0.0, 0, shard.shard_end - shard.shard_start)
            mine = me.receive_averaged()
            assert me.receive_shard() is None
        t.join(TIMEOUT)
        assert t.error is None
        theirs = next(iter(other.values().values()))
    assert mine.gradients.tolist() == theirs[2].gradients.tolist() == [2.0]


def test_context_manager_shuts_workers_down_and_closed_clients_say_so():
    clients: list[WorkerClient] = []

    def worker(c: WorkerClient) -> Any:
        clients.append(c)
        return c.receive_shard()

    with GradientServer.bind(server_config(1)) as srv:
        ws = Workers(srv.local_addr(), worker, 1)
        srv.wait_for_workers()
    assert ws.values() == {0: None}
    with pytest.raises(TransportClosed, match="shut the cluster down"):
        clients[0].receive_shard()
    with pytest.raises(TransportClosed, match="shut down"):
        srv.collect_and_reduce(0)


def test_sender_refuses_frames_over_the_cap_and_stays_usable():
    def worker(c: WorkerClient) -> Any:
        with pytest.raises(UsageError, match="exceeds max_frame_bytes"):
            c.send_gradients(0, np.zeros(100, np.float32), 0, 0, 0)
        c.send_gradients(0, np.zeros(10, np.float32), 0, 0, 0)
        return c.receive_averaged().gradients.size

    with GradientServer.bind(server_config(1, max_frame_bytes=200)) as srv:
        ws = Workers(srv.local_addr(), worker, 1, max_frame_bytes=200)
        srv.wait_for_workers()
        srv.broadcast_averaged(0, srv.collect_and_reduce(0))
        assert ws.values() == {0: 10}


def test_empty_gradients_reduce_only_the_metrics():
    def worker(c: WorkerClient) -> Any:
        c.send_gradients(0, [], 2.0, 1, 0)
        return c.receive_averaged()

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        res = srv.collect_and_reduce(0)
        srv.broadcast_averaged(0, res)
        ws.values()
    assert res.avg_gradients.size == 0 and res.global_loss == 0.0 and res.total_correct == 2


def test_config_validation():
    with pytest.raises(UsageError, match="needs coordinator_addr"):
        DistributedConfig("worker")
    with pytest.raises(UsageError, match="expect_workers >= 1"):
        DistributedConfig.coordinator("127.0.0.1:0", 0)
    with pytest.raises(UsageError, match="heartbeat_interval_ms"):
        DistributedConfig.worker("h:1", heartbeat_interval_ms=10, heartbeat_timeout_ms=5)
    with pytest.raises(UsageError, match="shard_policy"):
        DistributedConfig.coordinator("127.0.0.1:0", 1, shard_policy="random")
    with pytest.raises(UsageError, match="host:port"):
        DistributedConfig.worker("nohost")
    cfg = DistributedConfig.worker("[::1]:9000", secret="s3")
    assert cfg.secret_key == b"s3" and "s3" not in repr(cfg)
    assert DistributedConfig.worker(("10.0.0.1", 5)).node_id  # hostname-pid by default
    with pytest.raises(UsageError, match="coordinator config"):
        GradientServer.bind(cfg)
    with pytest.raises(UsageError, match="worker config"):
        WorkerClient.connect(server_config(1))


def test_close_while_a_connection_is_being_admitted_waits_for_it_and_stops_it(monkeypatch) -> None:
    """close() raced the accept loop: a peer listed before its reader thread started made close() join a thread
    that had not started (RuntimeError)."""
    from gradcoll.coordinator import _peers

    entered, release, errors = threading.Event(), threading.Event(), []
    real = _peers.Peer.start

    def held_start(self: Any) -> None:
        entered.set()
        release.wait(10)
        real(self)

    monkeypatch.setattr(_peers.Peer, "start", held_start)
    server = GradientServer.bind(server_config(1))
    sock = socket.create_connection(server.local_addr(), timeout=5)
    try:
        assert entered.wait(10)  # the accept loop is admitting the connection

        def close() -> None:
            try:
                server.close()
            except BaseException as e:  # noqa: BLE001 - reported to the test
                errors.append(e)

        closer = threading.Thread(target=close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # close() waits for the admission in progress
        release.set()
        closer.join(10)
        assert not closer.is_alive() and errors == []
    finally:
        release.set()
        sock.close()
        server.close()

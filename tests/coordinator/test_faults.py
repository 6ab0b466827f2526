"""Failure paths of the coordinator: every failure tells every worker why, names the culprit, never hangs.

Mismatches, NaN, dead and silent workers, a silent coordinator, oversized
frames, strangers with random bytes, missing or wrong secrets, timeouts.
Misbehaving peers are often ``RawWorker``s that write protocol bytes by hand.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from gradcoll.coordinator import GradientServer, WorkerClient
from gradcoll.coordinator.protocol import (
    Abort,
    AuthChallenge,
    AuthResponse,
    BlockGradientPayload,
    Extension,
    GradientPayload,
    JoinAccepted,
    JoinRequest,
    encode,
)
from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, GroupPoisoned, ProtocolError, TransportBroken, UsageError
from tests.coordinator.test_cluster import TIMEOUT, RawWorker, Workers, serve, server_config, worker_config

SHUTDOWN = bytes.fromhex("00000001 07")


def _plain(c: WorkerClient, step: int, n: int = 2) -> None:
    c.send_gradients(step, np.ones(n, np.float32), 0.0, 0, 1)
    c.receive_averaged()


def _bad(kind: str):
    """Worker 1 does something wrong for ``kind``; worker 0 does it right."""
    def worker(c: WorkerClient) -> Any:
        bad = c.worker_id() == 1
        if kind == "step":
            _plain(c, 4 if bad else 3)
        elif kind == "length":
            _plain(c, 3, 3 if bad else 2)
        elif kind == "type":
            if bad:
                c.send_non_block_gradient(3, 0, [1.0, 1.0])
                c.receive_averaged_non_block()
            else:
                _plain(c, 3)
        elif kind in ("block", "sizes"):
            sizes = [2, 0] if bad and kind == "sizes" else [1, 1]
            c.send_block_gradient(3, 1 if bad and kind == "block" else 2, 4, [1.0, 1.0], sizes)
            c.receive_averaged_block()
        elif kind == "component":
            c.send_non_block_gradient(3, 2 if bad else 1, [1.0])
            c.receive_averaged_non_block()
    return worker


COLLECT = {
    "step": lambda s: s.collect_and_reduce(3),
    "length": lambda s: s.collect_and_reduce(3),
    "type": lambda s: s.collect_and_reduce(3),
    "block": lambda s: s.collect_and_reduce_block(3, 2),
    "sizes": lambda s: s.collect_and_reduce_block(3, 2),
    "component": lambda s: s.collect_and_reduce_non_block(3, 1),
}
TEXT = {
    "step": r"worker 1 \(node .*\): step mismatch: expected 3, got 4",
    "length": "length mismatch: worker 0 sent 2 gradients, worker 1 sent 3",
    "type": r"expected GradientPayload from worker 1 \(node .*\), got NonBlockGradientPayload",
    "block": r"worker 1 \(node .*\): block_idx mismatch: expected 2, got 1",
    "sizes": r"component sizes mismatch: worker 0 sent \[1, 1\], worker 1 sent \[2, 0\]",
    "component": r"worker 1 \(node .*\): component mismatch: expected 1, got 2",
}


@pytest.mark.parametrize("kind", list(COLLECT))
def test_a_mismatch_aborts_every_worker(kind):
    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), _bad(kind), 2)
        srv.wait_for_workers()
        with pytest.raises(CollectiveMismatch, match=TEXT[kind]):
            COLLECT[kind](srv)
        errs = ws.errors()
        with pytest.raises(GroupPoisoned, match="stopped by an earlier failure"):
            srv.collect_and_reduce(4)
    for e in errs:
        assert isinstance(e, CollectiveMismatch)
        assert "the coordinator aborted the cluster" in str(e)
        assert "step 3" in str(e)


def _raw_and_real(srv: GradientServer, raw_ext: Any = None, real=lambda c: _plain(c, 0)) -> tuple[RawWorker, Workers]:
    """One RawWorker and one real worker, joined (ids in join order)."""
    t = serve(srv, lambda s: s.wait_for_workers())
    raw = RawWorker(srv.local_addr())
    raw.join("raw", raw_ext)
    ws = Workers(srv.local_addr(), real, 1)
    t.join(TIMEOUT)
    assert t.error is None
    return raw, ws


def test_component_sizes_must_sum_to_the_length():
    def real(c: WorkerClient) -> None:
        with pytest.raises(UsageError, match="sum to 1 but gradients has 2"):  # a gradcoll worker refuses to send it
            c.send_block_gradient(0, 0, 1, [1.0, 2.0], [1])
        c.send_block_gradient(0, 0, 1, [1.0, 2.0], [2])
        c.receive_averaged_block()

    with GradientServer.bind(server_config(2)) as srv:
        raw, ws = _raw_and_real(srv, real=real)
        raw.send(BlockGradientPayload(0, raw.worker_id, 0, 1, [1], [1.0, 2.0]))
        with pytest.raises(CollectiveMismatch, match=r"worker \d \(node raw\): component sizes \[1\] sum to 1 but "
                                                     "the gradient has 2 elements"):
            srv.collect_and_reduce_block(0, 0)
        (err,) = ws.errors()
        assert isinstance(err, CollectiveMismatch) and "sum to 1" in str(err)
        assert raw.frame() == SHUTDOWN and raw.at_eof()  # an entrenar worker cannot read Abort: it gets Shutdown
        raw.close()


def test_the_worker_id_field_must_be_the_senders():
    with GradientServer.bind(server_config(2)) as srv:
        raw, ws = _raw_and_real(srv)
        raw.send(GradientPayload(0, 7, [1.0, 1.0], 0.0, 0, 1))
        with pytest.raises(CollectiveMismatch, match="node raw.*worker_id mismatch: it sent worker_id 7"):
            srv.collect_and_reduce(0)
        assert isinstance(ws.errors()[0], CollectiveMismatch)
        raw.close()


def test_a_slow_worker_does_not_delay_detecting_another_ones_fault():
    release = threading.Event()

    def worker(c: WorkerClient) -> Any:
        if c.worker_id() == 0:
            release.wait(TIMEOUT)  # silent for now: a head-of-line reader would block here
            _plain(c, 0)
        else:
            _plain(c, 99)

    with GradientServer.bind(server_config(2)) as srv:
        ws = Workers(srv.local_addr(), worker, 2)
        srv.wait_for_workers()
        t0 = time.monotonic()
        with pytest.raises(CollectiveMismatch, match="worker 1 .*step mismatch"):
            srv.collect_and_reduce(0)
        assert time.monotonic() - t0 < TIMEOUT / 2
        release.set()
        assert all(isinstance(e, CollectiveMismatch) for e in ws.errors())


def test_a_worker_that_closes_its_socket_is_dead():
    with GradientServer.bind(server_config(2)) as srv:
        raw, ws = _raw_and_real(srv)
        raw.close()
        with pytest.raises(TransportBroken, match=rf"collect_and_reduce step 0: worker {raw.worker_id} \(node raw\) "
                                                  "failed: .*closed the connection"):
            srv.collect_and_reduce(0)
        (err,) = ws.errors()
        assert isinstance(err, TransportBroken) and f"worker {raw.worker_id} (node raw)" in str(err)


def test_a_gradcoll_worker_that_stops_heartbeating_is_dead():
    cfg = server_config(2, heartbeat_interval_ms=50, heartbeat_timeout_ms=300)
    with GradientServer.bind(cfg) as srv:
        raw, ws = _raw_and_real(srv, raw_ext=Extension())  # claims heartbeats, then sends nothing
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"worker \d \(node raw\) is dead: no heartbeat for \d+ ms "
                                                    r"\(heartbeat_timeout_ms=300\)") as ei:
            srv.collect_and_reduce(0)
        assert time.monotonic() - t0 < TIMEOUT / 2 and ei.value.missing == [raw.worker_id]
        (err,) = ws.errors()
        assert isinstance(err, CollectiveTimeout) and "no heartbeat" in str(err)
        raw.close()


def test_a_worker_notices_a_silent_coordinator():
    with socket.create_server(("127.0.0.1", 0)) as lst:
        def fake() -> None:  # answers the join as a gradcoll coordinator would, then goes silent
            conn, _ = lst.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(encode(JoinAccepted(0, 1, Extension())))
                while conn.recv(1 << 16):  # its heartbeats, until it gives up and closes
                    pass
        t = threading.Thread(target=fake, daemon=True)
        t.start()
        cfg = worker_config(lst.getsockname(), heartbeat_interval_ms=50, heartbeat_timeout_ms=300)
        with WorkerClient.connect(cfg, 1, "cpu") as c:
            with pytest.raises(CollectiveTimeout, match=r"worker 0 \(node .*\): receive_shard: the coordinator is "
                                                        "dead: no heartbeat"):
                c.receive_shard()
            with pytest.raises(GroupPoisoned):
                c.receive_shard()
        t.join(TIMEOUT)


def test_a_worker_that_stops_reading_times_out_the_broadcast():
    with GradientServer.bind(server_config(1, timeout_s=0.5)) as srv:
        t = serve(srv, lambda s: s.wait_for_workers())
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small, so the coordinator's sends back up
        raw.connect(srv.local_addr())
        raw.sendall(encode(JoinRequest("raw", 1, "cpu")))
        t.join(TIMEOUT)
        n = 4_000_000  # 16 MB: more than every socket buffer on the way
        raw.sendall(encode(GradientPayload(0, 0, np.zeros(n, np.float32), 0.0, 0, 1)))
        res = srv.collect_and_reduce(0)
        with pytest.raises(CollectiveTimeout, match=r"broadcast_averaged step 0: sending to worker 0 \(node raw\) "
                                                    r"timed out after 0.5s \(the peer stopped reading\)"):
            srv.broadcast_averaged(0, res)  # the raw worker never reads
        with pytest.raises(GroupPoisoned):
            srv.broadcast_averaged(0, res)
        raw.close()


def test_an_entrenar_worker_that_sends_nothing_times_out_by_name():
    with GradientServer.bind(server_config(2, timeout_s=0.5)) as srv:
        raw, ws = _raw_and_real(srv)  # entrenar workers send no heartbeats: only timeout_s applies
        with pytest.raises(CollectiveTimeout, match=rf"no gradient within 0.5s from worker {raw.worker_id} "
                                                    r"\(node raw\)"):
            srv.collect_and_reduce(0)
        assert isinstance(ws.errors()[0], CollectiveTimeout)
        assert raw.frame() == SHUTDOWN
        raw.close()


def test_wait_for_workers_times_out_and_tells_the_joined():
    with GradientServer.bind(server_config(2, timeout_s=0.5)) as srv:
        ws = Workers(srv.local_addr(), lambda c: c.receive_shard(), 1, timeout_s=TIMEOUT)
        with pytest.raises(CollectiveTimeout, match=r"1 of 2 workers joined within 0.5s \(joined: worker 0"):
            srv.wait_for_workers()
        (err,) = ws.errors()
        assert isinstance(err, CollectiveTimeout) and "1 of 2 workers joined" in str(err)


@pytest.mark.parametrize("garbage,text", [
    (bytes.fromhex("00001388") + b"x" * 10, "message too large: 5000 bytes"),
    (bytes.fromhex("00000005 99 01020304"), "unknown message tag: 0x99"),
])
def test_bad_frames_from_a_joined_worker(garbage, text):
    with GradientServer.bind(server_config(2, max_frame_bytes=1000)) as srv:
        raw, ws = _raw_and_real(srv)
        raw.send(garbage)
        with pytest.raises(ProtocolError, match=rf"worker {raw.worker_id} \(node raw\) failed: {text}"):
            srv.collect_and_reduce(0)
        (err,) = ws.errors()
        assert isinstance(err, ProtocolError) and text in str(err)
        raw.close()


def test_strangers_are_refused_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="gradcoll.coordinator")
    with GradientServer.bind(server_config(2)) as srv:
        t = serve(srv, lambda s: s.wait_for_workers())
        strangers = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes.fromhex("00000003 42 4242"),
                     encode(GradientPayload(0, 0, [1.0], 0, 0, 0))]
        for junk in strangers:
            s = RawWorker(srv.local_addr())
            s.send(junk)
            assert s.at_eof()  # refused: the server closed on it
            s.close()
        ws = Workers(srv.local_addr(), lambda c: _plain(c, 0), 2)
        t.join(TIMEOUT)
        assert t.error is None
        srv.broadcast_averaged(0, srv.collect_and_reduce(0))
        ws.values()
    log = caplog.text
    assert "refused connection from 127.0.0.1" in log
    assert "message too large: 1195725856 bytes" in log
    assert "unknown message tag: 0x42" in log
    assert "sent GradientPayload where JoinRequest was expected" in log


def test_secret_admits_workers_that_know_it():
    with GradientServer.bind(server_config(2, secret="s3cr3t")) as srv:
        ws = Workers(srv.local_addr(), lambda c: _plain(c, 0), 2, secret="s3cr3t")
        srv.wait_for_workers()
        srv.broadcast_averaged(0, srv.collect_and_reduce(0))
        ws.values()


def test_secret_refuses_workers_that_do_not_know_it(caplog):
    caplog.set_level(logging.WARNING, logger="gradcoll.coordinator")
    with GradientServer.bind(server_config(1, secret="s3cr3t")) as srv:
        t = serve(srv, lambda s: s.wait_for_workers())
        addr = srv.local_addr()
        with pytest.raises(ProtocolError, match="requires a shared secret"):
            WorkerClient.connect(worker_config(addr), 1, "cpu")
        with pytest.raises(ProtocolError, match="could not prove it knows the shared secret"):
            WorkerClient.connect(worker_config(addr, secret="wrong"), 1, "cpu")
        plain = RawWorker(addr)  # an entrenar worker cannot authenticate at all
        plain.send(JoinRequest("plain", 1, "cpu"))
        assert plain.at_eof()
        forger = RawWorker(addr)  # claims to know the secret, answers with a made-up MAC
        forger.send(JoinRequest("forger", 1, "cpu", Extension(flags=1, nonce=b"n" * 16)))
        assert isinstance(forger.recv(), AuthChallenge)
        forger.send(AuthResponse(b"\0" * 32))
        abort = forger.recv()
        assert isinstance(abort, Abort) and "authentication failed" in abort.reason
        plain.close()
        forger.close()
        ws = Workers(addr, lambda c: c.worker_id(), 1, secret="s3cr3t")
        t.join(TIMEOUT)
        assert t.error is None and srv.worker_count() == 1
    assert ws.values() == {0: 0}
    log = caplog.text
    for text in ("it has no secret", "cannot authenticate (plain entrenar worker?)", "authentication failed",
                 "node forger"):
        assert text in log


def test_a_worker_with_a_secret_refuses_an_unauthenticated_coordinator():
    with GradientServer.bind(server_config(1, timeout_s=1.0)) as srv:
        t = serve(srv, lambda s: s.wait_for_workers())
        with pytest.raises(ProtocolError, match="accepted us without authenticating"):
            WorkerClient.connect(worker_config(srv.local_addr(), secret="s3cr3t"), 1, "cpu")
        t.join(TIMEOUT)


def test_shutdown_during_allreduce_is_an_error_for_the_worker():
    def worker(c: WorkerClient) -> Any:
        c.send_gradients(0, [1.0], 0, 0, 1)
        c.receive_averaged()

    with GradientServer.bind(server_config(1)) as srv:
        ws = Workers(srv.local_addr(), worker, 1)
        srv.wait_for_workers()
        srv.shutdown_workers()
        (err,) = ws.errors()
    assert "shutdown during AllReduce" in str(err)


def test_an_entrenar_worker_gets_shutdown_when_the_cluster_halts():
    with GradientServer.bind(server_config(2)) as srv:
        raw, ws = _raw_and_real(srv)
        raw.send(GradientPayload(0, raw.worker_id, [np.nan, 1.0], 0.0, 0, 1))
        with pytest.raises(Exception, match=f"JIDOKA HALT: worker {raw.worker_id} sent non-finite gradient at step 0"):
            srv.collect_and_reduce(0)
        assert raw.frame() == SHUTDOWN and raw.at_eof()
        assert "JIDOKA HALT" in str(ws.errors()[0])
        raw.close()

"""Byte compatibility with entrenar: raw-socket peers that speak only protocol v1, written out by hand.

There is no Rust peer here, so each side of the claim is shown with a fake
that reads and writes exact bytes (docs/wire.md): an entrenar worker in a gradcoll
cluster (next to a gradcoll worker), and a gradcoll worker joining an
entrenar coordinator. Neither fake ever sees a gradcoll-only frame: no
heartbeat, no Abort, no auth. The fakes leave a short window open where a
wrongly sent heartbeat (every 50 ms) would show up in the byte stream.
"""

from __future__ import annotations

import socket
import struct
import threading

from gradcoll.coordinator import GradientServer, WorkerClient
from tests.coordinator.test_cluster import TIMEOUT, Workers, serve, server_config, worker_config

WINDOW_S = 0.3  # several heartbeat intervals: long enough for a stray heartbeat to appear


def h(text: str) -> bytes:
    return bytes.fromhex("".join(line.split("#")[0] for line in text.splitlines()))


def read_frame(sock: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = sock.recv(4 if len(buf) < 4 else 4 + int.from_bytes(buf[:4], "big") - len(buf))
        assert chunk, f"closed after {len(buf)} bytes"
        buf += chunk
    return buf


def test_an_entrenar_worker_in_a_gradcoll_cluster():
    def coordinate(srv: GradientServer) -> None:
        srv.wait_for_workers()
        srv.set_total_samples(100)
        srv.send_shard_assignments(0)
        res = srv.collect_and_reduce(0)
        threading.Event().wait(2 * WINDOW_S)  # the gradcoll worker (300 ms heartbeat timeout) lives on heartbeats
        srv.broadcast_averaged(0, res)
        srv.shutdown_workers()

    def gradcoll_worker(c: WorkerClient) -> list[float]:
        s = c.receive_shard()
        c.send_gradients(0, [3.0, 5.0], 1.5, 10, s.shard_end - s.shard_start)
        avg = c.receive_averaged()
        assert c.receive_shard() is None
        return avg.gradients.tolist()

    cfg = server_config(2, heartbeat_interval_ms=50, heartbeat_timeout_ms=1000)
    with GradientServer.bind(cfg) as srv:
        t = serve(srv, coordinate)
        rust = socket.create_connection(srv.local_addr(), timeout=TIMEOUT)
        rust.sendall(h("00000012 01 02000000 6e31 02000000 03000000 637075"))  # JoinRequest "n1", 2 GPUs, "cpu"
        assert read_frame(rust) == h("00000009 02 00000000 02000000")  # JoinAccepted: worker 0 of 2, no trailer
        ws = Workers(srv.local_addr(), gradcoll_worker, 1, heartbeat_interval_ms=50, heartbeat_timeout_ms=300)
        assert read_frame(rust) == h("00000019 03 0000000000000000 0000000000000000 3200000000000000")  # [0, 50)
        threading.Event().wait(WINDOW_S)
        rust.sendall(h("""
            00000031 04 0000000000000000 00000000      # GradientPayload step 0, worker 0
            0200000000000000 0000803f 00004040         # [1.0, 3.0]
            0000003f 2800000000000000 3200000000000000 # loss 0.5, correct 40, total 50
        """))
        # mean [2.0, 4.0]; global loss (0.5*50 + 1.5*50) / 100 = 1.0
        assert read_frame(rust) == h("0000001d 05 0000000000000000 0200000000000000 00000040 00008040 0000803f")
        assert read_frame(rust) == h("00000001 07")  # Shutdown, and nothing else ever came
        rust.close()
        assert ws.values() == {1: [2.0, 4.0]}
        t.join(TIMEOUT)
        assert t.error is None


def _entrenar_v1_join(payload: bytes) -> tuple[str, int, str, bytes]:
    """Decode a JoinRequest payload the way a v1 reader does; returns the fields and the ignored rest."""
    assert payload[0] == 0x01
    (n,) = struct.unpack_from("<I", payload, 1)
    node = payload[5 : 5 + n].decode()
    gpus, m = struct.unpack_from("<II", payload, 5 + n)
    backend = payload[13 + n : 13 + n + m].decode()
    return node, gpus, backend, payload[13 + n + m :]


def test_a_gradcoll_worker_with_an_entrenar_coordinator():
    seen: dict[str, object] = {}

    def entrenar(lst: socket.socket) -> None:
        conn, _ = lst.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            seen["join"] = _entrenar_v1_join(read_frame(conn)[4:])
            conn.sendall(h("00000009 02 00000000 01000000"))  # JoinAccepted(0, 1), v1 bytes only
            threading.Event().wait(WINDOW_S)  # a heartbeat sent to entrenar would arrive now
            conn.sendall(h("00000019 03 0000000000000000 0000000000000000 0a00000000000000"))
            seen["grad"] = read_frame(conn)
            conn.sendall(h("0000001d 05 0000000000000000 0200000000000000 0000803e 00000080 00000040"))
            seen["block"] = read_frame(conn)
            conn.sendall(h("0000002d 09 0000000000000000 01000000 02000000 02000000 01000000 "
                           "0300000000000000 0000803f 00000040 00004040"))
            seen["nonblock"] = read_frame(conn)
            conn.sendall(h("00000016 0b 0000000000000000 02 0100000000000000 000080bf"))
            conn.sendall(h("00000001 07"))
            seen["eof"] = conn.recv(1)  # the worker closes after Shutdown, having sent nothing else

    with socket.create_server(("127.0.0.1", 0)) as lst:
        t = threading.Thread(target=entrenar, args=(lst,), daemon=True)
        t.start()
        cfg = worker_config(lst.getsockname(), node_id="w-interop", heartbeat_interval_ms=50, heartbeat_timeout_ms=100)
        with WorkerClient.connect(cfg, 4, "cuda") as c:
            assert (c.worker_id(), c.total_workers()) == (0, 1)
            shard = c.receive_shard()
            assert (shard.step, shard.shard_start, shard.shard_end) == (0, 0, 10)
            c.send_gradients(0, [0.25, -0.0], 2.0, 3, 10)
            avg = c.receive_averaged()  # silence longer than 100 ms is fine: entrenar sends no heartbeats
            c.send_block_gradient(0, 1, 2, [1.0, 2.0, 3.0], [2, 1])
            blk = c.receive_averaged_block()
            c.send_non_block_gradient(0, 2, [-1.0])
            nb = c.receive_averaged_non_block()
            assert c.receive_shard() is None
        t.join(TIMEOUT)
    node, gpus, backend, rest = seen["join"]  # type: ignore[misc]
    assert (node, gpus, backend) == ("w-interop", 4, "cuda") and rest.startswith(b"GCX")  # trailer: ignored by v1
    assert seen["grad"] == h("""
        00000031 04 0000000000000000 00000000                 # GradientPayload step 0, worker 0
        0200000000000000 0000803e 00000080                    # [0.25, -0.0]
        00000040 0300000000000000 0a00000000000000            # loss 2.0, correct 3, total 10
    """)
    assert seen["block"] == h("""
        00000035 08 0000000000000000 00000000 01000000 02000000  # step 0, worker 0, block 1 of 2
        02000000 02000000 01000000                               # component sizes [2, 1]
        0300000000000000 0000803f 00000040 00004040
    """)
    assert seen["nonblock"] == h("0000001a 0a 0000000000000000 00000000 02 0100000000000000 000080bf")
    assert seen["eof"] == b""
    assert avg.gradients.view("<u4").tolist() == [0x3E800000, 0x80000000] and avg.global_loss == 2.0
    assert (blk.block_idx, blk.component_sizes, blk.gradients.tolist()) == (1, (2, 1), [1.0, 2.0, 3.0])
    assert (nb.component, nb.gradients.tolist()) == (2, [-1.0])

"""The sync service over gRPC: peers in separate processes, timeouts, tokens, bad bytes."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import numpy as np
import pytest

pytest.importorskip("pyarrow")
grpc = pytest.importorskip("grpc")

from gradcoll import kernels  # noqa: E402
from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, TransportBroken, UsageError  # noqa: E402
from gradcoll.sync import (  # noqa: E402
    AuthenticationError,
    FileBlockStore,
    GradientSyncClient,
    GradientSyncRequest,
    GradientSyncService,
    ServerThread,
    store_gradient_as_arrow,
)
from gradcoll.sync.grpc_server import METHOD  # noqa: E402

ELEMENTS = 150_000  # three chunks, the last one short


def _gradient(peer: str) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, peer)))
    return rng.standard_normal(ELEMENTS).astype(np.float32)


def _peer_process(address: str, peer: str, min_peers: int, timeout: float, conn) -> None:
    """One peer: join the session over gRPC and send back what it got."""

    async def run():
        async with GradientSyncClient(address, connect_timeout=20) as client:
            data = store_gradient_as_arrow(_gradient(peer))
            return await client.collect(GradientSyncRequest("mp-round", data, min_peers, timeout, peer_id=peer))

    try:
        r = asyncio.run(run())
        conn.send(
            {
                "peers": {p: g.tobytes() for p, g in r.peers.items()},
                "local": r.local.tobytes(),
                "aggregate": r.aggregate.tobytes(),
                "timed_out": r.summary.timed_out,
            }
        )
    except BaseException as exc:  # reported to the test, which fails with it
        conn.send({"error": repr(exc)})
    finally:
        conn.close()


@pytest.fixture
def server(tmp_path):
    srv = ServerThread(GradientSyncService(FileBlockStore(tmp_path / "store")))
    srv.start()
    yield srv
    srv.stop()


def _req(session, values, min_peers=0, timeout=5.0, **kw):
    data = store_gradient_as_arrow(np.asarray(values, np.float32))
    return GradientSyncRequest(session, data, min_peers, timeout, **kw)


def test_three_processes_exchange_gradients(server):
    ctx = multiprocessing.get_context("spawn")
    peers = ["alpha", "bravo", "charlie"]
    pipes, procs = {}, []
    for p in peers:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_peer_process, args=(server.address, p, 2, 60.0, child), daemon=True)
        proc.start()
        child.close()
        pipes[p] = parent
        procs.append(proc)
    try:
        got = {}
        for p, conn in pipes.items():
            assert conn.poll(90), f"peer {p} did not report"
            got[p] = conn.recv()
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    expected = {p: _gradient(p) for p in peers}
    fedavg = kernels.mean_reduce([expected[p] for p in sorted(peers)])
    for p, r in got.items():
        assert "error" not in r, f"peer {p}: {r.get('error')}"
        assert not r["timed_out"]
        assert sorted(r["peers"]) == sorted(set(peers) - {p})
        assert r["local"] == expected[p].tobytes()
        for q, data in r["peers"].items():
            assert data == expected[q].tobytes(), f"peer {p} got a wrong gradient for {q}"
        assert r["aggregate"] == fedavg.tobytes(), f"peer {p} got a wrong FedAvg"


def test_peer_that_never_arrives_ends_the_others_at_the_timeout(server):
    async def main():
        async with GradientSyncClient(server.address) as client:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(client.collect(_req("late", [float(i)] * 3, 2, 1.0)) for i in range(2)))
            return rs, time.monotonic() - t0

    results, elapsed = asyncio.run(main())
    assert 1.0 <= elapsed < 10
    for r in results:
        assert r.summary.timed_out and r.summary.peers_received == 1 and r.summary.min_peers == 2
        assert r.aggregate.tolist() == [0.5] * 3


def test_errors_cross_the_wire_as_gradcoll_errors(server):
    async def main():
        async with GradientSyncClient(server.address) as client:
            with pytest.raises(CollectiveTimeout, match="got 0 of 1 peers"):
                await client.collect(_req("strict", [1.0], 1, 0.2, strict=True))
            await client.collect(_req("m", [1.0, 2.0], peer_id="a"))
            with pytest.raises(CollectiveMismatch, match="peer 'b' contributed 1 elements"):
                await client.collect(_req("m", [1.0], peer_id="b"))
            with pytest.raises(UsageError, match="decode local gradient"):
                await client.collect(GradientSyncRequest("m", b"not arrow", 0, 1.0))
            q = asyncio.Queue()
            summary = await client.sync_gradients(_req("q", np.ones(70_000)), q)
            chunks = []
            while (c := await q.get()) is not None:
                chunks.append(c)
            return summary, chunks

    summary, chunks = asyncio.run(main())
    assert [(c.chunk_index, c.total_chunks, c.peer_id) for c in chunks] == [(0, 2, "local"), (1, 2, "local")]
    assert summary.elements == 70_000


def test_malformed_bytes_get_invalid_argument_and_the_server_survives(server):
    async def main():
        async with grpc.aio.insecure_channel(server.address) as ch:
            call = ch.unary_stream(METHOD)(b"\x00garbage", timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        async with GradientSyncClient(server.address) as client:
            return await client.collect(_req("after", [2.0]))

    assert asyncio.run(main()).aggregate.tolist() == [2.0]


def test_token_is_required_when_configured(tmp_path):
    srv = ServerThread(GradientSyncService(FileBlockStore(tmp_path)), token="s3cret")
    srv.start()
    try:

        async def main():
            for token in (None, "wrong"):
                async with GradientSyncClient(srv.address, token=token) as client:
                    with pytest.raises(AuthenticationError):
                        await client.collect(_req("t", [1.0]))
            async with GradientSyncClient(srv.address, token="s3cret") as client:
                return await client.collect(_req("t", [1.0]))

        assert asyncio.run(main()).aggregate.tolist() == [1.0]
    finally:
        srv.stop()


def test_the_groups_secret_authenticates_the_sync_service(tmp_path, monkeypatch):
    """With GRADCOLL_SECRET (or secret=) and no token, both ends use the token derived from the secret."""
    monkeypatch.setenv("GRADCOLL_SECRET", "group-secret")
    srv = ServerThread(GradientSyncService(FileBlockStore(tmp_path)))  # the secret from the environment
    srv.start()
    try:

        async def main():
            for secret in ("other", None):
                if secret is None:
                    monkeypatch.delenv("GRADCOLL_SECRET")
                async with GradientSyncClient(srv.address, secret=secret) as client:
                    with pytest.raises(AuthenticationError):
                        await client.collect(_req("s", [1.0]))
            async with GradientSyncClient(srv.address, secret=b"group-secret") as client:
                return await client.collect(_req("s", [1.0]))

        assert asyncio.run(main()).aggregate.tolist() == [1.0]
    finally:
        srv.stop()


def test_server_binds_loopback_by_default(server):
    assert server.address.startswith("127.0.0.1:")


def test_unreachable_server_fails_within_the_connect_timeout(server):
    port = server.server.port
    server.stop()

    async def main():
        async with GradientSyncClient(f"127.0.0.1:{port}", connect_timeout=0.5) as client:
            with pytest.raises(TransportBroken, match="cannot reach"):
                await client.collect(_req("x", [1.0]))

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 5


def test_flipped_byte_in_a_stored_block_reaches_the_client_as_corruption(tmp_path):
    from gradcoll.sync import CorruptBlock

    root = tmp_path / "store"
    srv = ServerThread(GradientSyncService(FileBlockStore(root)))
    srv.start()
    try:

        async def main():
            async with GradientSyncClient(srv.address) as client:
                await client.collect(_req("c", np.ones(70_000), peer_id="a"))
                for path in root.glob("??/*"):  # every block of peer a
                    raw = bytearray(path.read_bytes())
                    raw[len(raw) // 2] ^= 0x10
                    path.write_bytes(bytes(raw))
                with pytest.raises(CorruptBlock, match="corrupted"):
                    await client.collect(_req("c", np.zeros(70_000), 1, 5.0, peer_id="b"))

        asyncio.run(main())
    finally:
        srv.stop()


def test_client_checks_each_chunks_crc():
    from gradcoll.errors import ProtocolError
    from gradcoll.sync import GradientChunkResponse
    from gradcoll.sync.grpc_server import SERVICE
    from gradcoll.sync.wire import encode_response

    async def bad_chunks(raw, context):
        chunk = GradientChunkResponse.build("s", 0, 1, store_gradient_as_arrow([1.0]), "local")
        yield encode_response(GradientChunkResponse("s", 0, 1, chunk.data, "local", chunk.checksum ^ 1))

    async def main():
        server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(bad_chunks)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"SyncGradients": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with GradientSyncClient(f"127.0.0.1:{port}") as client:
                with pytest.raises(ProtocolError, match="checksum"):
                    await client.collect(_req("s", [1.0]))
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_standalone_server_process(tmp_path):
    import os
    import selectors
    import signal
    import subprocess
    import sys

    env = dict(os.environ, GRADCOLL_SYNC_TOKEN="tok")
    cmd = [sys.executable, "-m", "gradcoll.sync", "--store", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    try:
        # Readiness handshake: the server prints its address once it listens.
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60), "server printed no readiness line within 60 s"
        line = proc.stdout.readline().decode()
        assert line.startswith("gradcoll-sync listening on 127.0.0.1:"), line
        address = line.rsplit(" ", 1)[1].strip()

        async def main():
            async with GradientSyncClient(address, token="tok") as client:
                return await client.collect(_req("cli", [4.0, 2.0]))

        assert asyncio.run(main()).aggregate.tolist() == [4.0, 2.0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()

"""GradientSyncService in process: the original's tests, real peers, timeouts, reassembly."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, ProtocolError, UsageError
from gradcoll.sync import (
    FileBlockStore,
    GradientChunkResponse,
    GradientSyncRequest,
    GradientSyncService,
    MemoryBlockStore,
    load_gradient_from_arrow,
    reassemble,
    reassemble_all,
    store_gradient_as_arrow,
)


def _req(session, values, min_peers=0, timeout=5.0, **kw):
    data = store_gradient_as_arrow(np.asarray(values, np.float32))
    return GradientSyncRequest(session, data, min_peers, timeout, **kw)


async def _drain(queue):
    out = []
    while (chunk := await queue.get()) is not None:
        out.append(chunk)
    return out


@pytest.fixture
def service(tmp_path):
    return GradientSyncService(FileBlockStore(tmp_path / "store"))


# ---- the original's tests -------------------------------------------------


def test_service_streams_chunks(service):
    async def main():
        q = asyncio.Queue(64)
        await service.sync_gradients(_req("test-sync-session", np.arange(128) * 0.1), q)
        return await _drain(q)

    received = asyncio.run(main())
    assert received, "at least one chunk must be streamed back"
    assert all(c.session_id == "test-sync-session" and c.peer_id == "local" for c in received)
    assert received[0].chunk_index == 0 and received[0].data


def test_empty_gradient_gives_exactly_one_chunk(service):
    async def main():
        q = asyncio.Queue(64)
        await service.sync_gradients(_req("empty-session", [], timeout=1), q)
        first = await q.get()
        return first, await q.get(), q.empty()

    first, end, empty = asyncio.run(main())
    assert (first.chunk_index, first.total_chunks, first.peer_id) == (0, 1, "local")
    assert load_gradient_from_arrow(first.data).size == 0
    assert end is None and empty  # the sentinel, then nothing


def test_large_gradient_is_split_in_two(service):
    async def main():
        q = asyncio.Queue(64)
        await service.sync_gradients(_req("large-session", np.arange(131_072) * 1e-5, timeout=10), q)
        return await _drain(q)

    received = asyncio.run(main())
    assert [c.chunk_index for c in received] == [0, 1]
    assert [c.total_chunks for c in received] == [2, 2]


# ---- beyond the original ----------------------------------------------------


def test_stream_form_and_summary(service):
    g = np.arange(200_000, dtype=np.float32)

    async def main():
        stream = service.stream(_req("s", g, peer_id="me"))
        chunks = [c async for c in stream]
        return chunks, stream.summary

    chunks, summary = asyncio.run(main())
    assert len(chunks) == 4 and all(c.total_chunks == 4 for c in chunks)
    assert np.array_equal(reassemble(chunks), g)
    assert (summary.peer_id, summary.peers, summary.timed_out, summary.elements) == ("me", (), False, 200_000)


def test_three_peers_exchange_and_average(service):
    grads = {p: np.random.default_rng(i).standard_normal(70_000).astype(np.float32) for i, p in enumerate("abc")}

    async def main():
        return await asyncio.gather(
            *(service.collect(_req("round", g, min_peers=2, peer_id=p)) for p, g in grads.items())
        )

    results = asyncio.run(main())
    for r in results:
        me = r.summary.peer_id
        assert sorted(r.peers) == sorted(set("abc") - {me}) and not r.summary.timed_out
        assert np.array_equal(r.local, grads[me])
        for p, got in r.peers.items():
            assert np.array_equal(got.view(np.uint32), grads[p].view(np.uint32))
        assert np.allclose(r.aggregate, (grads["a"] + grads["b"] + grads["c"]) / 3, atol=1e-6)
    # Sorted reduction order: every peer gets the same bits.
    assert all(np.array_equal(r.aggregate.view(np.uint32), results[0].aggregate.view(np.uint32)) for r in results)


def test_missing_peer_ends_at_the_timeout_with_the_count(service):
    async def main():
        t0 = time.monotonic()
        reqs = [_req("late", [float(i)], min_peers=2, timeout=0.4) for i in range(2)]
        rs = await asyncio.gather(*(service.collect(r) for r in reqs))
        return rs, time.monotonic() - t0

    results, elapsed = asyncio.run(main())
    assert 0.4 <= elapsed < 5
    for r in results:
        assert r.summary.timed_out and r.summary.peers_received == 1
        assert r.aggregate.tolist() == [0.5]


def test_strict_timeout_raises(service):
    async def main():
        q = asyncio.Queue()
        with pytest.raises(CollectiveTimeout, match="got 0 of 1 peers"):
            await service.sync_gradients(_req("strict", [1.0], min_peers=1, timeout=0.1, strict=True), q)
        return await q.get()

    assert asyncio.run(main()) is None  # the consumer is still told the stream ended


def test_refusals_name_session_and_peer(service):
    async def main():
        await service.collect(_req("x", [1.0, 2.0], peer_id="first"))
        with pytest.raises(CollectiveMismatch, match="peer 'second' contributed 1 elements"):
            await service.collect(_req("x", [1.0], peer_id="second"))
        with pytest.raises(UsageError, match="peer 'first' has already contributed"):
            await service.collect(_req("x", [1.0, 2.0], peer_id="first"))
        with pytest.raises(NonFiniteError, match="peer 'nan' sent non-finite value nan at element 1"):
            await service.collect(_req("y", [1.0, float("nan")], peer_id="nan"))
        with pytest.raises(UsageError, match="decode local gradient"):
            await service.collect(GradientSyncRequest("z", b"junk", 0, 1.0))

    asyncio.run(main())
    assert service.session_peers("x") == ("first",)


def test_request_validation():
    with pytest.raises(UsageError, match="reserved"):
        _req("s", [1.0], peer_id="local")
    with pytest.raises(UsageError):
        _req("", [1.0])
    with pytest.raises(UsageError):
        _req("s", [1.0], min_peers=-1)
    with pytest.raises(UsageError):
        _req("s", [1.0], timeout=float("inf"))


def test_close_session_can_delete_its_blocks():
    store = MemoryBlockStore()
    service = GradientSyncService(store)
    asyncio.run(service.collect(_req("s", np.ones(100_000), peer_id="a")))
    assert len(store) == 3  # two chunks and a manifest
    assert service.close_session("s", delete_blocks=True)
    assert len(store) == 0 and service.session_peers("s") == ()


def test_bounded_sink_gets_backpressure_not_loss(service):
    async def main():
        q = asyncio.Queue(maxsize=1)
        task = asyncio.create_task(service.sync_gradients(_req("bp", np.ones(300_000)), q))
        chunks = await _drain(q)
        await task
        return chunks

    assert [c.chunk_index for c in asyncio.run(main())] == [0, 1, 2, 3, 4]


# ---- reassembly -------------------------------------------------------------


def _chunks(n=200_000, peer="p"):
    g = np.arange(n, dtype=np.float32)
    step = 65_536
    parts = [g[i : i + step] for i in range(0, n, step)]
    chunks = [
        GradientChunkResponse.build("s", i, len(parts), store_gradient_as_arrow(p), peer) for i, p in enumerate(parts)
    ]
    return g, chunks


def test_reassemble_in_any_order():
    g, chunks = _chunks()
    assert np.array_equal(reassemble(chunks[::-1]), g)
    assert np.array_equal(reassemble_all(chunks[2:] + _chunks(10, "q")[1] + chunks[:2])["p"], g)


def test_reassemble_refuses_duplicates_gaps_and_bad_checksums():
    _, chunks = _chunks()
    with pytest.raises(ProtocolError, match="chunk 1/4 twice"):
        reassemble(chunks + [chunks[1]])
    with pytest.raises(ProtocolError, match="missing 2 of 4 chunks: 1, 3"):
        reassemble([chunks[0], chunks[2]])
    flipped = bytearray(chunks[2].data)
    flipped[len(flipped) // 2] ^= 0x04
    with pytest.raises(ProtocolError, match="chunk 2/4 failed its checksum"):
        reassemble(chunks[:2] + [dataclasses.replace(chunks[2], data=bytes(flipped))] + chunks[3:])
    with pytest.raises(ProtocolError, match="says 5 chunks"):
        reassemble(chunks[:3] + [dataclasses.replace(chunks[3], total_chunks=5)])
    with pytest.raises(UsageError, match="several peers"):
        reassemble(chunks + _chunks(10, "q")[1])
    with pytest.raises(UsageError):
        reassemble([])

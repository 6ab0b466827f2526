"""Block stores and chunked gradient storage: content addressing, atomicity, corruption, size."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from gradcoll.errors import ProtocolError, UsageError  # noqa: E402
from gradcoll.sync import (
    BlockNotFound,
    BlockStore,
    CorruptBlock,
    FileBlockStore,
    MemoryBlockStore,
    get_gradient,
    put_gradient,
    read_manifest,
    store_gradient_as_arrow,
)


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    return MemoryBlockStore() if request.param == "memory" else FileBlockStore(tmp_path / "blocks")


def test_put_get_has_delete(store):
    assert isinstance(store, BlockStore)
    cid = store.put(b"hello")
    assert cid == hashlib.sha256(b"hello").hexdigest()
    assert store.put(b"hello") == cid  # idempotent
    assert store.has(cid) and store.get(cid) == b"hello"
    assert store.delete(cid) and not store.delete(cid)
    assert not store.has(cid)
    with pytest.raises(BlockNotFound, match=cid):
        store.get(cid)


def test_empty_block(store):
    assert store.get(store.put(b"")) == b""


@pytest.mark.parametrize("bad", ["", "ABC", "../" * 30 + "etc/passwd", "g" * 64, "A" * 64, 7])
def test_malformed_cid_is_misuse(store, bad):
    with pytest.raises(UsageError):
        store.get(bad)


def test_block_size_limit_points_at_chunked_storage(tmp_path):
    s = FileBlockStore(tmp_path, max_block_size=10)
    with pytest.raises(UsageError, match="put_gradient"):
        s.put(b"x" * 11)


def test_flipped_byte_in_a_stored_file_is_detected_and_healed(tmp_path):
    s = FileBlockStore(tmp_path)
    cid = s.put(b"gradient bytes")
    path = tmp_path / cid[:2] / cid
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match=cid) as err:
        s.get(cid)
    assert isinstance(err.value, ProtocolError)
    assert s.put(b"gradient bytes") == cid  # a put of the true bytes rewrites the bad copy
    assert s.get(cid) == b"gradient bytes"


def test_flipped_byte_in_memory_is_detected():
    s = MemoryBlockStore()
    cid = s.put(b"abc")
    s._blocks[cid] = b"abd"  # simulate memory corruption
    with pytest.raises(CorruptBlock):
        s.get(cid)


def test_writes_leave_no_temporary_files(tmp_path):
    s = FileBlockStore(tmp_path)
    for i in range(5):
        s.put(bytes([i]) * 100)
    assert list((tmp_path / "tmp").iterdir()) == []


def _writer(root: str, start: int, conn) -> None:
    s = FileBlockStore(root)
    conn.send([s.put(f"block {i}".encode() * 1000) for i in range(start, start + 20)])
    conn.close()


def test_processes_share_one_directory(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for start in (0, 10):  # blocks 10..19 are written by both processes
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_writer, args=(str(tmp_path), start, child))
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    try:
        cids = []
        for conn in pipes:
            assert conn.poll(60), "writer process did not answer"
            cids += conn.recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    s = FileBlockStore(tmp_path)
    assert len(set(cids)) == 30
    for i in range(30):
        assert s.get(hashlib.sha256(f"block {i}".encode() * 1000).hexdigest()) == f"block {i}".encode() * 1000


@pytest.mark.parametrize("n", [0, 1, 65_536, 65_537, 300_000])
def test_gradient_round_trips_through_chunks(store, n):
    v = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    cid = put_gradient(store, v)
    m = read_manifest(store, cid)
    assert m.elements == n and len(m.chunks) == max(1, -(-n // 65_536))
    assert get_gradient(store, cid).view(np.uint32).tolist() == v.view(np.uint32).tolist()


def test_no_ceiling_where_the_original_had_one():
    # The original's store refused blocks over 2 MiB: one-block gradients
    # failed above about 260k elements. Chunked, the same limit is no ceiling.
    s = MemoryBlockStore(max_block_size=2 * 1024 * 1024)
    v = np.ones(300_000, np.float32)
    with pytest.raises(UsageError):
        s.put(store_gradient_as_arrow(v))
    assert get_gradient(s, put_gradient(s, v)).sum() == 300_000


def test_ten_million_elements_round_trip_through_the_file_store(tmp_path):
    v = np.arange(10_000_000, dtype=np.float32)
    v[::7] *= -1.5
    s = FileBlockStore(tmp_path)
    t0 = time.perf_counter()
    cid = put_gradient(s, v)
    out = get_gradient(s, cid)
    elapsed = time.perf_counter() - t0
    assert np.array_equal(out.view(np.uint32), v.view(np.uint32))
    assert elapsed < 30, f"10M-element round trip took {elapsed:.1f}s"


def test_corrupted_chunk_of_a_gradient_is_detected(tmp_path):
    s = FileBlockStore(tmp_path)
    cid = put_gradient(s, np.ones(100_000, np.float32))
    chunk = read_manifest(s, cid).chunks[1]
    path = tmp_path / chunk[:2] / chunk
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match=chunk):
        get_gradient(s, cid)


def test_a_block_that_is_not_a_manifest_is_refused(store):
    with pytest.raises(ProtocolError, match="manifest"):
        get_gradient(store, store.put(b'{"elements": 1}'))
    with pytest.raises(ProtocolError, match="chunks"):
        get_gradient(store, store.put(b'gradcoll-manifest/1\n{"elements":1,"chunk_elements":1,"chunks":[]}'))


def test_durable_false_still_atomic(tmp_path):
    s = FileBlockStore(tmp_path, durable=False)
    assert s.get(s.put(b"x" * 1000)) == b"x" * 1000
    assert os.listdir(tmp_path / "tmp") == []

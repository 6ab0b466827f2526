"""Shared-memory specifics: segment lifetime and cleanup, ring wrap-around, peer states, processes.

The shared contract is in ``test_conformance.py``. Tests that
create segments use a private ``shm_dir`` where they look at the directory,
so they never see (or touch) other jobs' segments.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import platform

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.errors import BackendUnavailable, CollectiveMismatch, CollectiveTimeout, TransportBroken, TransportClosed, UsageError
from gradcoll.store import HashStore
from gradcoll.testing import run_ranks, threaded_group
from gradcoll.transport import shm
from tests.helpers import spawn_ranks


def _segments(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(shm.PREFIX))


@pytest.fixture
def shm_dir(tmp_path):
    d = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(d, f"gradcoll-test-{os.getpid()}-{os.urandom(4).hex()}")
    os.mkdir(path)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _hello(group, src: int, dst: int) -> None:
    group[src].send(dst, b"hi")
    out = bytearray(2)
    group[dst].recv(src, out)
    assert out == b"hi"


def test_segments_unlinked_once_mapped_and_nothing_left_after_close(shm_dir) -> None:
    group = threaded_group(shm.create, 3, timeout=10, shm_dir=shm_dir)
    try:
        assert _segments(shm_dir) == []  # the attacher unlinks at once; the mappings live on
        _hello(group, 0, 2)
    finally:
        for t in group:
            t.close()
    assert _segments(shm_dir) == []


def test_failed_bootstrap_leaves_no_segment(shm_dir) -> None:
    with pytest.raises(CollectiveTimeout):  # rank 1 never comes
        shm.create(HashStore(), 0, 2, timeout=0.3, shm_dir=shm_dir)
    assert _segments(shm_dir) == []


def _exit_at_once() -> None:
    pass


def test_stale_segments_of_dead_creators_are_cleaned(shm_dir) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_exit_at_once)
    proc.start()
    proc.join(30)  # reaped: its pid is now free
    dead, alive = f"{shm.PREFIX}{proc.pid}-ab-0-1", f"{shm.PREFIX}{os.getppid()}-cd-0-1"
    for name in (dead, alive, "unrelated"):
        open(os.path.join(shm_dir, name), "wb").close()
    group = threaded_group(shm.create, 2, timeout=10, shm_dir=shm_dir)
    for t in group:
        t.close()
    assert sorted(os.listdir(shm_dir)) == sorted([alive, "unrelated"])


def test_a_survivors_failed_startup_removes_a_dead_peers_segments(shm_dir) -> None:
    """A peer killed during startup leaves the segments it created: the survivor's error path removes them."""
    proc = multiprocessing.get_context("spawn").Process(target=_exit_at_once)
    proc.start()
    proc.join(30)
    left = f"{shm.PREFIX}{proc.pid}-abcdefabcdef-0-2"  # rank 0 created it for rank 2, then died

    class Store(HashStore):
        def get(self, key: str, timeout: float | None = None) -> bytes:
            open(os.path.join(shm_dir, left), "wb").close()  # while rank 1 is starting: its own cleanup ran
            return super().get(key, timeout)

    store = Store()
    with pytest.raises(CollectiveTimeout):  # rank 1 waits for rank 0's segment name, which never comes
        shm.create(store, 1, 3, timeout=0.3, shm_dir=shm_dir)
    assert _segments(shm_dir) == []


def test_refuses_ranks_on_other_hosts(shm_dir) -> None:
    store = HashStore()
    store.set("shm/0-1", b"elsewhere gcshm-1-abcdefabcdef-0-1")
    with pytest.raises(UsageError, match="one host"):
        shm.create(store, 1, 2, timeout=5, shm_dir=shm_dir)


def test_refuses_weakly_ordered_cpus(monkeypatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(BackendUnavailable, match="use tcp"):
        shm.create(HashStore(), 0, 1)


@pytest.fixture(scope="module")
def tiny_ring():
    group = threaded_group(shm.create, 2, timeout=10, ring_bytes=4096)
    yield group
    for t in group:
        t.close()


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), min_size=1, max_size=40))
def test_any_message_sizes_through_a_one_page_ring(tiny_ring, sizes) -> None:
    """Headers never wrap, payloads do, messages larger than the ring stream through it."""
    a, b = tiny_ring

    def send(t):
        for i, n in enumerate(sizes):
            t.send(1, np.full(n, i % 251, np.uint8), tag=i, timeout=10)

    def recv(t):
        for i, n in enumerate(sizes):
            out = np.empty(n, np.uint8)
            t.recv(0, out, tag=i, timeout=10)
            assert (out == i % 251).all(), f"message {i} of {n} bytes corrupted"

    run_ranks([send, recv], [a, b], timeout=30)


def test_peer_states_reach_the_waiting_side() -> None:
    a, b = threaded_group(shm.create, 2, timeout=10, ring_bytes=4096)
    try:
        b.send(0, np.zeros(3000, np.uint8))  # fits: returns at once
        big = b.isend(0, np.zeros(10_000, np.uint8))  # needs the reader; part of it is in the ring
        with pytest.raises(CollectiveMismatch):
            a.recv(1, bytearray(5), timeout=5)  # wrong length: a drops the link with an abort
        with pytest.raises(TransportBroken, match="collective mismatch on its side"):
            big.wait(5)
    finally:
        a.close()
        b.close()
    c, d = threaded_group(shm.create, 2, timeout=10, ring_bytes=4096)
    try:
        d.isend(0, np.zeros(10_000, np.uint8))  # a partial message, then close
        d.close()
        with pytest.raises(TransportClosed, match="middle of a message"):
            c.recv(1, np.empty(10_000, np.uint8), timeout=5)
    finally:
        c.close()


def _exchange(store, rank, size, n):
    t = shm.create(store, rank, size, timeout=20)
    try:
        other, out = 1 - rank, np.empty(n, np.uint8)
        t.sendrecv(other, np.full(n, rank + 1, np.uint8), other, out, timeout=30)
        return int(out.min()), int(out.max())
    finally:
        t.close()


def test_processes_exchange_64mib_at_once() -> None:
    assert spawn_ranks(_exchange, 2, 64 << 20, timeout=60) == [(2, 2), (1, 1)]


def _closes_then_exits(store, rank, size):
    t = shm.create(store, rank, size, timeout=20)
    if rank == 1:
        t.send(0, b"bye", timeout=10)
        t.close()
        return None
    out = bytearray(3)
    t.recv(1, out, timeout=10)
    try:
        t.recv(1, out, timeout=10)
    except TransportClosed as e:
        return str(e)
    finally:
        t.close()


def test_orderly_close_across_processes() -> None:
    result = spawn_ranks(_closes_then_exits, 2, timeout=60)[0]
    assert result is not None and "peer 1 closed the link" in result


def _mapped_kib(directory: str) -> list[tuple[int, int]]:
    """(Size, Rss) in KiB of this process's mappings of segments in ``directory``, from /proc/self/smaps."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's first line: range perms offset dev inode [path]
                current = [] if len(head) > 5 and head[5].startswith(directory + "/" + shm.PREFIX) else None
                if current is not None:
                    out.append(current)
            elif current is not None and head[0] in ("Size:", "Rss:"):
                current.append(int(head[1]))
    return [(m[0], m[1]) for m in out]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_segments_are_mapped_in_full_at_creation(shm_dir) -> None:
    # Regression: mapped lazily, the first 8 MiB through each ring took a page
    # fault per 4 KiB on each side (a 128 KiB allreduce on 2 ranks: 35 faults
    # per rank, 40% of its time). Every page is resident before any traffic.
    group = threaded_group(shm.create, 3, timeout=10, shm_dir=shm_dir, ring_bytes=1 << 20)
    try:
        maps = _mapped_kib(shm_dir)
        assert len(maps) == 2 * 3  # 3 pairs, each segment mapped by both of its ranks (threads here)
        for size_kib, rss_kib in maps:
            assert size_kib == (4096 + 2 * (1 << 20)) // 1024
            assert rss_kib == size_kib
    finally:
        for t in group:
            t.close()


def test_no_room_to_allocate_up_front_still_connects(shm_dir, monkeypatch, caplog) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    group = threaded_group(shm.create, 2, timeout=10, shm_dir=shm_dir, ring_bytes=4096)
    try:
        _hello(group, 0, 1)
    finally:
        for t in group:
            t.close()
    assert "no room to allocate" in caplog.text


@pytest.mark.parametrize("crowd", [None, 1, "cores"])
def test_crowd_counts_other_groups_ranks_against_the_cores(shm_dir, crowd) -> None:
    """``crowd``: the ranks of every group on this machine. Where they outnumber the cores the window's waiters
    yield instead of spinning (a subgroup's or a two-level allreduce's links, whose parent knows the count)."""
    from gradcoll.testing import gather_ranks
    from gradcoll.transport.window import SPIN_S

    cores = len(os.sched_getaffinity(0))
    n = 2
    given = cores + 1 if crowd == "cores" else crowd
    ts = threaded_group(shm.create, n, timeout=10, shm_dir=shm_dir, crowd=given)
    try:
        wins, errors = gather_ranks(lambda r: ts[r].window(1 << 10, 10.0), n, join_timeout=30)
        assert errors == [None] * n, errors
        want = max(n, given or 0)
        assert [t.crowd for t in ts] == [want] * n
        crowded = want > cores
        assert [(w.spin_s, w.yields) for w in wins] == [(0.0, 8) if crowded else (SPIN_S, 0)] * n
    finally:
        for t in ts:
            t.close()

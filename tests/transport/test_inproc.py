"""The in-process transport: its own guarantees beyond the shared conformance suite.

(``tests/transport/test_conformance.py`` runs ``gradcoll.testing.check_transport``
over inproc too; this file covers copy semantics, matching order, cancellation,
the store-based factory and the weak world registry.)
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, TransportClosed, UsageError
from gradcoll.store import HashStore
from gradcoll.transport import inproc
from gradcoll.transport.inproc import InprocTransport, create, create_world


def test_isend_copies_the_payload_with_or_without_a_posted_receive() -> None:
    a, b = create_world(2, timeout=5)
    out = np.zeros(4, np.int32)
    req = b.irecv(0, out, tag=1)  # posted first: the send copies straight in
    buf = np.arange(4, dtype=np.int32)
    assert a.isend(1, buf, tag=1).test()
    buf[:] = -1
    assert req.wait() == 16 and out.tolist() == [0, 1, 2, 3]
    buf[:] = 7
    a.isend(1, buf, tag=2)  # nobody waiting: buffered
    buf[:] = -1
    b.recv(0, out, tag=2)
    assert out.tolist() == [7, 7, 7, 7]


def test_receives_match_in_posting_order_whatever_order_they_are_waited() -> None:
    a, b = create_world(2, timeout=5)
    first, second = bytearray(3), bytearray(3)
    r1 = b.irecv(0, first, tag=5)
    r2 = b.irecv(0, second, tag=5)
    a.send(1, b"one", tag=5)
    a.send(1, b"two", tag=5)
    assert r2.wait() == 3 and r1.wait() == 3
    assert (bytes(first), bytes(second)) == (b"one", b"two")


def test_timed_out_receive_is_cancelled_and_never_written() -> None:
    a, b = create_world(2, timeout=5)
    stale, fresh = bytearray(2), bytearray(2)
    with pytest.raises(CollectiveTimeout) as info:
        b.recv(0, stale, tag=1, timeout=0.01)
    assert info.value.missing == [0] and info.value.rank == 1
    a.send(1, b"hi", tag=1)
    b.recv(0, fresh, tag=1)
    assert bytes(fresh) == b"hi" and bytes(stale) == b"\0\0"


def test_tag_and_length_mismatch_name_both_sides() -> None:
    a, b = create_world(2, timeout=5)
    a.send(1, b"abcd", tag=3)
    with pytest.raises(CollectiveMismatch, match=r"expected seq 0 tag 9 \(4 bytes\).*sent seq 0 tag 3 \(4 bytes\)"):
        b.recv(0, bytearray(4), tag=9)
    a.send(1, b"abcd", tag=3)
    with pytest.raises(CollectiveMismatch, match=r"\(5 bytes\).*\(4 bytes\)"):
        b.recv(0, bytearray(5), tag=3)


def test_close_wakes_a_blocked_peer_but_delivers_what_was_sent_first() -> None:
    a, b = create_world(2, timeout=5)
    a.send(1, b"last words", tag=0)
    got = bytearray(10)
    errors: list[BaseException] = []
    waiting = threading.Event()

    def receiver() -> None:
        b.recv(0, got, tag=0)
        req = b.irecv(0, bytearray(1), tag=0)
        waiting.set()
        try:
            req.wait()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=receiver)
    t.start()
    assert waiting.wait(5)
    a.close()
    t.join(5)
    assert bytes(got) == b"last words"
    assert isinstance(errors[0], TransportClosed) and "peer 0 closed" in str(errors[0])
    with pytest.raises(TransportClosed):
        b.send(0, b"x")
    with pytest.raises(TransportClosed, match="transport is closed"):
        a.send(1, b"x")
    a.close()  # idempotent


def test_closing_fails_own_pending_receives() -> None:
    a, b = create_world(2, timeout=5)
    req = a.irecv(1, bytearray(1))
    a.close()
    with pytest.raises(TransportClosed, match="closed locally"):
        req.wait()


def test_large_and_zero_length_messages() -> None:
    a, b = create_world(2, timeout=5)
    big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    out = np.empty_like(big)
    a.send(1, big)
    b.recv(0, out)
    assert np.array_equal(out, big)
    a.send(1, b"", tag=4)
    assert b.recv(0, bytearray(0), tag=4) == 0


def test_create_through_a_store_from_threads() -> None:
    store = HashStore(timeout=5)
    out: list[InprocTransport | None] = [None] * 3
    for generation in range(2):  # the same store serves a second world
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, create(store, r, 3, timeout=5)))
                   for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert all(t is not None for t in out)
        assert len({id(t.world) for t in out}) == 1  # type: ignore[union-attr]
        out[2].send(0, bytes([generation]))  # type: ignore[union-attr]
        got = bytearray(1)
        out[0].recv(2, got)  # type: ignore[union-attr]
        assert got[0] == generation


def test_create_rejects_options_bad_ranks_and_foreign_worlds() -> None:
    store = HashStore(timeout=1)
    with pytest.raises(UsageError):
        create(store, 0, 2, timeout=1, host="x")
    with pytest.raises(UsageError):
        create(store, 2, 2, timeout=1)
    store.set("inproc/world/1", b"not-a-world-of-this-process")
    with pytest.raises(UsageError, match="thread"):
        create(store, 1, 2, timeout=1)


def test_world_registry_is_weak() -> None:
    store = HashStore(timeout=1)
    t0 = create(store, 0, 1, timeout=1)
    assert len(inproc._WORLDS) >= 1
    wid = store.get("inproc/world/1").decode()
    assert wid in inproc._WORLDS
    del t0
    gc.collect()
    assert wid not in inproc._WORLDS

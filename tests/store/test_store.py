"""TCPStore (real TCP on 127.0.0.1, clients as threads) and FileStore."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.errors import CollectiveTimeout, GradcollError, TransportBroken, UsageError
from gradcoll.store import FileStore, PrefixStore, Store, TCPStore


@pytest.fixture
def master():  # type: ignore[no-untyped-def]
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    yield store
    store.close()


def client(master: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, timeout=5)


def test_set_get_add_check_delete(master: TCPStore) -> None:
    c = client(master)
    try:
        c.set("a", b"\x00\xff bytes")
        assert master.get("a") == b"\x00\xff bytes"
        assert c.add("n", 5) == 5 and master.add("n", -2) == 3
        assert c.check(["a", "n"]) and not c.check(["a", "missing"])
        assert c.delete("a") and not c.delete("a")
        assert not master.check(["a"])
        c.set("big", b"x" * (1 << 20))
        assert len(master.get("big")) == 1 << 20
    finally:
        c.close()


def _set_wakes_a_waiting_get(waiter: Store, setter: Store) -> None:
    """A get blocked in one thread returns the value once another handle of the store sets it."""
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(waiter.get("later", timeout=5)))
    t.start()
    setter.set("later", b"now")
    t.join(10)
    assert got == [b"now"]


def test_get_waits_for_a_set_from_another_thread(master: TCPStore) -> None:
    c = client(master)
    _set_wakes_a_waiting_get(c, master)
    c.wait(["later"], timeout=1)
    c.close()


def test_get_and_wait_time_out(master: TCPStore) -> None:
    with pytest.raises(CollectiveTimeout, match="'nope' was not set within 0.05s"):
        master.get("nope", timeout=0.05)
    with pytest.raises(CollectiveTimeout):
        master.wait(["x", "y"], timeout=0.05)


def test_concurrent_adds_are_atomic(master: TCPStore) -> None:
    clients = [client(master) for _ in range(4)]
    threads = [threading.Thread(target=lambda c=c: [c.add("ctr", 1) for _ in range(50)]) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert master.add("ctr", 0) == 200
    for c in clients:
        c.close()


def test_client_started_before_the_server_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: list[TCPStore] = []
    t = threading.Thread(target=lambda: box.append(TCPStore("127.0.0.1", port, timeout=10)))
    t.start()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=5)
    t.join(15)
    box[0].set("k", b"v")
    assert server.get("k") == b"v"
    box[0].close()
    server.close()


def test_unreachable_server_times_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CollectiveTimeout, match="could not reach"):
        TCPStore("127.0.0.1", port, timeout=0.2)


def raw_request(port: int, frame: bytes) -> bytes:
    """Send raw bytes to the server; return everything it answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(frame)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\x63", b"unknown store op 99"),
        (b"\x01\x05\x00\x00\x00ab", b"truncated"),
        (b"\x05\x02\x00\x00\x00\xff\xfe", b"UTF-8"),
        (b"\x05\x01\x00\x00\x00aJUNK", b"trailing"),
    ],
)
def test_malformed_requests_are_refused_and_dropped(master: TCPStore, payload: bytes, reason: bytes) -> None:
    reply = raw_request(master.port, struct.pack(">I", len(payload)) + payload)
    assert reply[4] == 2 and reason in reply  # error status, then the connection is closed
    assert master.add("still-alive", 1) == 1


def test_oversized_frame_is_refused_before_reading_it() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, max_frame=1024)
    try:
        reply = raw_request(server.port, struct.pack(">I", 1 << 30))
        assert reply[4] == 2 and b"exceeds the 1024-byte limit" in reply
    finally:
        server.close()


def test_add_to_non_integer_is_an_error(master: TCPStore) -> None:
    master.set("s", b"text")
    with pytest.raises(GradcollError, match="not an integer"):
        master.add("s", 1)


def test_master_close_waits_for_clients_to_disconnect(master: TCPStore) -> None:
    c = client(master)
    assert c.add("x", 0) == 0  # accepted by the server, not just queued in the backlog
    closer = threading.Thread(target=master.close)  # lingers while c is connected
    closer.start()
    assert c.add("x", 1) == 1 and c.get("x") == b"1"  # still served
    c.close()
    closer.join(10)
    assert not closer.is_alive()


def test_server_going_away_is_reported_not_hung(master: TCPStore) -> None:
    c = client(master)
    assert c.add("x", 1) == 1
    master.close(grace=0)
    with pytest.raises((TransportBroken, CollectiveTimeout)):
        c.get("never", timeout=5)
    c.close()
    with pytest.raises(UsageError):
        c.set("k", b"v")


def test_prefix_store_over_tcp(master: TCPStore) -> None:
    p = PrefixStore("grp", master)
    p.set("k", b"1")
    assert master.get("grp/k") == b"1" and p.check(["k"])


@settings(max_examples=30, deadline=None)
@given(key=st.text(min_size=0, max_size=40), value=st.binary(max_size=300))
def test_round_trip_any_key_and_value(key: str, value: bytes) -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    other = TCPStore("127.0.0.1", server.port, timeout=5)
    try:
        other.set(key, value)
        assert server.get(key) == value
    finally:
        other.close()
        server.close()


# -- FileStore ----------------------------------------------------------------

def test_filestore_shared_between_instances(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    a, b = FileStore(path, timeout=5), FileStore(path, timeout=5)
    a.set("k", b"v1")
    assert b.get("k") == b"v1"
    b.set("k", b"v2")
    assert a.get("k") == b"v2"
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert a.check(["k", "n"]) and not a.check(["zzz"])
    assert b.delete("k") and not a.check(["k"])
    with pytest.raises(CollectiveTimeout):
        a.get("missing", timeout=0.05)
    a.close()
    assert Path(path).exists()
    b.close()
    assert not Path(path).exists()  # the last one out removes the file
    with pytest.raises(UsageError):
        b.get("k")


def test_filestore_waits_for_another_thread(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    a, b = FileStore(path, timeout=5), FileStore(path, timeout=5)
    _set_wakes_a_waiting_get(a, b)
    threads = [threading.Thread(target=lambda s=s: [s.add("c", 1) for _ in range(25)]) for s in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert a.add("c", 0) == 50
    a.close()
    b.close()

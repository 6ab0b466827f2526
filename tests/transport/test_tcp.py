"""TCP-specific behaviour: bootstrap and handshake, socket options, raw-byte protocol faults, processes.

The shared contract is in ``test_conformance.py``; here a raw
socket often plays the peer (``TcpTransport`` over one end of a socketpair),
so protocol faults are produced byte for byte.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, ProtocolError, TransportBroken, TransportClosed, UsageError
from gradcoll.store import HashStore
from gradcoll.testing import run_ranks, threaded_group
from gradcoll.transport import frame as fr
from gradcoll.transport import tcp
from tests.helpers import spawn_ranks


@pytest.fixture(params=["compiled", "python"])
def io_path(request, monkeypatch):
    """Run the test over the compiled send/receive loops and over their pure-Python fallback."""
    if request.param == "compiled":
        if tcp._IO is None:
            pytest.skip("gradcoll.transport._tcp_io is not built: `make install` compiles it")
    else:
        monkeypatch.setattr(tcp, "_IO", None)
    return request.param


@pytest.fixture
def pair(io_path):
    group = threaded_group(tcp.create, 2, timeout=10)
    yield group
    for t in group:
        t.close()


@pytest.fixture
def raw(io_path):
    """A TcpTransport (rank 0) whose peer (rank 1) is a raw socket the test drives byte by byte."""
    mine, theirs = socket.socketpair()
    t = tcp.TcpTransport(0, 2, {1: mine}, timeout=10)
    yield t, theirs
    t.close()
    theirs.close()


# -- the compiled loops and their fallback -------------------------------------
def test_the_compiled_loops_are_built_by_make_install() -> None:
    if os.environ.get("GRADCOLL_REQUIRE_EXTENSION") == "1":
        assert tcp._IO is not None, "gradcoll.transport._tcp_io did not build"


def test_without_the_compiled_module_tcp_falls_back_to_python() -> None:
    code = (
        "import sys; sys.modules['gradcoll.transport._tcp_io'] = None\n"  # as if it was never built
        "import numpy as np, gradcoll\n"
        "from gradcoll.transport import tcp\n"
        "from gradcoll.testing import threaded_group\n"
        "assert tcp._IO is None\n"
        "a, b = threaded_group(tcp.create, 2, timeout=10)\n"
        "x = np.arange(1 << 18, dtype=np.float32); out = np.empty_like(x)\n"
        "req = b.irecv(0, out); a.send(1, x); req.wait(10)\n"
        "assert (out == x).all(); a.close(); b.close(); print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- bootstrap ---------------------------------------------------------------
class _StrangerStore(HashStore):
    """Before rank 1 learns rank 0's address, strangers knock on the listener."""

    def __init__(self) -> None:
        super().__init__(timeout=10)
        self.refused: list[bytes] = []

    def get(self, key: str, timeout: float | None = None) -> bytes:
        value = super().get(key, timeout)
        if key == "tcp/0" and not self.refused:
            host, port, token = value.decode().split()
            wrong = [
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(fr.HELLO_SIZE, b" "),  # not gradcoll
                fr.pack_hello(fr.HELLO, 1, 2, bytes(16)),  # wrong token
                fr.pack_hello(fr.HELLO, 1, 3, bytes.fromhex(token)),  # wrong world size
                b"",  # connects and hangs up
            ]
            for hello in wrong:
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(hello)
                    s.shutdown(socket.SHUT_WR)
                    self.refused.append(s.recv(64))  # b"": the listener dropped us without an ACK
        return value


def test_handshake_refuses_strangers_and_still_connects() -> None:
    store = _StrangerStore()
    group = run_ranks([lambda r: tcp.create(store, r, 2, timeout=10)] * 2, [0, 1], timeout=20)
    try:
        assert store.refused == [b""] * 4
        group[0].send(1, b"ok", timeout=5)
        out = bytearray(2)
        group[1].recv(0, out, timeout=5)
        assert out == b"ok"
    finally:
        for t in group:
            t.close()


def test_binds_loopback_and_sets_socket_options(pair) -> None:
    link = pair[0]._links[1]
    assert link.sock.getsockname()[0] == "127.0.0.1"
    assert link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(tcp.SOCKBUF, cap)


def test_bootstrap_times_out_naming_the_missing_peer() -> None:
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        tcp.create(HashStore(), 0, 2, timeout=0.5)
    assert time.monotonic() - start < 1.5
    assert info.value.missing == [1] and "rank 0" in str(info.value)
    with pytest.raises(UsageError):
        tcp.create(HashStore(), 2, 2)


# -- protocol faults, byte by byte ------------------------------------------
def test_frames_on_the_wire(raw) -> None:
    t, peer = raw
    t.send(1, b"abc", tag=7)
    assert peer.recv(64) == fr.pack_header(0, 7, 3) + b"abc"
    peer.sendall(fr.pack_header(0, 9, 4) + b"wxyz")
    out = bytearray(4)
    assert t.recv(1, out, tag=9) == 4 and out == b"wxyz"


def _fill(sock: socket.socket) -> int:
    """Write filler bytes into ``sock`` until the kernel takes no more (the peer reads none); how many."""
    n, chunk = 0, 1 << 16
    while chunk:
        try:
            n += sock.send(bytes(chunk), socket.MSG_DONTWAIT)
        except BlockingIOError:
            chunk //= 2
    return n


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        assert part, "the transport closed the stream early"
        out += part
    return bytes(out)


@pytest.mark.parametrize("withdraw", ["cancel", "timeout"])
def test_a_send_withdrawn_before_its_first_byte_gives_its_seq_back(raw, withdraw: str) -> None:
    t, peer = raw
    peer.settimeout(10)
    filler = _fill(t._links[1].sock)  # the socket is really full: not a byte of the next frame fits
    req = t.isend(1, b"never", tag=5)  # numbered seq 0 at the head of the queue, not a byte written
    if withdraw == "cancel":
        assert req.cancel() and req.test() and req.wait(1) == 0
    else:
        with pytest.raises(CollectiveTimeout, match="peer 1"):
            req.wait(0.2)
    assert _read_exactly(peer, filler) == bytes(filler)
    t.send(1, b"abc", tag=7)
    assert _read_exactly(peer, fr.HEADER_SIZE + 3) == fr.pack_header(0, 7, 3) + b"abc"  # seq 0 again: no gap


def test_a_send_that_timed_out_half_way_finishes_in_the_background(raw) -> None:
    """The peer was busy elsewhere: it reads the whole frame late, then the next one, in step (no dropped link)."""
    t, peer = raw
    peer.settimeout(10)
    data = np.arange(1 << 21, dtype=np.uint32)  # 8 MiB: more than both socket buffers hold
    with pytest.raises(CollectiveTimeout, match="peer 1"):
        t.send(1, data, tag=3, timeout=0.2)
    assert t._links[1].failure is None
    sent, data[:] = data.copy(), 0  # the caller has its buffer back: what it writes now is not sent
    later = t.isend(1, b"record", tag=4)  # queued behind the rest of the first frame
    assert _read_exactly(peer, fr.HEADER_SIZE) == fr.pack_header(0, 3, data.nbytes)
    got = np.empty_like(data)
    view, n = memoryview(got).cast("B"), 0
    while n < data.nbytes:  # reading lets the sender's next waits drive the rest out
        part = peer.recv_into(view[n:])
        assert part, "the transport dropped the link"
        n += part
        if n < data.nbytes:
            later.test()
    later.wait(5)
    assert (got == sent).all()
    assert _read_exactly(peer, fr.HEADER_SIZE + 6) == fr.pack_header(1, 4, 6) + b"record"


def test_an_interrupted_send_half_way_finishes_from_a_copy_and_a_receive_into_its_buffer(raw) -> None:
    """After ``interrupt`` the caller has its send buffer back: the rest of the frame is what it held then. A
    receive half way through goes on into its own buffer: a later wait completes it with the peer's bytes."""
    t, peer = raw
    peer.settimeout(10)
    data = np.arange(1 << 21, dtype=np.uint32)  # 8 MiB: more than both socket buffers hold
    inbox = np.zeros(1 << 16, np.uint8)
    send, recv = t.isend(1, data, tag=3), t.irecv(1, inbox, tag=5)
    peer.sendall(fr.pack_header(0, 5, inbox.nbytes) + bytes([1]) * 1000)
    for _ in range(1000):  # drive both until the receive's first bytes are in
        send.test()
        if inbox[0] == 1:
            break
    assert inbox[0] == 1 and not recv.test() and not send.test()
    t.interrupt(lambda p: CollectiveTimeout(f"woken for peer {p}", missing=[p]))
    with pytest.raises(CollectiveTimeout, match="woken for peer 1"):
        send.wait(5)
    sent, data[:] = data.copy(), 0
    peer.sendall(bytes([2]) * (inbox.nbytes - 1000))
    assert recv.wait(5) == inbox.nbytes and (inbox[:1000] == 1).all() and (inbox[1000:] == 2).all()
    assert _read_exactly(peer, fr.HEADER_SIZE) == fr.pack_header(0, 3, data.nbytes)
    got = np.empty_like(data)
    view, n = memoryview(got).cast("B"), 0
    while n < data.nbytes:
        part = peer.recv_into(view[n:])
        assert part, "the transport dropped the link"
        n += part
        send.test()
    assert (got == sent).all()


@pytest.mark.parametrize(
    "wire, error, words",
    [
        (fr.pack_header(0, 0, 100) + b"x" * 10, TransportBroken, "middle of a message"),
        (b"", TransportBroken, "without an orderly close"),
        (struct.pack("<B3xIQQ", 9, 0, 0, 0), ProtocolError, "broke the protocol"),
        (fr.pack_header(0, 0, 0, fr.CLOSE), TransportClosed, "closed the link"),
        (fr.pack_header(0, fr.ABORT_TIMEOUT, 0, fr.ABORT), TransportBroken, "after a timeout on its side"),
        (fr.pack_header(5, 0, 100), CollectiveMismatch, "expected seq 0 tag 0 (100 bytes), but peer 1 sent seq 5"),
    ],
)
def test_peer_faults(raw, wire: bytes, error: type, words: str) -> None:
    t, peer = raw
    peer.sendall(wire)
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(error, match="rank 0") as info:
        t.recv(1, bytearray(100), timeout=5)
    assert words in str(info.value)
    with pytest.raises((TransportBroken, TransportClosed)):  # the link stays unusable
        t.recv(1, bytearray(1), timeout=5)


@pytest.mark.scenario("tcp header claiming 1 GiB or 1 TiB", raised="ProtocolError", per_variant=False)
@pytest.mark.parametrize("claimed", [1 << 30, 1 << 40])
def test_a_header_claiming_a_huge_stray_frame_is_refused_unread(raw, claimed: int) -> None:
    """A lenient receive takes a stray frame in whole only up to ``stray_limit``: the peer's length sizes nothing."""
    t, peer = raw
    lenient = fr.LENIENT_TAG + 5
    peer.sendall(fr.pack_header(0, lenient + 1, claimed))
    with pytest.raises(ProtocolError, match=f"peer 1 sent a frame of {claimed} bytes .* refused unread") as info:
        t.recv(1, bytearray(100), tag=lenient, timeout=5)
    assert (info.value.rank, info.value.peer) == (0, 1)
    assert peer.recv(fr.HEADER_SIZE)[0] == fr.ABORT  # the peer is told, so it fails fast too


def test_reset_by_peer_is_broken(raw) -> None:
    t, peer = raw
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # RST
    with pytest.raises(TransportBroken, match="peer 1"):
        t.send(1, np.zeros(16 << 20, np.uint8), timeout=5)


def test_mismatch_tells_the_sender(pair) -> None:
    a, b = pair
    a.send(1, b"1234", tag=1)
    with pytest.raises(CollectiveMismatch):
        b.recv(0, bytearray(4), tag=2)
    with pytest.raises(TransportBroken, match="collective mismatch on its side"):
        a.recv(1, bytearray(4), timeout=5)


def test_unstarted_timeout_leaves_link_usable(pair) -> None:
    a, b = pair
    with pytest.raises(CollectiveTimeout):
        a.recv(1, bytearray(3), timeout=0.1)
    b.send(0, b"abc")
    out = bytearray(3)
    assert a.recv(1, out, timeout=5) == 3 and out == b"abc"


def test_isend_progresses_while_waiting_for_a_recv(pair) -> None:
    """Both ranks isend 32 MiB, then recv: waiting on the recv must push the send."""
    n = 32 << 20

    def rank(t):
        req = t.isend(1 - t.rank, np.full(n, t.rank, np.uint8))
        out = np.empty(n, np.uint8)
        t.recv(1 - t.rank, out, timeout=20)
        req.wait(20)
        return bool((out == 1 - t.rank).all())

    assert run_ranks([rank] * 2, pair, timeout=30) == [True, True]


def test_close_flushes_queued_sends(pair) -> None:
    a, b = pair
    n = 16 << 20
    got: list = []
    reader = threading.Thread(target=lambda: got.append(b.recv(0, np.empty(n, np.uint8), timeout=10)))
    reader.start()
    a.isend(1, np.ones(n, np.uint8))  # cannot finish inline: the socket buffers are smaller
    a.close()
    reader.join(10)
    assert got == [n]
    with pytest.raises(TransportClosed):
        b.recv(0, bytearray(1), timeout=5)


# -- real processes ------------------------------------------------------------
def _exchange_64mib(store, rank, size):
    t = tcp.create(store, rank, size, timeout=20)
    try:
        n, other = 64 << 20, 1 - rank
        out = np.empty(n, np.uint8)
        t.sendrecv(other, np.full(n, rank + 1, np.uint8), other, out, timeout=30)
        return int(out.min()), int(out.max())
    finally:
        t.close()


def test_processes_exchange_64mib_at_once() -> None:
    assert spawn_ranks(_exchange_64mib, 2, timeout=60) == [(2, 2), (1, 1)]

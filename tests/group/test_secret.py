"""The group's shared secret: every entry point refuses a peer without it; strangers never take a seat.

Store clients, tcp links, shm segments and control datagrams, each on
127.0.0.1 with real sockets and files; the whole group through
init_process_group in real processes. Plus the limits that cost a stranger
nothing: the store's bounds, 100 idle connections to a listener, planted
segment names.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import tempfile
from typing import Any

import numpy as np
import pytest

from gradcoll import _auth
from gradcoll.errors import GradcollError, ProtocolError
from gradcoll.observe.diagnosis import _MSG, STATUS, ControlChannel
from gradcoll.store import HashStore, TCPStore
from gradcoll.testing import gather_ranks
from gradcoll.transport import shm, tcp
from gradcoll.transport import shm_segment as seg

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_auth.ENV, raising=False)


# -- the store -------------------------------------------------------------------------------


@pytest.mark.scenario("store client without the secret, or with a wrong one", raised="ProtocolError")
def test_store_refuses_clients_without_the_secret_and_logs_them(caplog: pytest.LogCaptureFixture) -> None:
    master = TCPStore(is_master=True, secret="s3cret", timeout=5)
    try:
        good = TCPStore(port=master.port, secret=b"s3cret", timeout=5)
        good.set("a", b"1")
        assert master.get("a") == b"1"
        good.close()
        with caplog.at_level(logging.WARNING, "gradcoll"):
            stranger = TCPStore(port=master.port, timeout=5)  # no secret: every request is refused
            with pytest.raises(GradcollError, match="requires the group's secret"):
                stranger.set("a", b"forged")
        assert "refused a client at ('127.0.0.1'" in caplog.text
        with pytest.raises(ProtocolError, match="does not know the group's secret"):
            TCPStore(port=master.port, secret="wrong", timeout=5)  # a wrong secret cannot verify the server
        assert master.get("a") == b"1"
    finally:
        master.close()


@pytest.mark.scenario("store that does not know the secret", raised="ProtocolError")
def test_a_client_with_a_secret_refuses_a_store_without_one() -> None:
    master = TCPStore(is_master=True, timeout=5)
    try:
        with pytest.raises(ProtocolError, match="does not take a secret"):
            TCPStore(port=master.port, secret="s3cret", timeout=5)
    finally:
        master.close()


@pytest.mark.scenario("store flooded past its byte and key bounds", raised="GradcollError")
def test_store_bounds_bytes_and_keys() -> None:
    master = TCPStore(is_master=True, timeout=5, max_bytes=10_000, max_keys=3)
    try:
        with pytest.raises(GradcollError, match="store is full: .* would pass 10000 bytes"):
            master.set("big", b"x" * 20_000)
        master.set("k1", b"1")
        master.set("k1", b"2")  # replacing a key is no new key
        master.set("k2", b"1")
        master.set("k3", b"1")
        with pytest.raises(GradcollError, match="3 keys"):
            master.set("k4", b"1")
        assert master.delete("k3")
        master.set("k4", b"1")  # deleting gave the room back
        assert not master.check(["big"])
    finally:
        master.close()


@pytest.mark.scenario("stranger announces a 60 MiB store request before proving the secret", raised="refused unread")
def test_a_stranger_before_authentication_cannot_send_a_big_frame() -> None:
    master = TCPStore(is_master=True, secret="s3cret", timeout=5)
    try:
        with socket.create_connection(("127.0.0.1", master.port), timeout=5) as s:
            s.sendall((60 << 20).to_bytes(4, "big"))  # a 60 MiB SET announced before any proof
            reply = s.recv(1024)
            assert b"exceeds the 256-byte limit" in reply
    finally:
        master.close()


# -- tcp links -------------------------------------------------------------------------------


@pytest.mark.scenario("tcp link dialled with another secret", raised="ProtocolError")
def test_tcp_links_need_the_same_secret() -> None:
    store = HashStore(10)
    ts, errors = gather_ranks(lambda r: tcp.create(store, r, 3, timeout=10, secret="k", key_prefix="a"), 3)
    try:
        assert errors == [None, None, None]
        bufs = [np.full(4, r + 1.0) for r in range(3)]

        def exchange(r: int) -> None:
            peer = (r + 1) % 3
            got = np.empty(4)
            ts[r].sendrecv(peer, bufs[r], (r - 1) % 3, got)
            assert got[0] == (r - 1) % 3 + 1

        assert gather_ranks(exchange, 3)[1] == [None, None, None]
    finally:
        for t in ts:
            if t is not None:
                t.close()
    store = HashStore(10)
    _, errors = gather_ranks(lambda r: tcp.create(store, r, 2, timeout=3, secret="k" if r == 0 else "other"), 2)
    assert isinstance(errors[1], ProtocolError) and "does not know the group's secret" in str(errors[1])
    assert errors[0] is not None and "did not connect" in str(errors[0])


@pytest.mark.scenario("100 idle connections and a keyless dialler at startup", raised="none (group served)")
def test_hundred_idle_strangers_and_a_keyless_dialler_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    store, idle = HashStore(20), []

    def boot(r: int) -> Any:
        if r == 1:  # before rank 1 dials: 100 idle connections and one dialler without the secret
            host, port, token = store.get("s/0", 10).decode().split()
            idle.extend(socket.create_connection((host, int(port))) for _ in range(100))
            with socket.create_connection((host, int(port))) as s:
                from gradcoll.transport import frame as fr

                s.sendall(fr.pack_hello(fr.HELLO, 2, 3, bytes.fromhex(token)))
                assert s.recv(64) == b""  # refused: the listener closes
        return tcp.create(store, r, 3, timeout=15, secret="k", key_prefix="s")

    with caplog.at_level(logging.WARNING, "gradcoll.transport.tcp"):
        ts, errors = gather_ranks(boot, 3)
    for s in idle:
        s.close()
    for t in ts:
        if t is not None:
            t.close()
    assert errors == [None, None, None]
    assert "the peer has no secret but this group requires one" in caplog.text


# -- shm segments ----------------------------------------------------------------------------


def _attach(name: str, directory: str, secret: bytes | None = None) -> Any:
    store = HashStore(1)
    store.set("k", f"{socket.gethostname()} {name}".encode())
    return seg._attach(store, "k", directory, socket.gethostname(), 1, 0, seg.Deadline(0.5), secret)


@pytest.mark.scenario("shm segment name of another shape", raised="ProtocolError", per_variant=False)
@pytest.mark.parametrize("name", ["../../etc/fake_segment", "gcshm-1-abcdefabcdef-0-1/../x", "gcshm-1-xyz-0-1",
                                  "gcshm-1-abcdefabcdef-0-2", "fake_segment"])
def test_shm_refuses_names_of_any_other_shape(name: str, tmp_path: Any) -> None:
    with pytest.raises(ProtocolError, match="not gcshm-<pid>-<token>-0-1"):
        _attach(name, str(tmp_path))


@pytest.mark.scenario("shm segment: symlink, mode 0666, no proof", raised="ProtocolError")
def test_shm_refuses_links_other_modes_and_unproven_segments(tmp_path: Any) -> None:
    d, name = str(tmp_path), "gcshm-999999-abcdefabcdef-0-1"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 16384)
    os.symlink(target, tmp_path / name)
    with pytest.raises(ProtocolError, match="refused peer 0's shm segment"):
        _attach(name, d)
    os.unlink(tmp_path / name)
    (tmp_path / name).write_bytes(b"\0" * 16384)
    os.chmod(tmp_path / name, 0o666)
    with pytest.raises(ProtocolError, match="mode 666, not 600"):
        _attach(name, d)
    os.unlink(tmp_path / name)
    real = seg._create(d, name, 4096)  # a real segment, but made by someone without the secret
    try:
        with pytest.raises(ProtocolError, match="does not prove the group's secret"):
            _attach(name, d, b"k")
    finally:
        real.release()


@pytest.mark.scenario("shm link with another secret", raised="ProtocolError")
def test_shm_with_a_secret_connects_and_refuses_a_different_one() -> None:
    store = HashStore(10)
    ts, errors = gather_ranks(lambda r: shm.create(store, r, 2, timeout=5, secret="k", ring_bytes=8192), 2)
    for t in ts:
        if t is not None:
            t.close()
    assert errors == [None, None]
    store = HashStore(10)
    ts, errors = gather_ranks(lambda r: shm.create(store, r, 2, timeout=3, secret=f"k{r}", ring_bytes=8192), 2)
    for t in ts:
        if t is not None:
            t.close()
    assert isinstance(errors[1], ProtocolError) and "does not prove the group's secret" in str(errors[1])


# -- control datagrams -----------------------------------------------------------------------


@pytest.mark.scenario("forged or replayed control datagram", raised="none (dropped and logged)")
def test_control_datagrams_need_the_tag(caplog: pytest.LogCaptureFixture) -> None:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addrs = [s.getsockname() for s in socks]
    token = b"12345678"
    chans = [ControlChannel(socks[r], r, 2, addrs, token, host="127.0.0.1", backend="tcp", options={}, key=b"k")
             for r in range(2)]
    try:
        chans[0].send(1, STATUS, seq=7, text="running")
        chans[1].poll(2.0)
        assert chans[1].replies[0][1] == 7
        # A forgery with the token read from the store, but no tag: dropped and logged.
        forged = _MSG.pack(b"GCCT", 1, STATUS, 0, 0, token, 99, 0.0, 0, 0) + b"stalled"
        socks[0].sendto(forged, addrs[1])
        with caplog.at_level(logging.WARNING, "gradcoll"):
            chans[1].poll(2.0)
        assert chans[1].replies[0][1] == 7 and "does not prove the group's secret" in caplog.text
        # A replay of a genuine datagram is dropped too.
        chans[0].send(1, STATUS, seq=8)
        data = socks[1].recv(4096)
        chans[1].handle(data)
        chans[1].replies.clear()
        chans[1].handle(data)
        assert chans[1].replies == {}
    finally:
        for c in chans:
            c.close()


# -- the whole group -------------------------------------------------------------------------


def _rank(path: str, rank: int, secret: str | None, backend: str, out: Any) -> None:
    from gradcoll.group.rendezvous import init_process_group

    try:
        g = init_process_group(backend, f"file://{path}", rank, 2, timeout=20, startup_timeout=8, secret=secret)
        buf = np.full(8, rank + 1.0)
        g.allreduce(buf, op="sum")
        g.close()
        out.put((rank, float(buf[0])))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        out.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_init_process_group_with_a_secret(backend: str) -> None:
    ctx = multiprocessing.get_context("forkserver")
    for secrets, want in ((("pw", "pw"), 3.0), (("pw", None), None)):
        out = ctx.Queue()
        with tempfile.TemporaryDirectory(prefix="gradcoll-secret-") as tmp:
            procs = [ctx.Process(target=_rank, args=(os.path.join(tmp, "s"), r, secrets[r], backend, out))
                     for r in range(2)]
            for p in procs:
                p.start()
            got = dict(out.get(timeout=40) for _ in range(2))
            for p in procs:
                p.join(10)
        if want is not None:
            assert got == {0: want, 1: want}, got
        else:  # a rank without the secret never completes a collective with the others
            assert all(isinstance(v, str) for v in got.values()), got


def _tls_rank(path: str, rank: int, cert: tuple[str, str], out: Any) -> None:
    from gradcoll.group.rendezvous import init_process_group

    try:
        g = init_process_group("tcp", f"file://{path}", rank, 2, timeout=20, startup_timeout=8, secret="pw",
                               ssl_context=tcp.tls_contexts(*cert))
        assert all(type(ln.sock).__name__ == "SSLSocket" for ln in g.transport._peers)  # type: ignore[attr-defined]
        buf = np.arange(1 << 18, dtype=np.float32) * (rank + 1)
        g.allreduce(buf, op="sum")
        g.close()
        out.put((rank, bool(np.array_equal(buf, np.arange(1 << 18, dtype=np.float32) * 3))))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_init_process_group_over_tls_with_a_secret(tmp_path: Any) -> None:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (apt-get install openssl): TLS needs a certificate")
    cert = (str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", cert[1], "-out", cert[0], "-days", "1", "-subj", "/CN=gradcoll-group"],
                   check=True, capture_output=True, timeout=30)
    ctx = multiprocessing.get_context("forkserver")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tls_rank, args=(str(tmp_path / "s"), r, cert, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=40) for _ in range(2))
    for p in procs:
        p.join(10)
    assert got == {0: True, 1: True}, got

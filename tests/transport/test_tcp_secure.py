"""The tcp transport with a secret (integrity tags on every frame) and with ``ssl_context=`` (TLS).

Tampering runs a man in the middle on 127.0.0.1: two TCP connections and a
relay thread per direction that forwards the byte stream and edits it (a
flipped bit, a replayed, reordered or dropped frame); the two transports
hold the keys a handshake would have given them. Everything else boots
real links through ``tcp.create``. TLS uses a throwaway self-signed
certificate made with the ``openssl`` command at test time.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcoll import _auth, testing
from gradcoll.algorithms import ALLREDUCE
from gradcoll.errors import CollectiveTimeout, GradcollError, ProtocolError, UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.observe.diagnosis import ControlChannel
from gradcoll.testing import gather_ranks
from gradcoll.transport import frame as fr
from gradcoll.transport import tcp
from gradcoll.transport.tcp_connect import Linked, frame_key

pytestmark = pytest.mark.timeout(60)

KEY, TOKEN, N_D, N_L = b"s3cret", b"t" * 16, b"d" * 16, b"l" * 16
K01, K10 = (frame_key(KEY, TOKEN, a, b, N_D, N_L, 5) for a, b in ((0, 1), (1, 0)))
HEAD = fr.HEADER_SIZE + _auth.MAC_SIZE
Edit = Callable[[bytes], bytes]


@pytest.fixture(params=["compiled", "python"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both loop modes: a secure link runs the Python loops, but the wait may still be compiled."""
    if request.param == "python":
        monkeypatch.setattr(tcp, "_IO", None)
    elif tcp._IO is None:
        pytest.skip("the compiled _tcp_io extension is not built (make install builds it)")
    return str(request.param)


# -- the man in the middle --------------------------------------------------------------------
def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname(), timeout=5)
        b, _ = ls.accept()
    a.settimeout(None)
    return a, b


class _Relay:
    """Forwards ``src`` to ``dst``; ``edit`` sees the whole stream so far and says what the receiver gets."""

    def __init__(self, src: socket.socket, dst: socket.socket, edit: Edit | None) -> None:
        self.src, self.dst, self.edit = src, dst, edit
        self.seen = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sent = 0
        try:
            while True:
                d = self.src.recv(1 << 16)
                if not d:
                    break
                self.seen += d
                out = self.edit(bytes(self.seen)) if self.edit else bytes(self.seen)
                if len(out) > sent:  # an edit only ever changes bytes not yet forwarded
                    self.dst.sendall(out[sent:])
                    sent = len(out)
        except OSError:
            pass
        finally:
            try:
                self.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _world(edit01: Edit | None = None, edit10: Edit | None = None, keyed: bool = True) -> list[tcp.TcpTransport]:
    a0, r0 = _tcp_pair()
    a1, r1 = _tcp_pair()
    _Relay(r0, r1, edit01)
    _Relay(r1, r0, edit10)
    keys = ((K01, K10), (K10, K01)) if keyed else ((None, None), (None, None))
    return [tcp.TcpTransport(0, 2, {1: Linked(a0, *keys[0])}, timeout=10),
            tcp.TcpTransport(1, 2, {0: Linked(a1, *keys[1])}, timeout=10)]


def _frame(n: int) -> int:
    return HEAD + n + (_auth.MAC_SIZE if n else 0)


def _flip(at: int) -> Edit:
    return lambda s: s[:at] + bytes([s[at] ^ 1]) + s[at + 1 :] if len(s) > at else s


def test_a_tagged_frame_has_the_documented_layout() -> None:
    a0, r0 = _tcp_pair()
    a1, r1 = _tcp_pair()
    rec = _Relay(r0, r1, None)
    _Relay(r1, r0, None)
    t0 = tcp.TcpTransport(0, 2, {1: Linked(a0, K01, K10)}, timeout=10)
    t1 = tcp.TcpTransport(1, 2, {0: Linked(a1, K10, K01)}, timeout=10)
    try:
        got = bytearray(8)
        t0.send(1, b"abcdefgh", tag=5)
        t1.recv(0, got, tag=5)
        t0.send(1, b"", tag=6)
        t1.recv(0, bytearray(0), tag=6)
        assert bytes(got) == b"abcdefgh"
        seen = bytes(rec.seen)
    finally:
        t0.close()
        t1.close()
    # header | head tag | payload | payload tag; a frame without payload has no payload tag
    tagger, hdr, empty = _auth.Tagger(K01), fr.pack_header(0, 5, 8), fr.pack_header(1, 6, 0)
    want = (hdr + tagger.tag(0, b"H", hdr) + b"abcdefgh" + tagger.tag(0, b"P", hdr, b"abcdefgh")
            + empty + tagger.tag(1, b"H", empty))
    assert seen[: len(want)] == want


# -- tampering: every edit fails the receive with a ProtocolError naming the sender --------------
N = 1000
EDITS: dict[str, Edit] = {
    "header bit": _flip(20),  # the length field of the first frame
    "head tag bit": _flip(30),
    "payload bit": _flip(HEAD + 500),
    "payload tag bit": _flip(HEAD + N + 3),
    "second frame's payload bit": _flip(_frame(N) + HEAD + 7),
    # the first frame again where the second should be (a replay)
    "replay": lambda s: s[: _frame(N)] * 2 + s[2 * _frame(N) :] if len(s) >= 2 * _frame(N) else s[: _frame(N)],
    # the second frame before the first (reordering)
    "reorder": lambda s: s[_frame(N) : 2 * _frame(N)] + s[: _frame(N)] + s[2 * _frame(N) :]
    if len(s) >= 2 * _frame(N) else b"",
    # the first frame's last 10 bytes cut
    "cut": lambda s: s[: _frame(N) - 10] + s[_frame(N) :] if len(s) >= _frame(N) else s[: _frame(N) - 10],
}


@pytest.mark.scenario("tagged tcp frame flipped, replayed, reordered or cut", raised="ProtocolError", per_variant=False)
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_stream_fails_with_a_protocol_error_naming_the_peer(edit: str, mode: str) -> None:
    ts = _world(EDITS[edit])
    try:
        payloads = [np.full(N, i + 1, np.uint8) for i in range(3)]
        for p in payloads:
            ts[0].isend(1, p, tag=3)
        outs = [np.zeros(N, np.uint8) for _ in range(3)]
        got: list[Any] = []
        with pytest.raises(ProtocolError) as err:
            for o in outs:
                ts[1].recv(0, o, tag=3, timeout=10)
                got.append(o)
        for o, p in zip(got, payloads[: len(got)], strict=True):  # what came before the edit is exact
            np.testing.assert_array_equal(o, p)
        assert err.value.rank == 1 and err.value.peer == 0, err.value
        assert "rank 1: peer 0 sent frame seq" in str(err.value) and "integrity tag" in str(err.value)
        # the link is dropped: rank 0 learns of it too (an ABORT, or the closed stream), never silence
        with pytest.raises(GradcollError, match="peer 1"):
            ts[0].recv(1, bytearray(4), timeout=10)
    finally:
        for t in ts:
            t.close()


def _control(n: int) -> list[ControlChannel]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addrs = [s.getsockname() for s in socks]
    return [ControlChannel(socks[r], r, n, addrs, b"12345678", host="127.0.0.1", backend="tcp", options={}, key=KEY)
            for r in range(n)]


@pytest.mark.scenario("payload byte flipped during a tagged allreduce", raised="ProtocolError", per_variant=False)
@pytest.mark.parametrize("algo, direction", [("ring", "0->1"), ("ring", "1->0"), ("star", "1->0"),
                                             ("recursive_doubling", "0->1")])
def test_a_flipped_payload_byte_in_an_allreduce_never_gives_a_wrong_result(algo: str, direction: str,
                                                                              mode: str) -> None:
    count = 1 << 18  # 1 MiB of float32: the flipped byte lies well inside a data frame's payload
    flip = _flip(200_000)
    ts = _world(flip, None) if direction == "0->1" else _world(None, flip)
    chans = _control(2)
    data = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(2)]
    want = data[0] + data[1]  # exact: integers below 2**24
    sender, seer = (0, 1) if direction == "0->1" else (1, 0)

    def rank(r: int) -> np.ndarray:
        g = ProcessGroup(ts[r], timeout=10, stall_warning_s=None, control=chans[r])
        buf = data[r].copy()
        g.allreduce(buf, op="sum", algorithm=algo)
        return buf

    try:
        res, errs = gather_ranks(rank, 2)
    finally:
        for t in ts:
            t.close()
        for c in chans:
            c.close()
    e = errs[seer]
    assert isinstance(e, ProtocolError), errs
    assert f"rank {sender} sent bytes that break the protocol" in str(e), e
    for r in range(2):  # every rank raises, or holds the exact sum it computed from untouched bytes
        if errs[r] is None:
            np.testing.assert_array_equal(res[r], want)
        else:
            assert isinstance(errs[r], GradcollError), errs[r]
    if algo == "ring":  # the ring's other rank still waits for the seer: it raises the same root cause
        other = errs[sender]
        assert isinstance(other, ProtocolError) and f"rank {sender} sent bytes" in str(other), errs


# -- real links: exact allreduces -------------------------------------------------------------
def _allreduce(ts: list[Any], algo: str, count: int) -> None:
    n = len(ts)
    data = [(np.arange(count, dtype=np.float32) % 1000) * (r + 1) for r in range(n)]
    want = np.sum(np.stack(data).astype(np.float64), axis=0)
    res, errs = gather_ranks(lambda r: ALLREDUCE[algo](ts[r], data[r], op="sum", seq=7), n)
    assert errs == [None] * n, errs
    for buf in data:
        np.testing.assert_array_equal(buf, want)


@pytest.mark.parametrize("count", [1000, 3 << 20 >> 2], ids=["4KB", "3MiB"])
@pytest.mark.parametrize("algo", ["ring", "star", "recursive_doubling"])
def test_allreduces_with_a_secret_are_exact(algo: str, count: int, mode: str) -> None:
    ts = testing.threaded_group(tcp.create, 3, timeout=30, secret="s3cret")
    try:
        assert all(ln.secure is not None and ln.secure.rx is not None for t in ts for ln in t._peers)
        _allreduce(ts, algo, count)
    finally:
        for t in ts:
            t.close()


def test_without_a_secret_links_stay_plain() -> None:
    ts = testing.threaded_group(tcp.create, 2, timeout=30)
    try:
        assert all(ln.secure is None for t in ts for ln in t._peers)
        _allreduce(ts, "ring", 1000)
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("check", list(testing.CHECKS))
def test_conformance_with_a_secret(check: str) -> None:
    testing.run_check(check, lambda n: testing.threaded_group(tcp.create, n, timeout=30, secret="s3cret"), size=3,
                      timeout=30)


# -- TLS --------------------------------------------------------------------------------------
def _cert(directory: Path, name: str) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (apt-get install openssl): TLS tests need a certificate")
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}"],
                   check=True, capture_output=True, timeout=30)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("tls")
    return {name: _cert(d, name) for name in ("group", "stranger")}


def _tls(certs: dict[str, tuple[str, str]], name: str = "group") -> tuple[ssl.SSLContext, ssl.SSLContext]:
    return tcp.tls_contexts(*certs[name])


@pytest.mark.parametrize("count", [1000, 3 << 20 >> 2], ids=["4KB", "3MiB"])
@pytest.mark.parametrize("algo", ["ring", "star", "recursive_doubling"])
@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["tls", "tls+secret"])
def test_allreduces_over_tls_are_exact(certs: dict[str, tuple[str, str]], algo: str, count: int,
                                       secret: str | None) -> None:
    ts = testing.threaded_group(tcp.create, 3, timeout=30, ssl_context=_tls(certs), secret=secret)
    try:
        assert all(isinstance(ln.sock, ssl.SSLSocket) for t in ts for ln in t._peers)
        _allreduce(ts, algo, count)
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("check", list(testing.CHECKS))
def test_conformance_over_tls(certs: dict[str, tuple[str, str]], check: str) -> None:
    ctx = _tls(certs)
    testing.run_check(check, lambda n: testing.threaded_group(tcp.create, n, timeout=30, ssl_context=ctx), size=3,
                      timeout=30)


@pytest.mark.scenario("TLS peer with a certificate of another authority", raised="ProtocolError")
def test_a_peer_with_the_wrong_certificate_is_refused(certs: dict[str, tuple[str, str]],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    from gradcoll.store import HashStore

    store = HashStore(10)
    ctxs = [_tls(certs), _tls(certs, "stranger")]
    with caplog.at_level("WARNING", "gradcoll.transport.tcp"):
        ts, errs = gather_ranks(lambda r: tcp.create(store, r, 2, timeout=3, ssl_context=ctxs[r]), 2)
    for t in ts:
        if t is not None:
            t.close()
    dialler, listener = errs[1], errs[0]
    assert isinstance(dialler, ProtocolError) and dialler.peer == 0, errs
    assert "refused peer 0: the TLS handshake with 127.0.0.1:" in str(dialler), dialler
    assert "certificate verify failed" in str(dialler), dialler
    assert isinstance(listener, CollectiveTimeout) and "peers [1] did not connect" in str(listener), errs
    assert "refused a connection from" in caplog.text


def test_ssl_context_must_be_contexts(certs: dict[str, tuple[str, str]]) -> None:
    from gradcoll.store import HashStore

    server, client = _tls(certs)
    for bad in ("cert.pem", (server,), (client, server)):
        with pytest.raises(UsageError, match="ssl_context"):
            tcp.create(HashStore(1), 0, 1, timeout=1, ssl_context=bad)


def test_a_tagged_send_that_timed_out_half_way_finishes_from_a_copy(mode: str) -> None:
    """The rest of the frame goes on in the background from a copy: its tag still matches, and what the caller
    writes into its buffer afterwards never reaches the peer."""
    a, b = _tcp_pair()
    ts = [tcp.TcpTransport(0, 2, {1: Linked(a, K01, K10)}, timeout=10),
          tcp.TcpTransport(1, 2, {0: Linked(b, K10, K01)}, timeout=10)]
    try:
        data = np.arange(1 << 21, dtype=np.uint32)  # 8 MiB: more than both socket buffers hold; rank 1 reads none
        with pytest.raises(CollectiveTimeout, match="peer 1"):
            ts[0].send(1, data, tag=3, timeout=0.2)
        sent, data[:] = data.copy(), 0
        got, record = np.empty_like(data), bytearray(6)

        def rank(r: int) -> None:
            if r == 0:  # its wait drives the rest of the first frame out ahead of this one
                ts[0].send(1, b"record", tag=4, timeout=10)
            else:
                ts[1].recv(0, got, tag=3, timeout=10)
                ts[1].recv(0, record, tag=4, timeout=10)

        assert gather_ranks(rank, 2, join_timeout=30)[1] == [None, None]
        assert (got == sent).all() and record == b"record"
    finally:
        for t in ts:
            t.close()

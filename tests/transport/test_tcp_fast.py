"""tcp's compiled step (``gradcoll.transport.tcp_fast``), and the recursive doubling whose rounds run compiled.

Ranks are threads over real tcp links (``threaded_group``), processes for a
killed peer (the fault harness), or a raw socket playing the peer byte for
byte. Every test checks which path ran (``outcomes``): a test of the step
that silently ran the general path would prove nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE, tags
from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, ProtocolError, TransportBroken, TransportClosed
from gradcoll.testing import gather_ranks, threaded_group
from gradcoll.transport import frame as fr
from gradcoll.transport import tcp, tcp_fast, tcp_rounds
from gradcoll.transport.frame import FrameMismatch
from tests.faults._harness import problems, run_collective_fault
from tests.transport.test_tcp import _read_exactly as _read

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")]

RD = ALLREDUCE["recursive_doubling"]
DECLINED, MOVED, REDUCED, NONFINITE = tcp_fast.DECLINED, tcp_fast.MOVED, tcp_fast.REDUCED, tcp_fast.NONFINITE


@pytest.fixture
def outcomes(monkeypatch) -> list[Any]:
    """Every outcome of the compiled step in this test, in order (the class of what it raised, when it raised);
    ``("rounds", k)`` for a call of several rounds in one (``tcp_rounds.Runner``) that did ``k`` of them."""
    seen: list[Any] = []

    def spy(module: Any, name: str) -> Any:
        real = getattr(module, name)

        def call(*a: Any, **k: Any) -> int:
            try:
                out = real(*a, **k)
            except BaseException as e:
                seen.append(type(e))
                raise
            seen.append(out if name == "exchange_reduce" else ("rounds", out))  # (a Runner)
            return out

        return call

    monkeypatch.setattr(tcp_fast, "exchange_reduce", spy(tcp_fast, "exchange_reduce"))
    # every call of several rounds: exchange_plan's, exchange_rounds' and the prepared calls' (the group's fast path)
    monkeypatch.setattr(tcp_rounds.Runner, "__call__", spy(tcp_rounds.Runner, "__call__"))
    return seen


def pure_python(monkeypatch: Any) -> None:
    """``GRADCOLL_TCP_PURE_PYTHON=1`` from here on: no compiled loops; the calls prepared before (the rounds the
    algorithms and the group keep per size, ``tcp_rounds.Runner``) decline, as they do where the extension is
    not built."""
    monkeypatch.setattr(tcp, "_IO", None)
    monkeypatch.setattr(tcp_rounds.Runner, "__call__", lambda *a: 0)


def steps(n: int) -> Counter[Any]:
    """The outcomes of a healthy allreduce on ``n`` ranks (a power of two): all its rounds in one call."""
    return Counter({("rounds", n.bit_length() - 1): n})


@pytest.fixture(scope="module")
def worlds():
    made: dict[int, list[Any]] = {}

    def get(n: int) -> list[Any]:
        if n not in made:
            made[n] = threaded_group(tcp.create, n, timeout=20)
        return made[n]

    yield get
    for ts in made.values():
        for t in ts:
            t.close()


def rd_reference(data: list[np.ndarray], op: str) -> np.ndarray:
    """Recursive doubling's sum, in its grouping: blocks of 2, 4, ... added pairwise."""
    level = list(data)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0] / data[0].dtype.type(len(data)) if op == "mean" else level[0]


def allreduce_all(ts: list[Any], bufs: list[np.ndarray], **kw: Any) -> list[BaseException | None]:
    kw.setdefault("timeout", 10.0)
    _, errors = gather_ranks(lambda r: RD(ts[r], bufs[r], **kw), len(ts), join_timeout=60)
    return errors


# -- exact results ----------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("count", [0, 1, 1000, 8192])
def test_small_allreduce_is_exact_and_takes_the_compiled_step(worlds, outcomes, n, dtype, op, count) -> None:
    ts = worlds(n)
    rng = np.random.default_rng(count + n)
    data = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    bufs = [d.copy() for d in data]
    assert allreduce_all(ts, bufs, op=op, seq=11) == [None] * n
    want = rd_reference(data, op)
    for b in bufs:
        assert b.tobytes() == want.tobytes()  # bitwise, on every rank
    assert Counter(outcomes) == steps(n)


def test_the_same_bits_as_the_general_path(worlds, outcomes, monkeypatch) -> None:
    ts = worlds(4)
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(3001).astype(np.float32) * 1e3 for _ in range(4)]
    stepped = [d.copy() for d in data]
    assert allreduce_all(ts, stepped, seq=1) == [None] * 4
    assert Counter(outcomes) == steps(4)
    pure_python(monkeypatch)  # GRADCOLL_TCP_PURE_PYTHON=1: the engine in Python, the general path
    general = [d.copy() for d in data]
    outcomes.clear()
    assert allreduce_all(ts, general, seq=2) == [None] * 4
    assert outcomes == []
    assert all(a.tobytes() == general[0].tobytes() for a in stepped + general)


def test_buffers_over_the_limit_and_other_sizes_take_the_general_path(worlds, outcomes, monkeypatch) -> None:
    monkeypatch.setattr(tcp_fast, "SMALL_BYTES", 4096)
    big = tcp_fast.SMALL_BYTES // 4 + 1
    ts = worlds(2)
    bufs = [np.full(big, r + 1.0, np.float32) for r in range(2)]
    assert allreduce_all(ts, bufs, op="sum") == [None] * 2
    assert all((b == 3.0).all() for b in bufs) and outcomes == [("rounds", 0)] * 2  # declined: the guard's path
    outcomes.clear()
    ts3 = worlds(3)  # not a power of two: fold and unfold steps, the general path's
    bufs = [np.full(10, r + 1.0, np.float32) for r in range(3)]
    assert allreduce_all(ts3, bufs, op="sum") == [None] * 3
    assert all((b == 6.0).all() for b in bufs) and outcomes == []


def test_a_secret_keeps_the_tagged_frames_on_their_own_path(outcomes) -> None:
    ts = threaded_group(tcp.create, 2, timeout=20, secret=b"s3cret")
    try:
        bufs = [np.full(64, r + 1.0) for r in range(2)]
        assert allreduce_all(ts, bufs, op="sum") == [None] * 2
        assert all((b == 3.0).all() for b in bufs) and outcomes == [("rounds", 0)] * 2  # declined: the guard's
    finally:
        for t in ts:
            t.close()


# -- the guarantees on the compiled step ----------------------------------------------
def test_a_nan_input_halts_every_rank_naming_it(worlds, outcomes) -> None:
    ts = worlds(4)
    bufs = [np.ones(1024, np.float32) for _ in range(4)]
    bufs[2][37] = np.nan  # rank 2 declines (its first call checks its input): the others' steps meet its NaN
    for r, e in enumerate(allreduce_all(ts, bufs, seq=7)):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq, e.rank) == (2, 37, 7, r)
    # rank 2's rounds in one call decline (its guard's path runs them); the others' all run, carrying the NaN
    assert DECLINED not in outcomes and outcomes.count(("rounds", 0)) == 1
    assert outcomes.count(("rounds", 2)) == 3


#: float32 elements in the first piece the step checks before it sends anything (``tcp_fast.PIECE_BYTES``).
PIECE = tcp_fast.PIECE_BYTES // 4


@pytest.mark.parametrize("n,dtype", [(2, np.float32), (4, np.float32), (2, np.float64)])
def test_large_buffers_take_the_step_with_the_general_paths_bits(worlds, outcomes, monkeypatch, n, dtype,
                                                                staging) -> None:
    ts = worlds(n)
    rng = np.random.default_rng(n)
    m = 5 * PIECE + 12345  # several pieces ahead of the receive, several reductions while the bytes move, a tail
    data = [(rng.standard_normal(m) * 1e3).astype(dtype) for _ in range(n)]
    stepped = [d.copy() for d in data]
    assert allreduce_all(ts, stepped, seq=3) == [None] * n
    assert Counter(outcomes) == steps(n)
    pure_python(monkeypatch)
    general = [d.copy() for d in data]
    assert allreduce_all(ts, general, seq=4) == [None] * n
    assert all(a.tobytes() == general[0].tobytes() for a in stepped + general)
    want = sum(d.astype(np.float64) for d in data) / n
    assert np.allclose(general[0], want, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("where", [PIECE + 7, 4 * PIECE + 1])
def test_a_non_finite_input_past_the_first_piece_names_its_rank_and_element(worlds, outcomes, where, staging) -> None:
    ts = worlds(4)
    bufs = [np.ones(5 * PIECE, np.float32) for _ in range(4)]
    bufs[1][where] = -np.inf  # found once rank 1's frame has started: every step still moves, rank 1 is named
    for r, e in enumerate(allreduce_all(ts, bufs, seq=8)):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq, e.rank) == (1, where, 8, r), str(e)
    assert outcomes == [("rounds", 2)] * 4  # every rank's rounds ran whole, the NaN carried to the end


def _pair(mine_sndbuf: int, peer_sndbuf: int) -> tuple[Any, socket.socket]:
    """Rank 0's transport over a socket pair with these send buffers, and the raw peer socket."""
    mine, peer = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, mine_sndbuf)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, peer_sndbuf)
    peer.settimeout(20)
    return tcp.TcpTransport(0, 2, {1: mine}, timeout=20), peer


def _spy_rest(monkeypatch) -> list[int]:
    """Where every ``reduce_rest`` of the test starts (its ``done``)."""
    rest: list[int] = []
    real = tcp._IO.reduce_rest

    def spy(acc: np.ndarray, tmp: np.ndarray, done: int, *a: Any) -> int:
        rest.append(done)
        return int(real(acc, tmp, done, *a))

    monkeypatch.setattr(tcp._IO, "reduce_rest", spy)
    return rest


def wake_with_a_send(t: Any, peer: socket.socket) -> None:
    """Another thread's send wakes a running step (the engine finishes its frames); the send goes out whole."""
    req = t.isend(1, b"user", tag=9)
    assert req.wait(5) == 4
    assert _read(peer, fr.HEADER_SIZE + 4) == fr.pack_header(1, 9, 4) + b"user"


@pytest.mark.parametrize("m,first", [(40000, 30000), (300000, 250000)])  # the second wraps the receive ring
def test_a_step_stopped_after_reducing_part_of_the_frame_reduces_only_the_rest(monkeypatch, m, first) -> None:
    monkeypatch.setattr(tcp_fast, "PIECE_BYTES", 256 << 10)  # a 512 KiB ring, which the second case wraps
    monkeypatch.setattr(tcp_fast, "RING_BYTES", 512 << 10)
    t, peer = _pair(4 << 20, 4 << 20)
    rest = _spy_rest(monkeypatch)
    try:
        theirs = _frame(0, np.full(m, 2.0, np.float32))
        peer.sendall(theirs[: 24 + 4 * first])  # there before the step starts: reduced in its first pass
        acc = np.ones(m, np.float32)
        result: list[Any] = []
        th = threading.Thread(target=lambda: result.append(_step(t, acc)))
        th.start()
        assert _read(peer, 24 + 4 * m) == _frame(0, np.ones(m, np.float32))
        wake_with_a_send(t, peer)
        peer.sendall(theirs[24 + 4 * first :])
        th.join(10)
        assert result == [REDUCED] and (acc == 3.0).all()  # the first part reduced once, the rest after
        if m * 4 <= tcp_fast.RING_BYTES:
            assert rest == [first]  # all there before the step started: reduced in one piece
        else:  # what the ring held unreduced went to tmp at its offsets (spilled across the ring's end)
            assert len(rest) == 1 and tcp_fast.RING_BYTES // 4 < rest[0] <= first
    finally:
        t.close()
        peer.close()


def test_an_overflow_in_the_compiled_reduce_halts_every_rank(worlds, outcomes) -> None:
    ts = worlds(2)
    bufs = [np.full(40, 3e38, np.float32) for _ in range(2)]
    for e in allreduce_all(ts, bufs, op="sum"):
        assert isinstance(e, NonFiniteError) and e.contributor is None and "overflowed" in str(e), e
    assert outcomes == [("rounds", 1)] * 2  # the round ran whole; its sum is the marker every rank reads


@pytest.mark.parametrize("field", ["count", "dtype", "op"])
def test_a_mismatch_raises_on_every_rank_naming_both_sides(worlds, outcomes, field) -> None:
    ts, odd = worlds(4), 3

    def fn(r: int) -> Any:
        count = 11 if (field == "count" and r == odd) else 10
        dtype = np.float64 if (field == "dtype" and r == odd) else np.float32
        op = "sum" if (field == "op" and r == odd) else "mean"
        return RD(ts[r], np.ones(count, dtype), op=op, seq=5, timeout=5.0)

    _, errors = gather_ranks(fn, 4, join_timeout=60)
    for e in errors:
        assert isinstance(e, CollectiveMismatch), errors
        assert "rank 0 called" in str(e) and f"rank {odd} called" in str(e)
    assert FrameMismatch in outcomes  # the stray frame went to the engine, which judged it
    bufs = [np.full(8, 1.0, np.float32) for _ in range(4)]  # every link still in step
    assert allreduce_all(ts, bufs, op="sum", seq=6) == [None] * 4 and all((b == 4.0).all() for b in bufs)


def test_a_rank_that_never_calls_is_named_by_every_other(worlds, outcomes) -> None:
    ts, absent = worlds(4), 1

    def fn(r: int) -> Any:
        if r != absent:
            return RD(ts[r], np.ones(64, np.float32), seq=3, timeout=0.3)

    _, errors = gather_ranks(fn, 4, join_timeout=60)
    for r, e in enumerate(errors):
        if r == absent:
            assert e is None
            continue
        assert isinstance(e, CollectiveTimeout), (r, e)
        assert e.missing == [absent] and e.seq == 3 and e.nbytes == 256 and f"rank(s) {absent} stalled in" in str(e)
    assert CollectiveTimeout in outcomes  # rank 1's partner timed out in its step


@pytest.mark.parametrize("fault", ["kill-mid", "stop-mid"])
@pytest.mark.parametrize("victim", [0, 3])
def test_a_peer_killed_or_stopped_on_the_step_is_named_by_every_survivor(fault, victim) -> None:
    out = run_collective_fault("tcp", "recursive_doubling", fault, victim=victim, timeout=2.0, buffer="4KiB")
    assert problems(out) == []


# -- the engine takes over where the step stops ---------------------------------------
@pytest.fixture
def raw():
    """Rank 0's TcpTransport whose peer (rank 1) is a raw socket the test drives byte by byte."""
    mine, theirs = socket.socketpair()
    t = tcp.TcpTransport(0, 2, {1: mine}, timeout=10)
    theirs.settimeout(10)
    yield t, theirs
    t.close()
    theirs.close()


TAG = tags.DESCRIPTOR_FIRST + tags.RD_ROUND


def _step(t: Any, acc: np.ndarray, timeout: float = 5.0) -> int:
    return t.exchange_reduce(1, acc, np.empty_like(acc), TAG, timeout, 1.0, False, True)


def _frame(seq: int, data: np.ndarray, tag: int = TAG) -> bytes:
    return fr.pack_header(seq, tag, data.nbytes) + data.tobytes()


def test_the_step_puts_the_engines_frame_on_the_wire(raw) -> None:
    t, peer = raw
    acc = np.arange(8, dtype=np.float32)
    peer.sendall(_frame(0, np.ones(8, np.float32)))
    assert _step(t, acc) == REDUCED and (acc == np.arange(8) + 1).all()
    assert _read(peer, 24 + 32) == _frame(0, np.arange(8, dtype=np.float32))
    t.send(1, b"abc", tag=7)  # the seqs moved on: the next frame is seq 1
    assert peer.recv(64) == fr.pack_header(1, 7, 3) + b"abc"


def test_a_header_split_across_writes_is_read_in_pieces(raw) -> None:
    t, peer = raw
    wire = _frame(0, np.full(1000, 2.0, np.float32))
    peer.sendall(wire[:10])

    def rest() -> None:
        peer.recv(fr.HEADER_SIZE)  # rank 0 is in its step: its frame is out
        peer.sendall(wire[10:30])
        peer.sendall(wire[30:])

    th = threading.Thread(target=rest)
    th.start()
    acc = np.ones(1000, np.float32)
    assert _step(t, acc) == REDUCED and (acc == 3.0).all()
    th.join(10)


def test_a_stray_frame_is_a_frame_mismatch_and_the_link_stays(raw) -> None:
    t, peer = raw
    peer.sendall(_frame(0, np.full(4, 5.0, np.float32), tag=TAG + 256))  # another call's tag, this length
    with pytest.raises(FrameMismatch, match="rank 0: recv from peer 1 expected seq 0") as info:
        _step(t, np.ones(4, np.float32))
    assert info.value.tag == TAG + 256 and info.value.payload == np.full(4, 5.0, np.float32).tobytes()
    peer.sendall(_frame(1, np.ones(2, np.float32)))  # the stream is in step: seq 1 is next
    acc = np.ones(2, np.float32)
    assert _step(t, acc) == REDUCED and (acc == 2.0).all()


def test_a_shorter_stray_frame_leaves_the_next_frame_intact(raw) -> None:
    t, peer = raw
    peer.sendall(_frame(0, np.full(2, 5.0, np.float32), tag=TAG + 256) + _frame(1, np.full(8, 3.0, np.float32)))
    with pytest.raises(FrameMismatch):
        _step(t, np.ones(8, np.float32))  # read 8 floats' worth: the stray and part of the next frame
    assert _step(t, np.ones(8, np.float32)) == DECLINED  # those bytes wait in the stash: the engine serves them
    out = np.empty(8, np.float32)
    assert t.recv(1, out, tag=TAG, timeout=5) == 32 and (out == 3.0).all()
    acc = np.ones(8, np.float32)
    peer.sendall(_frame(2, np.ones(8, np.float32)))
    assert _step(t, acc) == REDUCED and (acc == 2.0).all()  # the stash is empty again


@pytest.mark.parametrize("claimed", [1 << 30, 1 << 40])
def test_a_hostile_length_is_refused_unread(raw, claimed) -> None:
    t, peer = raw
    peer.sendall(fr.pack_header(0, TAG + 256, claimed))
    with pytest.raises(ProtocolError, match=f"peer 1 sent a frame of {claimed} bytes .* refused unread"):
        _step(t, np.ones(4, np.float32))
    _read(peer, 16 + fr.HEADER_SIZE)  # this rank's own frame
    assert _read(peer, fr.HEADER_SIZE)[0] == fr.ABORT  # the peer is told


@pytest.mark.parametrize(
    "wire, error, words",
    [
        (fr.pack_header(0, TAG, 16) + b"x" * 10, TransportBroken, "middle of a message"),
        (b"", TransportBroken, "without an orderly close"),
        (struct.pack("<B3xIQQ", 9, TAG, 0, 16), ProtocolError, "broke the protocol"),
        (fr.pack_header(0, 0, 0, fr.CLOSE), TransportClosed, "closed the link"),
        (fr.pack_header(0, fr.ABORT_TIMEOUT, 0, fr.ABORT), TransportBroken, "after a timeout on its side"),
        (fr.pack_header(5, TAG, 16), CollectiveMismatch, "expected seq 0 tag"),
    ],
)
def test_peer_faults_during_the_step(raw, wire, error, words) -> None:
    t, peer = raw
    peer.sendall(wire)
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(error, match="rank 0") as info:
        _step(t, np.ones(4, np.float32))
    assert words in str(info.value)
    assert _step(t, np.ones(4, np.float32)) == DECLINED  # a failed link: the general path raises its failure
    with pytest.raises((TransportBroken, TransportClosed)):
        t.recv(1, bytearray(1), timeout=5)


def test_a_silent_peer_times_out_and_the_link_stays(raw) -> None:
    t, peer = raw
    with pytest.raises(CollectiveTimeout, match="peer 1"):
        _step(t, np.ones(4, np.float32), timeout=0.2)
    # the send went out whole, the receive was withdrawn before a byte: the stream is in step
    assert _read(peer, 24 + 16) == _frame(0, np.ones(4, np.float32))
    peer.sendall(_frame(0, np.ones(4, np.float32)))
    out = np.empty(4, np.float32)
    assert t.recv(1, out, tag=TAG, timeout=5) == 16 and (out == 1.0).all()


def test_a_peer_that_trickles_its_frame_times_out_within_the_limit(raw, monkeypatch) -> None:
    # Every byte moved restarts the step's spin (STEP_SPIN_S); the limit is still checked while it spins, so a
    # peer that keeps sending a byte at a time cannot hold the step past it. The spin is made longer than the
    # whole trickle, so that only the check can end the step before the frame is complete.
    monkeypatch.setattr(tcp_fast, "STEP_SPIN_S", 60.0)
    t, peer = raw
    frame = _frame(0, np.ones(1 << 12, np.float32))  # 16 KiB: a byte every 300 us or more takes 5 s
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(frame)):
            if stop.is_set():
                return
            try:
                peer.send(frame[i:i + 1])
            except OSError:
                return
            time.sleep(300e-6)  # paces the bytes (and lets the step's thread have the GIL); synchronises nothing

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeout, match="peer 1"):
            _step(t, np.ones(1 << 12, np.float32), timeout=0.2)
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join(10)
    assert took < 2.0, f"the step ran {took:.2f} s past a 0.2 s limit"


def test_another_threads_send_waits_for_the_step_and_wakes_it(raw) -> None:
    t, peer = raw
    acc = np.ones(4, np.float32)
    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append(_step(t, acc)))
    th.start()
    assert _read(peer, 24 + 16) == _frame(0, np.ones(4, np.float32))  # the step sent its frame and waits
    req = t.isend(1, b"user", tag=9)  # queued behind the step, never written beside it
    assert req.wait(5) == 4
    assert _read(peer, fr.HEADER_SIZE + 4) == fr.pack_header(1, 9, 4) + b"user"
    peer.sendall(_frame(0, np.full(4, 2.0, np.float32)))
    th.join(10)
    assert result == [REDUCED] and (acc == 3.0).all()  # handed to the engine, then reduced (reduce_rest)


def test_close_from_another_thread_ends_the_step(raw) -> None:
    t, peer = raw
    errors: list[BaseException] = []

    def step() -> None:
        try:
            _step(t, np.ones(4, np.float32), timeout=30)
        except BaseException as e:  # noqa: BLE001 - inspected below
            errors.append(e)

    th = threading.Thread(target=step)
    th.start()
    _read(peer, 24 + 16)  # the step is waiting for the peer
    t.close()
    th.join(10)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], TransportClosed), errors



def test_a_step_stopped_with_received_bytes_it_could_not_reduce_hands_them_over(monkeypatch) -> None:
    """The peer's bytes arrive faster than this rank's own go out (its socket takes little): the ring holds
    received elements that may not be reduced yet (their own bytes are not on the wire), across the ring's end.
    A wake-up stops the step: those bytes go to ``tmp`` at their offsets, and the engine and ``reduce_rest``
    finish with the exact result."""
    import fcntl
    import termios

    monkeypatch.setattr(tcp_fast, "PIECE_BYTES", 256 << 10)  # the geometry below: a 512 KiB ring, 600 KB sent first
    monkeypatch.setattr(tcp_fast, "RING_BYTES", 512 << 10)
    t, peer = _pair(16 << 10, 4 << 20)
    rest = _spy_rest(monkeypatch)
    try:
        m, first = 200000, 150000  # 600 KB of the peer's frame before the step starts: more than the ring
        theirs = _frame(0, np.full(m, 2.0, np.float32))
        peer.sendall(theirs[: 24 + 4 * first])
        acc = np.ones(m, np.float32)
        result: list[Any] = []
        th = threading.Thread(target=lambda: result.append(_step(t, acc)))
        th.start()
        deadline = time.monotonic() + 10
        queued = np.zeros(1, np.int32)
        while True:  # until the step has read what its ring takes (a bounded wait on the socket's state)
            fcntl.ioctl(peer.fileno(), termios.TIOCOUTQ, queued)
            if 24 + 4 * first - int(queued[0]) > tcp_fast.RING_BYTES or time.monotonic() > deadline:
                break
        req = t.isend(1, b"user", tag=9)  # wakes the step, which can move nothing more until the peer does
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(_read(peer, 24 + 4 * m + fr.HEADER_SIZE + 4)))
        reader.start()
        peer.sendall(theirs[24 + 4 * first :])
        assert req.wait(10) == 4
        th.join(20)
        reader.join(20)
        assert result == [REDUCED] and (acc == 3.0).all()
        assert got == [_frame(0, np.ones(m, np.float32)) + fr.pack_header(1, 9, 4) + b"user"]
        assert len(rest) == 1 and rest[0] < first  # it stopped with received bytes not reduced
    finally:
        t.close()
        peer.close()


# -- sends through the staging buffer (sources the kernel would copy slowly: 4K aliasing) -------------------
def at_page_offset(count: int, dtype: Any, offset: int) -> np.ndarray:
    """An array of ``count`` elements starting ``offset`` bytes into a 4 KiB page."""
    item = np.dtype(dtype).itemsize
    raw = np.empty(count * item + 8192, np.uint8)
    k = (offset - raw.ctypes.data) % 4096
    out: np.ndarray = raw[k:k + count * item].view(dtype)
    return out


@pytest.mark.parametrize("offset,staged", [(16, True), (4080, True), (24, False), (2048, False), (40, False)])
def test_which_sources_the_send_stages(offset, staged) -> None:
    """The payload lands 24 bytes past a page start in the socket's pages: 1-63 bytes past its own page offset
    is the slow copy (a large NumPy array starts 16 bytes into its page)."""
    a = at_page_offset(8, np.float32, offset)
    assert tcp._IO.aliased(a.ctypes.data) is staged
    assert tcp._IO.aliased(np.empty(1 << 20, np.float32).ctypes.data) in (True, False)


@pytest.fixture(params=[True, False], ids=["staging", "no-staging"])
def staging(request, monkeypatch) -> bool:
    """Sends stage (``tcp_fast.STAGING``) or not, whatever this CPU's copy measured."""
    monkeypatch.setattr(tcp_fast, "STAGING", request.param)
    return bool(request.param)


def test_whether_sends_stage_is_measured_once() -> None:
    ratio = tcp._IO.copy_alias_ratio(16 << 10, 3)
    assert isinstance(ratio, float) and ratio > 0
    before = tcp_fast.STAGING
    try:
        tcp_fast.STAGING = None
        first = tcp_fast.staging(tcp._IO)
        assert tcp_fast.STAGING is first and tcp_fast.staging(tcp._IO) is first
        for value, want in (("1", True), ("0", False)):  # GRADCOLL_TCP_STAGE decides instead of the measurement
            tcp_fast.STAGING = None
            os.environ["GRADCOLL_TCP_STAGE"] = value
            try:
                assert tcp_fast.staging(tcp._IO) is want
            finally:
                del os.environ["GRADCOLL_TCP_STAGE"]
    finally:
        tcp_fast.STAGING = before


@pytest.mark.parametrize("offset", [16, 2048])
@pytest.mark.parametrize("m", [1000, 300_001])  # the second: more than the stage holds, and partial sends
def test_a_staged_step_puts_the_same_bytes_on_the_wire(offset, m, staging) -> None:
    t, peer = _pair(64 << 10, 4 << 20)
    try:
        acc = at_page_offset(m, np.float32, offset)
        acc[:] = np.arange(m, dtype=np.float32) * np.float32(0.75) - 5
        mine = acc.copy()
        theirs = (np.arange(m, dtype=np.float32) % 977).astype(np.float32)
        peer.sendall(_frame(0, theirs))
        result: list[Any] = []
        th = threading.Thread(target=lambda: result.append(_step(t, acc)))
        th.start()
        assert _read(peer, 24 + 4 * m) == _frame(0, mine)  # read slowly enough for the send to stop and go on
        th.join(10)
        assert result == [REDUCED] and acc.tobytes() == (mine + theirs).tobytes()
    finally:
        t.close()
        peer.close()


@pytest.mark.parametrize("offset", [16, 2048])
def test_a_staged_frame_send_puts_the_same_bytes_on_the_wire(raw, offset, staging) -> None:
    t, peer = raw
    m = 400_003
    buf = at_page_offset(m, np.float32, offset)
    buf[:] = np.arange(m, dtype=np.float32) * np.float32(-0.5)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_read(peer, 24 + 4 * m)))
    reader.start()
    assert t.isend(1, buf, tag=7).wait(10) == 4 * m  # the socket takes part at a time: the send stops and goes on
    reader.join(10)
    assert got == [fr.pack_header(0, 7, 4 * m) + buf.tobytes()]

"""tcp's recursive-doubling rounds in one compiled call (``gradcoll.transport.tcp_rounds``).

Rank 0 of a 4-rank TcpTransport whose round partners (rank 1, then rank 2)
are raw sockets the test drives byte by byte, so that every round can be
stopped where the test wants: what each round puts on the wire, the order
of the sums, the seqs after, and the hand-over of a stopped round to the
engine. Group-level results and faults on 4 ranks are in test_tcp_fast.py.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import tags
from gradcoll.errors import CollectiveTimeout, TransportBroken
from gradcoll.transport import frame as fr
from gradcoll.transport import plan, tcp, tcp_fast
from gradcoll.transport.frame import FrameMismatch
from tests.transport import test_tcp_fast as step_tests
from tests.transport.test_tcp import _read_exactly as _read

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")]

TAG = tags.DESCRIPTOR_FIRST + tags.RD_ROUND


@pytest.fixture
def two():
    """Rank 0 of 4 with raw peers 1 and 2 (its partners in rounds 0 and 1)."""
    pairs = {p: socket.socketpair() for p in (1, 2)}
    t = tcp.TcpTransport(0, 4, {p: mine for p, (mine, _) in pairs.items()}, timeout=10)
    peers = {p: theirs for p, (_, theirs) in pairs.items()}
    for s in peers.values():
        s.settimeout(10)
    yield t, peers
    t.close()
    for s in peers.values():
        s.close()


def _frame(seq: int, data: np.ndarray, tag: int = TAG) -> bytes:
    return fr.pack_header(seq, tag, data.nbytes) + data.tobytes()


def _rounds(t: Any, acc: np.ndarray, divisor: float = 4.0, timeout: float = 5.0, check: bool = True,
            found: list[Any] | None = None, at: list[int] | None = None) -> int:
    return int(t.exchange_rounds((1, 2), acc, np.empty_like(acc), TAG, timeout, divisor, check,
                                 [] if found is None else found, [0] if at is None else at))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_round_sends_the_partial_sum_and_the_last_divides(two, dtype) -> None:
    t, peers = two
    x = np.arange(1000, dtype=dtype) * dtype(0.37)
    a, b = np.full(1000, 1.5, dtype), np.linspace(-3, 3, 1000).astype(dtype)
    peers[1].sendall(_frame(0, a))
    peers[2].sendall(_frame(0, b))
    acc = x.copy()
    assert _rounds(t, acc) == 2
    assert acc.tobytes() == (((x + a) + b) / dtype(4)).tobytes()  # the fused accumulate's bits, round by round
    assert _read(peers[1], 24 + x.nbytes) == _frame(0, x)
    assert _read(peers[2], 24 + x.nbytes) == _frame(0, x + a)  # round 1 sends round 0's sum
    for p in (1, 2):  # both links' seqs moved on
        t.send(p, b"abc", tag=7)
        assert _read(peers[p], 27) == fr.pack_header(1, 7, 3) + b"abc"


def test_the_compiled_frame_hands_the_links_back_as_the_engine_expects(two) -> None:
    """The frame around the rounds runs in C (``_tcp_io.PlanCall``): after a call the transport is no longer
    driven and each link's seqs moved on by its rounds; a call that finds another thread's wake-up pending declines
    before a byte moves, the seqs and the driver untouched."""
    from gradcoll.transport import _tcp_io

    t, peers = two
    assert isinstance(t.plan_runner((1, 2)).call, _tcp_io.PlanCall)
    x = np.ones(256, np.float32)
    peers[1].sendall(_frame(0, x))
    peers[2].sendall(_frame(0, x))
    assert _rounds(t, x.copy()) == 2
    assert not t._driving and t._stepping is None
    assert [(t._links[p].send_seq, t._links[p].recv_seq) for p in (1, 2)] == [(1, 1), (1, 1)]
    t._woken = lambda peer: CollectiveTimeout("woken")  # as interrupt() leaves it for the next wait
    try:
        assert _rounds(t, x.copy()) == 0
    finally:
        t._woken = None
    assert not t._driving and t._stepping is None
    assert [(t._links[p].send_seq, t._links[p].recv_seq) for p in (1, 2)] == [(1, 1), (1, 1)]
    assert _read(peers[1], 24 + x.nbytes) == _frame(0, x)  # the first call's frames, and nothing of the second
    peers[1].setblocking(False)
    with pytest.raises(BlockingIOError):
        peers[1].recv(1)


def test_a_sum_that_overflows_is_marked_and_the_rounds_go_on(two) -> None:
    t, peers = two
    peers[1].sendall(_frame(0, np.full(8, 3e38, np.float32)))
    peers[2].sendall(_frame(0, np.ones(8, np.float32)))
    acc = np.full(8, 3e38, np.float32)
    assert _rounds(t, acc, divisor=1.0) == 2
    assert np.isnan(acc[0]) and np.isinf(acc[1:]).all()  # the marker, carried through the last round
    _read(peers[2], 24 + 32)


def test_an_input_not_finite_in_its_first_piece_declines_before_a_byte_moves(two) -> None:
    t, peers = two
    acc = np.ones(64, np.float32)
    acc[9] = np.nan
    assert _rounds(t, acc) == 0
    for s in peers.values():
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.recv(1)
    for p in (1, 2):  # no seq was taken, and the transport is free for the caller's rounds
        t.send(p, b"abc", tag=7)
        peers[p].settimeout(10)
        assert _read(peers[p], 27) == fr.pack_header(0, 7, 3) + b"abc"


def test_an_input_not_finite_past_the_first_piece_is_found_and_the_frames_still_move(two, monkeypatch) -> None:
    monkeypatch.setattr(tcp_fast, "PIECE_BYTES", 4096)
    t, peers = two
    m = 5000
    peers[1].sendall(_frame(0, np.ones(m, np.float32)))
    peers[2].sendall(_frame(0, np.ones(m, np.float32)))

    def drain() -> None:
        _read(peers[1], 24 + 4 * m)
        _read(peers[2], 24 + 4 * m)

    th = threading.Thread(target=drain)
    th.start()
    acc = np.ones(m, np.float32)
    acc[3000] = np.inf
    found: list[Any] = []
    assert _rounds(t, acc, found=found) == 2
    th.join(10)
    assert found == [(3000, np.inf)] and np.isnan(acc[0])


def test_buffers_over_the_steps_limit_are_the_callers(two, monkeypatch) -> None:
    monkeypatch.setattr(tcp_fast, "SMALL_BYTES", 4096)
    t, _ = two
    assert _rounds(t, np.ones(4096 // 4 + 1, np.float32)) == 0


def test_a_stray_header_in_the_second_round_is_the_engines_mismatch(two) -> None:
    t, peers = two
    peers[1].sendall(_frame(0, np.full(4, 2.0, np.float32)))
    peers[2].sendall(_frame(0, np.full(4, 5.0, np.float32), tag=TAG + 256))  # another call's tag
    at = [0]
    acc = np.ones(4, np.float32)
    with pytest.raises(FrameMismatch, match="rank 0: recv from peer 2 expected seq 0") as info:
        _rounds(t, acc, at=at)
    assert at == [1] and info.value.tag == TAG + 256
    assert (acc == 3.0).all()  # round 0 was done before round 1 stopped
    assert _read(peers[1], 24 + 16) == _frame(0, np.ones(4, np.float32))
    t.send(1, b"abc", tag=7)  # round 0's link is in step: seq 1 is next
    assert _read(peers[1], 27) == fr.pack_header(1, 7, 3) + b"abc"


def test_a_silent_second_partner_times_out_naming_it(two) -> None:
    t, peers = two
    peers[1].sendall(_frame(0, np.full(4, 2.0, np.float32)))
    at = [0]
    with pytest.raises(CollectiveTimeout, match="peer 2"):
        _rounds(t, np.ones(4, np.float32), timeout=0.3, at=at)
    assert at == [1]
    assert _read(peers[2], 24 + 16) == _frame(0, np.full(4, 3.0, np.float32))  # its frame went out whole


@pytest.mark.parametrize("stopped_in", [0, 1])
def test_another_threads_send_stops_the_round_and_the_engine_finishes_it(two, stopped_in) -> None:
    t, peers = two
    if stopped_in == 1:
        peers[1].sendall(_frame(0, np.full(4, 2.0, np.float32)))
    acc = np.ones(4, np.float32)
    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append(_rounds(t, acc)))
    th.start()
    waiting = peers[1 + stopped_in]
    _read(waiting, 24 + 16)  # the round sent its frame and waits for the partner's
    req = t.isend(1 + stopped_in, b"user", tag=9)  # queued behind the round, never written beside it
    assert req.wait(5) == 4
    assert _read(waiting, 24 + 4) == fr.pack_header(1, 9, 4) + b"user"
    waiting.sendall(_frame(0, np.full(4, 2.0, np.float32)))
    th.join(10)
    assert result == [stopped_in + 1]  # the engine finished that round; the caller runs the rest
    assert (acc == (3.0 if stopped_in == 0 else 5.0 / 4)).all()
    if stopped_in == 0:  # round 1 never started: its link's seq was given back, nothing went out on it
        t.send(2, b"abc", tag=7)
        assert _read(peers[2], 27) == fr.pack_header(0, 7, 3) + b"abc"


# -- a plan on parts of one buffer, one link serving two rounds (a halving-doubling's on 2 ranks) ----------------
HD_RS, HD_AG = tags.DESCRIPTOR_FIRST + tags.HD_RS, tags.DESCRIPTOR_FIRST + tags.HD_AG


one = step_tests.raw  # rank 0 of 2 with a raw peer


def _plan(t: Any, flat: np.ndarray, m: int, divide: bool = True, at: list[int] | None = None,
          found: list[Any] | None = None, check: bool = True) -> int:
    """Rank 0's halving-doubling on 2 ranks: keep [0, m), send [m, 2m), then send the sum and receive the rest."""
    spec = plan.make([(HD_RS, 0, m, m, 2 * m, plan.DIVIDE if divide else 0), (HD_AG, m, 2 * m, 0, m, plan.COPY)])
    return int(t.exchange_plan((1, 1), flat, np.empty(m, flat.dtype), spec, 5.0, 2.0, check,
                               [] if found is None else found, [0] if at is None else at))


def test_a_plan_sends_one_part_adds_into_another_then_gathers_on_one_link(one) -> None:
    t, peer = one
    m = 700
    x = np.arange(2 * m, dtype=np.float32)
    theirs_keep = np.full(m, 3.0, np.float32)  # the peer's copy of [0, m)
    theirs_sum = np.full(m, -1.0, np.float32)  # the peer's finished [m, 2m)
    peer.sendall(_frame(0, theirs_keep, HD_RS) + _frame(1, theirs_sum, HD_AG))
    flat = x.copy()
    assert _plan(t, flat, m) == 2
    assert flat[:m].tobytes() == ((x[:m] + theirs_keep) / np.float32(2)).tobytes() and (flat[m:] == -1.0).all()
    assert _read(peer, 24 + 4 * m) == _frame(0, x[m:], HD_RS)
    assert _read(peer, 24 + 4 * m) == _frame(1, flat[:m], HD_AG)  # the second round sent the sum: seq 1
    t.send(1, b"abc", tag=7)
    assert _read(peer, 27) == fr.pack_header(2, 7, 3) + b"abc"


@pytest.mark.parametrize("stopped_in", [0, 1])
def test_a_plan_stopped_on_a_link_with_another_round_to_come_keeps_the_seqs_in_order(one, stopped_in) -> None:
    t, peer = one
    m = 8
    if stopped_in == 1:
        peer.sendall(_frame(0, np.full(m, 3.0, np.float32), HD_RS))
    flat = np.ones(2 * m, np.float32)
    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append(_plan(t, flat, m, divide=False)))
    th.start()
    _read(peer, 24 + 4 * m)  # the round's frame: it waits for the peer's
    if stopped_in == 1:
        _read(peer, 24 + 4 * m)
    req = t.isend(1, b"user", tag=9)  # queued behind the round on the link the plan still owns
    assert req.wait(5) == 4
    assert _read(peer, 28) == fr.pack_header(1 + stopped_in, 9, 4) + b"user"  # after the round's own frame
    if stopped_in == 0:
        peer.sendall(_frame(0, np.full(m, 3.0, np.float32), HD_RS))
    else:
        peer.sendall(_frame(1, np.full(m, 5.0, np.float32), HD_AG))
    th.join(10)
    assert result == [stopped_in + 1]
    assert (flat[:m] == 4.0).all() and (flat[m:] == (1.0 if stopped_in == 0 else 5.0)).all()
    # the seqs go on after the user's frame; round 1 never started when round 0 stopped (its seq given back)
    t.send(1, b"abc", tag=7)
    assert _read(peer, 27) == fr.pack_header(2 + stopped_in, 7, 3) + b"abc"


def test_a_plan_reports_a_bad_element_of_the_part_it_adds_into_at_its_index_in_the_buffer(one, monkeypatch) -> None:
    monkeypatch.setattr(tcp_fast, "PIECE_BYTES", 4096)
    t, peer = one
    m = 3000
    flat = np.ones(2 * m, np.float32)
    flat[2500] = np.inf  # in the kept half: checked just before the peer's part is added into it
    peer.sendall(_frame(0, np.ones(m, np.float32), HD_RS) + _frame(1, np.ones(m, np.float32), HD_AG))
    found: list[Any] = []
    th = threading.Thread(target=lambda: (_read(peer, 24 + 4 * m), _read(peer, 24 + 4 * m)))
    th.start()
    assert _plan(t, flat, m, found=found) == 2
    th.join(10)
    assert found == [(2500, np.inf)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where,bad", [(None, None), (0, np.nan), (3, -np.inf), (40, np.inf), (1000, np.nan),
                                       (20000 - 5, np.inf), (20000 - 1, -np.inf)])
def test_the_kept_part_is_checked_in_the_pass_that_adds_into_it(one, monkeypatch, dtype, where, bad) -> None:
    """The input this rank adds the peer's part into is checked in the accumulate's own pass (``gc_acc_in_*``): the
    sums are the bits of the plain accumulate, the first bad element is named at its index and value wherever it
    sits (the loop's head, its vectors, its tail, across the receive ring's wrap), and nothing is lost."""
    monkeypatch.setattr(tcp_fast, "PIECE_BYTES", 4096)
    t, peer = one
    m = 20000  # 80-160 KB: the peer's part wraps the receive ring of 2 x 4 KiB pieces many times
    rng = np.random.default_rng(7)
    flat = rng.standard_normal(2 * m).astype(dtype)
    if where is not None:
        flat[where] = bad
    theirs = rng.standard_normal(m).astype(dtype)
    want = flat[:m].copy()
    want += theirs  # the plain accumulate's sum, then the mean of 2 as the plan finishes it
    want *= dtype(0.5)
    got: list[bytes] = []
    size = 24 + flat.itemsize * m
    ths = [threading.Thread(target=lambda: peer.sendall(_frame(0, theirs, HD_RS) + _frame(1, np.full(m, 2.0, dtype),
                                                                                          HD_AG))),
           threading.Thread(target=lambda: got.extend((_read(peer, size), _read(peer, size))))]
    for th in ths:
        th.start()
    found: list[Any] = []
    assert _plan(t, flat, m, found=found) == 2
    for th in ths:
        th.join(10)
    assert flat[m:].tobytes() == np.full(m, 2.0, dtype).tobytes()  # the peer's finished part, copied in
    if where is None:
        assert found == [] and flat[:m].tobytes() == want.tobytes()
        assert len(got) == 2 and got[1][24:] == want.tobytes()  # the sum went out whole
        return
    assert len(found) == 1 and found[0][0] == where, found
    assert (np.isnan(found[0][1]) and np.isnan(bad)) or found[0][1] == bad, found
    ok = np.isfinite(want)
    ok[0] = False  # (a sum that is not finite marks element 0 with a NaN for the peers)
    assert flat[:m][ok].tobytes() == want[ok].tobytes()  # every other sum is the plain accumulate's
    assert len(got) == 2 and np.frombuffer(got[1][24:], dtype)[ok].tobytes() == want[ok].tobytes()
    assert not np.isfinite(flat[where])


@pytest.mark.parametrize("where", [[0, 5, 3, 8], [0, 5, 0, 4], [0, 9, 0, 1]])
def test_a_plan_whose_round_sends_part_of_what_it_receives_into_is_refused(one, where) -> None:
    t, peer = one
    with pytest.raises(ValueError, match="sends part of what it receives into|out of the buffer"):
        t.exchange_plan((1,), np.zeros(8, np.float32), np.zeros(8, np.float32), plan.make([(HD_RS, *where, 0)]), 5.0,
                        1.0, False, [], [0])
    t.send(1, b"abc", tag=7)  # nothing was sent and the seqs are where they were
    assert _read(peer, 27) == fr.pack_header(0, 7, 3) + b"abc"


# -- a ring's plan: every round sends to one neighbour (peer 1) and receives from the other (peer 2) --------------
RING = tags.DESCRIPTOR_FIRST + tags.RING


def _ring(t: Any, flat: np.ndarray, m: int, timeout: float = 5.0, at: list[int] | None = None) -> int:
    """Two ring rounds on rank 0: send [0, m) right and add the left's frame into [m, 2m) (a mean of 2), then send
    that sum right and copy the left's next frame into [0, m)."""
    spec = plan.make([(RING, m, 2 * m, 0, m, plan.DIVIDE), (RING, 0, m, m, 2 * m, plan.COPY)])
    return int(t.exchange_plan((1, 1), flat, np.empty(m, flat.dtype), spec, timeout, 2.0, True, [],
                               [0] if at is None else at, (2, 2)))


def test_a_ring_plan_sends_on_one_link_and_receives_on_the_other(two) -> None:
    t, peers = two
    m = 3000
    x = np.arange(2 * m, dtype=np.float32) * np.float32(0.25)
    left_part, left_sum = np.full(m, 7.0, np.float32), np.linspace(-1, 1, m).astype(np.float32)
    peers[2].sendall(_frame(0, left_part, RING) + _frame(1, left_sum, RING))
    got: list[bytes] = []
    th = threading.Thread(target=lambda: got.append(_read(peers[1], 2 * (24 + 4 * m))))
    th.start()
    flat = x.copy()
    assert _ring(t, flat, m) == 2
    th.join(10)
    mine = (x[m:] + left_part) / np.float32(2)
    assert flat[m:].tobytes() == mine.tobytes() and flat[:m].tobytes() == left_sum.tobytes()
    assert got == [_frame(0, x[:m], RING) + _frame(1, mine, RING)]  # both rounds' frames went right, seqs 0 and 1
    t.send(1, b"abc", tag=7)  # the right link sent two frames, the left none
    assert _read(peers[1], 27) == fr.pack_header(2, 7, 3) + b"abc"
    t.send(2, b"abc", tag=7)
    assert _read(peers[2], 27) == fr.pack_header(0, 7, 3) + b"abc"
    peers[2].sendall(fr.pack_header(2, 7, 3) + b"xyz")  # the left link received two: seq 2 is next
    buf = bytearray(3)
    t.recv(2, buf, tag=7)
    assert buf == b"xyz"


def test_a_ring_plan_stopped_on_its_receive_link_is_finished_by_the_engine(two) -> None:
    t, peers = two
    m = 8
    flat = np.ones(2 * m, np.float32)
    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append(_ring(t, flat, m)))
    th.start()
    assert _read(peers[1], 24 + 4 * m) == _frame(0, np.ones(m, np.float32), RING)  # round 0 sent, waits for the left
    req = t.isend(2, b"user", tag=9)  # another thread's send on the receive link: the plan hands over
    assert req.wait(5) == 4
    assert _read(peers[2], 28) == fr.pack_header(0, 9, 4) + b"user"
    peers[2].sendall(_frame(0, np.full(m, 3.0, np.float32), RING))
    th.join(10)
    assert result == [1] and (flat[m:] == 2.0).all() and (flat[:m] == 1.0).all()  # the caller runs round 1
    t.send(1, b"abc", tag=7)  # round 1 never started: the right link's seq 1 is free
    assert _read(peers[1], 27) == fr.pack_header(1, 7, 3) + b"abc"


def test_a_silent_left_neighbour_times_out_naming_it_while_the_right_got_its_frame(two) -> None:
    t, peers = two
    m = 4
    at = [0]
    with pytest.raises(CollectiveTimeout, match="peer 2"):
        _ring(t, np.ones(2 * m, np.float32), m, timeout=0.3, at=at)
    assert at == [0]
    assert _read(peers[1], 24 + 4 * m) == _frame(0, np.ones(m, np.float32), RING)


def test_a_left_neighbour_whose_stream_ends_breaks_the_round_naming_it(two) -> None:
    t, peers = two
    peers[2].shutdown(socket.SHUT_WR)  # the end of its stream, no frame and no goodbye: a dead process
    with pytest.raises(TransportBroken, match="peer 2 dropped the connection") as info:
        _ring(t, np.ones(8, np.float32), 4)
    assert info.value.peer == 2
    assert _read(peers[1], 24 + 16) == _frame(0, np.ones(4, np.float32), RING)


@pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")
def test_a_wake_stops_a_long_call_and_the_engine_finishes_it(monkeypatch) -> None:
    """Another thread's work (or a close) wakes the compiled call through the wake socket: the call stops (it
    looks at the socket when it waits, and every millisecond while its bytes keep flowing, where a round that
    finds the peer's frame already in the socket never waits) and hands its round to the engine, which finishes
    the allreduce with the same result. ``tests/group/test_close_thread.py`` closes a group during such a call."""
    from gradcoll.algorithms.ring import ring_allreduce
    from gradcoll.testing import gather_ranks, threaded_group
    from gradcoll.transport import tcp_rounds

    ts = threaded_group(tcp.create, 2, timeout=20)
    done: dict[int, tuple[int, int]] = {}
    real = tcp_rounds.Runner.__call__

    def spy(self: Any, *a: Any) -> int:
        if self.t.rank == 0:
            self.t._wake_driver()  # queued just as the call starts, as another thread's send would be
        out = int(real(self, *a))
        done[self.t.rank] = (out, self.n)
        return out

    monkeypatch.setattr(tcp_rounds.Runner, "__call__", spy)
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(4 << 20) for _ in range(2)]  # 32 MiB: 16 segments a step, 32 rounds
    bufs = [d.copy() for d in data]
    try:
        _, errors = gather_ranks(lambda r: ring_allreduce(ts[r], bufs[r], op="sum", seq=1, timeout=20), 2,
                                 join_timeout=60)
        assert errors == [None, None], errors
        assert done[0][0] < done[0][1] and done[1][0] == done[1][1], done  # rank 0 stopped early, rank 1 did not
        assert bufs[0].tobytes() == bufs[1].tobytes()
        np.testing.assert_allclose(bufs[0], data[0] + data[1], rtol=1e-12)
    finally:
        for t in ts:
            t.close()

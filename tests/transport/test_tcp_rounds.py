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
from gradcoll.errors import CollectiveTimeout
from gradcoll.transport import frame as fr
from gradcoll.transport import tcp, tcp_fast
from gradcoll.transport.frame import FrameMismatch
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
    import gradcoll.transport.tcp_rounds as tr

    monkeypatch.setattr(tr, "PIECE_BYTES", 4096)
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


def test_larger_buffers_are_the_callers(two) -> None:
    t, _ = two
    assert _rounds(t, np.ones(tcp_fast.STAGE_MIN // 4, np.float32)) == 0


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

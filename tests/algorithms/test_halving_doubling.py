"""The halving-doubling allreduce: its schedule, and its compiled reduce-scatter rounds over tcp.

The general path runs in every algorithm test (``ALLREDUCE`` holds it: world
sizes 1-8, every op, counts 0 to 100,003, the Jidoka and mismatch cases).
Here: the schedule itself, over tcp its rounds in one compiled call
(``Rounds.exchange_plan``), and the compiled step with a send array of its
own (``Rounds.exchange_reduce(..., send=)``) that such rounds are made of.
Every test of the compiled code checks that it ran (``outcomes``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE, tags
from gradcoll.algorithms.halving_doubling import hd_schedule
from gradcoll.errors import NonFiniteError
from gradcoll.model.costmodel import work
from gradcoll.testing import gather_ranks
from gradcoll.transport import frame as fr
from gradcoll.transport import tcp, tcp_fast
from tests.faults._harness import problems, run_collective_fault
from tests.transport import test_tcp_fast as step_tests
from tests.transport.test_tcp import _read_exactly as _read

pytestmark = pytest.mark.timeout(120)
# The step's fixtures: the spy of its outcomes, the threaded tcp worlds, a transport with a raw peer socket.
outcomes, worlds, raw = step_tests.outcomes, step_tests.worlds, step_tests.raw
needs_io = pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")

HD = ALLREDUCE["halving_doubling"]
DECLINED, REDUCED, NONFINITE = tcp_fast.DECLINED, tcp_fast.REDUCED, tcp_fast.NONFINITE
PIECE = tcp_fast.PIECE_BYTES // 4  # float32 elements the step checks before it sends anything


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_the_schedule_leaves_each_rank_its_bit_reversed_chunk_and_pairs_both_sides(p: int) -> None:
    bits = p.bit_length() - 1
    owned = []
    for v in range(p):
        plan = hd_schedule(v, p)
        assert len(plan) == bits
        lo, hi = 0, p
        for k, (partner, klo, khi, slo, shi) in enumerate(plan):
            assert partner == v ^ (1 << k)
            assert {(klo, khi), (slo, shi)} == {(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)}  # halves of what it held
            mine = hd_schedule(partner, p)[k]
            assert (mine[1], mine[2], mine[3], mine[4]) == (slo, shi, klo, khi)  # it keeps what this rank sends
            lo, hi = klo, khi
        assert hi == lo + 1
        owned.append(lo)
        assert lo == int(format(v, f"0{bits}b")[::-1] or "0", 2)
    assert sorted(owned) == list(range(p))


def test_the_model_counts_the_rings_bytes_in_two_log2_p_rounds() -> None:
    s = float(1 << 20)
    for n in (4, 8, 64):
        hd, ring = work("halving_doubling", n, s), work("ring", n, s)
        assert hd.messages == 2 * (n.bit_length() - 1)
        assert (hd.link_bytes, hd.reduced, hd.copied) == pytest.approx((ring.link_bytes, ring.reduced, ring.copied))


# -- over tcp: the compiled reduce-scatter rounds ------------------------------------------------


def allreduce_all(ts: list[Any], bufs: list[np.ndarray], **kw: Any) -> list[BaseException | None]:
    kw.setdefault("timeout", 10.0)
    _, errors = gather_ranks(lambda r: HD(ts[r], bufs[r], **kw), len(ts), join_timeout=60)
    return errors


@needs_io
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 3, 1001, 3 * PIECE + 12345])
def test_the_compiled_rounds_give_the_general_paths_bits(worlds, outcomes, monkeypatch, n, dtype, count) -> None:
    ts = worlds(n)
    rng = np.random.default_rng(count + n)
    data = [(rng.standard_normal(count) * 1e3).astype(dtype) for _ in range(n)]
    for op in ("mean", "sum"):
        outcomes.clear()
        stepped = [d.copy() for d in data]
        assert allreduce_all(ts, stepped, op=op, seq=3) == [None] * n
        assert outcomes == [("rounds", 2 * (n.bit_length() - 1))] * n  # every round of every rank, in one call
        with monkeypatch.context() as m:
            step_tests.pure_python(m)  # the general path: the engine's sendrecv and the kernel's accumulate
            general = [d.copy() for d in data]
            assert allreduce_all(ts, general, op=op, seq=4) == [None] * n
        assert all(a.tobytes() == general[0].tobytes() for a in stepped + general)
        want = sum(d.astype(np.float64) for d in data) / (n if op == "mean" else 1)
        np.testing.assert_allclose(general[0], want, rtol=1e-4, atol=1e-2)


@needs_io
def test_halves_larger_than_the_receive_ring_wrap_it_with_the_general_paths_bits(worlds, outcomes, monkeypatch) -> None:
    ts = worlds(2)
    m = 2 * tcp_fast.RING_BYTES // 4 + 2 * PIECE + 7  # each half is larger than the ring the peer's bytes arrive in
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(m).astype(np.float32) for _ in range(2)]
    stepped = [d.copy() for d in data]
    assert allreduce_all(ts, stepped, seq=5) == [None, None]
    assert outcomes == [("rounds", 2)] * 2
    step_tests.pure_python(monkeypatch)
    general = [d.copy() for d in data]
    assert allreduce_all(ts, general, seq=6) == [None, None]
    assert all(a.tobytes() == general[0].tobytes() for a in stepped + general)
    np.testing.assert_allclose(general[0], (data[0] + data[1]) / 2, rtol=1e-6)


@needs_io
@pytest.mark.parametrize("where", ["first piece, sent", "sent", "kept", "kept, last"])
def test_a_non_finite_input_names_its_rank_and_element_wherever_it_sits(worlds, outcomes, where) -> None:
    ts = worlds(4)
    m = 6 * PIECE + 5
    half = (m + 1) // 2  # rank 1 keeps the upper half in round 0 and sends the lower one
    at = {"first piece, sent": 11, "sent": PIECE + 7, "kept": half + 3, "kept, last": m - 1}[where]
    bufs = [np.ones(m, np.float32) for _ in range(4)]
    bufs[1][at] = np.nan
    for r, e in enumerate(allreduce_all(ts, bufs, seq=9)):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq, e.rank) == (1, at, 9, r), str(e)
    # In the first piece of what it sends, rank 1's compiled call declines before a byte moves, and the guard's
    # frame checks its input; elsewhere every rank's rounds run whole, carrying the marker.
    declined = where == "first piece, sent"
    assert outcomes.count(("rounds", 0)) == (1 if declined else 0) and DECLINED not in outcomes
    assert outcomes.count(("rounds", 4)) == (3 if declined else 4)


@needs_io
def test_an_overflow_in_a_compiled_round_halts_every_rank(worlds, outcomes) -> None:
    ts = worlds(4)
    bufs = [np.full(3 * PIECE, 3e38, np.float32) for _ in range(4)]
    errors = allreduce_all(ts, bufs, op="sum", seq=10)
    assert all(isinstance(e, NonFiniteError) for e in errors), errors
    assert outcomes == [("rounds", 4)] * 4  # every round ran, carrying the marker to every rank


@needs_io
@pytest.mark.parametrize("fault", ["kill-mid", "stop-mid"])
def test_a_peer_killed_or_stopped_in_a_round_is_named_by_every_survivor(fault) -> None:
    out = run_collective_fault("tcp", "halving_doubling", fault, victim=2, timeout=2.0, buffer="mixed")
    assert problems(out) == []


# -- the step with a send array of its own, against a raw peer -----------------------------------

TAG = tags.DESCRIPTOR_FIRST + tags.HD_RS


def _frame(seq: int, data: np.ndarray, tag: int = TAG) -> bytes:
    return fr.pack_header(seq, tag, data.nbytes) + data.tobytes()


@needs_io
@pytest.mark.parametrize("sent,kept", [(5, 4), (4, 5), (0, 3), (3, 0), (300_001, 300_000)])
def test_the_step_sends_one_part_and_adds_into_another(raw, sent, kept) -> None:
    t, peer = raw
    buf = np.arange(sent + kept, dtype=np.float32)
    acc, src = buf[sent:], buf[:sent]
    theirs = np.full(kept, 0.5, np.float32)
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(
        t.exchange_reduce(1, acc, np.empty_like(acc), TAG, 5.0, 1.0, True, True, [], src, (0, sent))))
    th.start()
    peer.sendall(_frame(0, theirs))  # the whole frame first: the receive ends before the longer send does
    assert _read(peer, 24 + 4 * sent) == _frame(0, np.arange(sent, dtype=np.float32))
    th.join(10)
    assert got == [REDUCED]
    assert (buf[:sent] == np.arange(sent)).all() and (buf[sent:] == np.arange(sent, sent + kept) + 0.5).all()


@needs_io
@pytest.mark.parametrize("in_acc", [False, True])
def test_the_steps_input_check_reports_the_element_in_the_callers_buffer(raw, in_acc) -> None:
    t, peer = raw
    m = 2 * PIECE
    buf = np.ones(2 * m, np.float32)
    bad = m + PIECE + 3 if in_acc else PIECE + 3  # past the first piece: found once the frame has started
    buf[bad] = np.inf
    found: list[tuple[int, float]] = []
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(t.exchange_reduce(
        1, buf[m:], np.empty(m, np.float32), TAG, 5.0, 1.0, True, True, found, buf[:m], (0, m))))
    th.start()
    peer.sendall(_frame(0, np.ones(m, np.float32)))
    assert len(_read(peer, 24 + 4 * m)) == 24 + 4 * m
    th.join(10)
    # Sent, the bad element makes the peer's sum non-finite, not this one's; kept, this one's.
    assert got == [NONFINITE if in_acc else REDUCED] and found == [(bad, np.inf)]


@needs_io
def test_a_step_stopped_by_another_thread_hands_the_send_array_to_the_engine(raw) -> None:
    t, peer = raw
    buf = np.arange(12, dtype=np.float32)
    acc, src = buf[5:], buf[:5]
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(
        t.exchange_reduce(1, acc, np.empty_like(acc), TAG, 5.0, 1.0, False, True, [], src, (0, 5))))
    th.start()
    assert _read(peer, 24 + 20) == _frame(0, np.arange(5, dtype=np.float32))
    step_tests.wake_with_a_send(t, peer)  # wakes the step, which still waits for the peer: the engine finishes it
    peer.sendall(_frame(0, np.full(7, 2.0, np.float32)))
    th.join(10)
    assert got == [REDUCED] and (buf[5:] == np.arange(5, 12) + 2.0).all() and (buf[:5] == np.arange(5)).all()


@needs_io
def test_a_send_array_overlapping_the_accumulator_is_refused_before_anything_moves(raw) -> None:
    t, peer = raw
    buf = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        t.exchange_reduce(1, buf[2:], np.empty(8, np.float32), TAG, 5.0, 1.0, False, True, [], buf[:5], (0, 2))
    t.send(1, b"abc", tag=7)  # nothing was sent and the seqs are where they were
    assert peer.recv(64) == fr.pack_header(0, 7, 3) + b"abc"


@needs_io
@pytest.mark.parametrize("sent,got", [(5, 4), (4, 5), (0, 3), (3, 0), (300_001, 300_000)])
def test_an_allgather_step_sends_one_part_and_receives_another_in_place(raw, sent, got) -> None:
    t, peer = raw
    buf = np.arange(sent + got, dtype=np.float32)
    theirs = np.full(got, -1.5, np.float32)
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(t.exchange_reduce(
        1, buf[sent:], buf[sent:], TAG, 5.0, 1.0, False, True, [], buf[:sent], (0, sent), True)))
    th.start()
    peer.sendall(_frame(0, theirs))
    assert _read(peer, 24 + 4 * sent) == _frame(0, np.arange(sent, dtype=np.float32))
    th.join(10)
    assert out == [tcp_fast.MOVED]  # moved, nothing to reduce
    assert (buf[:sent] == np.arange(sent)).all() and (buf[sent:] == -1.5).all()


@needs_io
def test_an_allgather_step_stopped_by_another_thread_receives_the_rest_in_place(raw) -> None:
    t, peer = raw
    buf = np.arange(8, dtype=np.float32)
    theirs = _frame(0, np.full(5, 9.0, np.float32))
    peer.sendall(theirs[:30])  # the header and part of the payload: there before the step starts
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(t.exchange_reduce(
        1, buf[3:], buf[3:], TAG, 5.0, 1.0, False, True, [], buf[:3], (0, 3), True)))
    th.start()
    assert _read(peer, 24 + 12) == _frame(0, np.arange(3, dtype=np.float32))
    step_tests.wake_with_a_send(t, peer)  # wakes the step: the engine finishes the receive into buf itself
    peer.sendall(theirs[30:])
    th.join(10)
    assert out == [tcp_fast.MOVED] and buf.tolist() == [0.0, 1.0, 2.0] + [9.0] * 5


@needs_io
def test_an_allgather_step_into_the_array_it_sends_is_refused(raw) -> None:
    t, _ = raw
    buf = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="another array"):
        t.exchange_reduce(1, buf, buf, TAG, 5.0, 1.0, False, True, [], None, (0, 0), True)


@needs_io
def test_a_step_stopped_after_part_of_the_add_checks_and_adds_the_rest(raw, monkeypatch) -> None:
    t, peer = raw
    rest = step_tests._spy_rest(monkeypatch)  # where the engine's side of the add starts
    m, first = 40_000, 30_000
    buf = np.ones(2 * m, np.float32)
    buf[m + 35_000] = np.inf  # in the part of acc not yet added when the step stops: checked on the engine's side
    theirs = _frame(0, np.full(m, 2.0, np.float32))
    peer.sendall(theirs[: 24 + 4 * first])  # there before the step starts: added in its first pass
    found: list[tuple[int, float]] = []
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(t.exchange_reduce(
        1, buf[m:], np.empty(m, np.float32), TAG, 5.0, 1.0, True, True, found, buf[:m], (0, m))))
    th.start()
    assert _read(peer, 24 + 4 * m) == _frame(0, np.ones(m, np.float32))
    step_tests.wake_with_a_send(t, peer)  # wakes the step: the engine finishes the frames
    peer.sendall(theirs[24 + 4 * first :])
    th.join(10)
    assert rest == [first]  # stopped: the step had added the first part, the rest was added after the engine's
    assert out == [NONFINITE] and found == [(m + 35_000, np.inf)]
    got = buf[m:]  # the sum's marker at the first element, the infinity where it was, 1 + 2 elsewhere
    assert np.isnan(got[0]) and np.isinf(got[35_000]) and (np.delete(got, [0, 35_000]) == 3.0).all()

"""The ring allreduce over tcp with every step in one compiled call (``ring.ring_plan``, ``Transport.exchange_plan``).

Ranks are threads over real tcp links (``threaded_group``), or processes for
a killed or stopped peer (the fault harness). Every test checks which path
ran: the spy on ``tcp_rounds.exchange_plan`` records how many rounds each
call did (all of them: ``2 (n - 1)`` steps of a round per segment), so that a
test of the compiled ring that silently ran the general path would fail.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE
from gradcoll.algorithms.ring import ring_plan, segments
from gradcoll.errors import CollectiveTimeout, NonFiniteError
from gradcoll.testing import gather_ranks
from gradcoll.transport import plan, tcp, tcp_rounds
from tests.faults._harness import problems, run_collective_fault
from tests.transport import test_tcp_fast as fast_tests

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")]

RING = ALLREDUCE["ring"]
worlds = fast_tests.worlds  # threaded tcp groups by size, one per module


@pytest.fixture
def calls(monkeypatch) -> list[Any]:
    """What every call of rounds in one (``tcp_rounds.Runner``) in this test returned (rounds done), or the class it
    raised."""
    seen: list[Any] = []
    real = tcp_rounds.Runner.__call__

    def spy(*a: Any, **k: Any) -> int:
        try:
            out = real(*a, **k)
        except BaseException as e:
            seen.append(type(e))
            raise
        seen.append(out)
        return int(out)

    monkeypatch.setattr(tcp_rounds.Runner, "__call__", spy)
    return seen


def ring_all(ts: list[Any], bufs: list[np.ndarray], **kw: Any) -> list[BaseException | None]:
    kw.setdefault("timeout", 10.0)
    _, errors = gather_ranks(lambda r: RING(ts[r], bufs[r], **kw), len(ts), join_timeout=60)
    return errors


def test_the_plan_sends_right_receives_left_and_divides_in_the_last_reduce_scatter_round() -> None:
    p = ring_plan(1, 3, 10, True)  # chunks [0, 4), [4, 7), [7, 10), one segment each
    assert p.bounds == [0, 4, 7, 10] and p.peers == (2,) * 4 and p.sources == (0,) * 4 and p.tmp == 4
    rounds = [tuple(p.spec[plan.FIELDS * k + f] for f in (plan.A, plan.B, plan.C, plan.D, plan.FLAGS)) for k in range(4)]
    # round g sends chunk 1 - g and receives chunk 1 - g - 1; a reduce-scatter round checks the chunk it adds
    # into (this rank's input, untouched so far)
    assert rounds == [(0, 4, 4, 7, plan.CHECK), (7, 10, 0, 4, plan.CHECK | plan.DIVIDE), (4, 7, 7, 10, plan.COPY),
                      (0, 4, 4, 7, plan.COPY)]
    assert ring_plan(0, 2, 8, False).sources == (1, 1)


def test_the_plan_has_the_general_paths_segments_paired_step_by_step() -> None:
    # 2 ranks, 7 elements of 4 bytes in segments of at most 8 bytes: chunks of 4 and 3 elements, each in 2
    # segments (the same count for every chunk, so that a step's send and receive pair up)
    assert segments(7, 2, 2) == [[(0, 2), (2, 4)], [(4, 6), (6, 7)]]
    p = ring_plan(0, 2, 7, False, seg_bytes=8)
    rounds = [tuple(p.spec[plan.FIELDS * k + f] for f in (plan.A, plan.B, plan.C, plan.D)) for k in range(4)]
    assert rounds == [(4, 6, 0, 2), (6, 7, 2, 4), (0, 2, 4, 6), (2, 4, 6, 7)]
    assert p.bounds == [0, 2, 4, 6, 7] and p.tmp == 2  # every segment's start is a marker slot


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("count", [0, 1, 5, 3001, 300_001])
def test_every_step_in_one_call_gives_the_general_paths_bits(worlds, calls, monkeypatch, n, dtype, op, count) -> None:
    ts = worlds(n)
    rng = np.random.default_rng(count + n)
    data = [rng.standard_normal(count).astype(dtype) * 100 for _ in range(n)]
    planned = [d.copy() for d in data]
    assert ring_all(ts, planned, op=op, seq=3) == [None] * n
    assert calls == [len(ring_plan(0, n, count, op == "mean", itemsize=np.dtype(dtype).itemsize).peers)] * n
    want = np.sum(np.stack(data).astype(np.float64), axis=0) / (n if op == "mean" else 1)
    assert np.allclose(planned[0], want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-4)
    fast_tests.pure_python(monkeypatch)  # GRADCOLL_TCP_PURE_PYTHON=1: the engine in Python, the general path
    calls.clear()
    general = [d.copy() for d in data]
    assert ring_all(ts, general, op=op, seq=4) == [None] * n
    assert calls == []  # (the transport declines before its compiled loops)
    assert all(b.tobytes() == general[0].tobytes() for b in planned + general)  # bitwise, on every rank


def test_a_rank_on_the_general_path_meets_the_others_compiled_steps(worlds, calls) -> None:
    ts = worlds(3)
    data = [np.arange(20_000, dtype=np.float32) * (r + 1) for r in range(3)]
    bufs = [d.copy() for d in data]
    # rank 1 reduces with NumPy's kernel, so it runs the guard's ring (one frame a step); the others compile
    _, errors = gather_ranks(lambda r: RING(ts[r], bufs[r], op="sum", timeout=10.0,
                                            backend="numpy" if r == 1 else None), 3, join_timeout=60)
    assert errors == [None] * 3
    assert sorted(calls) == [4, 4]
    for b in bufs:
        assert np.array_equal(b, data[0] * 6)


def test_other_segments_keep_the_segmented_general_path(worlds, calls) -> None:
    ts = worlds(3)
    bufs = [np.full(5000, r + 1.0, np.float32) for r in range(3)]
    assert ring_all(ts, bufs, op="sum", segment_bytes=4096) == [None] * 3
    assert calls == [] and all((b == 6.0).all() for b in bufs)


def test_a_nan_input_halts_every_rank_naming_it(worlds, calls) -> None:
    ts = worlds(3)
    bufs = [np.ones(9000, np.float32) for _ in range(3)]
    bufs[1][4321] = np.nan  # in the chunk rank 1 sends first: its plan declines before a byte moves
    for r, e in enumerate(ring_all(ts, bufs, seq=9)):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq, e.rank) == (1, 4321, 9, r)
    assert Counter(calls) == Counter({0: 1, 4: 2})  # the others ran all their rounds and met the marker


@pytest.mark.parametrize("index", [123, 7000])
def test_a_nan_input_in_a_chunk_a_round_adds_into_is_found_there(worlds, calls, index) -> None:
    ts = worlds(3)
    bufs = [np.ones(9000, np.float32) for _ in range(3)]
    bufs[1][index] = np.inf  # chunk 0: rank 1 adds into it in its first round; chunk 2: in its second
    for r, e in enumerate(ring_all(ts, bufs, seq=10)):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq, e.rank) == (1, index, 10, r)
    assert calls == [4, 4, 4]


def test_a_rank_that_never_calls_is_named_by_every_other(worlds, calls) -> None:
    ts = worlds(3)
    bufs = [np.ones(256, np.float32) for _ in range(3)]
    _, errors = gather_ranks(lambda r: None if r == 2 else RING(ts[r], bufs[r], timeout=0.5, seq=21), 3,
                             join_timeout=60)
    for r in (0, 1):
        e = errors[r]
        assert isinstance(e, CollectiveTimeout), (r, e)
        assert e.missing == [2] and e.seq == 21, (r, e)
    assert CollectiveTimeout in calls


@pytest.mark.parametrize("fault", ["kill-mid", "stop-mid"])
def test_a_peer_killed_or_stopped_in_the_compiled_ring_is_named_by_every_survivor(fault) -> None:
    out = run_collective_fault("tcp", "ring", fault, size=3, victim=1, timeout=2.0, buffer="4KiB")
    assert problems(out) == []

"""Bitwise-reproducible allreduce: same bits for any algorithm, world layout and permutation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.algorithms import SCHEDULES
from gradcoll.algorithms.deterministic import deterministic_allreduce, exact_reduce, fraction_bits
from gradcoll.errors import NonFiniteError, UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world
from tests.helpers import spawn_ranks


def run(n: int, fn: Any) -> tuple[list[Any], list[BaseException | None]]:
    """``fn(rank, transport)`` on ``n`` threads over a fresh inproc world."""
    ts = create_world(n, timeout=10.0)
    return gather_ranks(lambda r: fn(r, ts[r]), n)

ALGOS = tuple(name for name, s in SCHEDULES.items() if s.rows is not None)  # every schedule with a rows form


def contributions(n: int, count: int, spread: int, seed: int) -> list[np.ndarray]:
    """float32 values whose binary exponents span ``spread`` binades, mixed signs."""
    rng = np.random.default_rng(seed)
    return [(rng.uniform(0.5, 1.0, count) * rng.choice([-1, 1], count)
             * 2.0 ** rng.integers(-spread, 1, count)).astype(np.float32) for _ in range(n)]


def allreduce_all(data: list[np.ndarray], algo: str, op: str = "mean", **kw: Any) -> list[np.ndarray]:
    bufs = [d.copy() for d in data]
    extra = {"segment_bytes": 64} if algo == "ring" else {}
    _, err = run(len(data), lambda r, t: deterministic_allreduce(t, bufs[r], algorithm=algo, op=op, seq=9,
                                                                  **extra, **kw))
    assert err == [None] * len(data), err
    return bufs


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
def test_same_bits_for_every_algorithm_and_permutation(n: int) -> None:
    rng = np.random.default_rng(n)
    for spread in (fraction_bits(n) - 25, 60):  # within the exact range, and far beyond it
        data = contributions(n, 1001, spread, seed=n + spread)
        want = None
        for algo in ALGOS:
            for _ in range(2):
                perm = rng.permutation(n)  # which rank holds which contribution
                bufs = allreduce_all([data[p] for p in perm], algo)
                for b in bufs:
                    assert want is None or b.tobytes() == want
                    want = b.tobytes()
        if spread <= fraction_bits(n) - 24:  # every input is on the grid: the float64 sum, rounded once
            ref = (np.stack(data).astype(np.float64).sum(0) / n).astype(np.float32)
            assert want == ref.tobytes()


@pytest.mark.parametrize("hosts", [[0, 1, 0, 1, 2], [0, 0, 0, 1, 1], [0, 1, 2, 3, 4], ["a"] * 5])
def test_two_level_over_hosts_gives_every_schedules_bits(hosts: list[Any]) -> None:
    """The two-level schedule's rows form over several hosts (leaders 0, 1, 2 ...; members not contiguous) gives
    the bits of the ring and of halving-doubling, and the wire variant's bits of theirs."""
    data = contributions(5, 1003, 40, seed=55)
    want = allreduce_all(data, "ring")[0].tobytes()
    assert allreduce_all(data, "halving_doubling")[0].tobytes() == want
    for b in allreduce_all(data, "two_level", hosts=hosts):
        assert b.tobytes() == want

    from gradcoll.algorithms.low_precision import wire_allreduce

    def wire(algo: str, **kw: Any) -> list[bytes]:
        bufs = [d.copy() for d in data]
        _, err = run(5, lambda r, t: wire_allreduce(t, bufs[r], wire="bf16", algorithm=algo, seq=3, **kw))
        assert err == [None] * 5, err
        return [b.tobytes() for b in bufs]

    ring = wire("ring")
    assert set(wire("two_level", hosts=hosts)) == set(ring) and len(set(ring)) == 1
    assert set(wire("tree")) == set(ring) and set(wire("halving_doubling")) == set(ring)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_equals_float64_reference_within_range(op: str) -> None:
    for n in (2, 4, 8):
        data = contributions(n, 777, fraction_bits(n) - 24, seed=100 + n)
        s = np.stack(data).astype(np.float64).sum(0)
        ref = (s / n if op == "mean" else s).astype(np.float32)
        for algo in ALGOS:
            assert allreduce_all(data, algo, op)[0].tobytes() == ref.tobytes()


def test_edge_counts_and_zeros() -> None:
    for count in (0, 1, 5):
        data = [np.zeros(count, np.float32) for _ in range(3)]
        for algo in ALGOS:
            assert all(not b.any() for b in allreduce_all(data, algo))
    neg = [np.full(4, -0.0, np.float32) for _ in range(3)]
    assert all(np.signbit(allreduce_all(neg, algo)[0]).all() for algo in ALGOS)  # -0 + -0 + -0 stays -0
    # Each element has its own grid: a tiny element next to a huge one elsewhere in the buffer is exact.
    data = [np.array([1e-40, -3e38, 2.5], np.float32), np.array([1e-40, 3e38, 0.5], np.float32)]
    want = (np.stack(data).astype(np.float64).sum(0)).astype(np.float32)
    for algo in ALGOS:
        assert allreduce_all(data, algo, "sum")[0].tobytes() == want.tobytes()


def test_equals_reference_for_any_spread_across_elements() -> None:
    """Exactness depends only on the spread *within* an element, not across the buffer."""
    rng = np.random.default_rng(7)
    for n in (2, 5, 8):
        base = 2.0 ** rng.integers(-120, 120, 3000)  # 240 binades across the buffer
        data = [(base * rng.uniform(-4, 4, 3000)).astype(np.float32) for _ in range(n)]
        ref = (np.stack(data).astype(np.float64).sum(0) / n).astype(np.float32)
        for algo in ALGOS:
            assert allreduce_all(data, algo)[0].tobytes() == ref.tobytes()


def test_error_bound_beyond_the_exact_range() -> None:
    """A contribution below its element's grid is rounded to it: |error| <= n * 2**(E-F-1) / n for a mean."""
    n = 4
    data = contributions(n, 2000, 80, seed=5)
    got = allreduce_all(data, "ring")[0].astype(np.float64)
    x = np.stack(data).astype(np.float64)
    exact = x.sum(0) / n
    e = np.frexp(np.abs(x).max(0))[1]
    bound = np.ldexp(0.5, e - fraction_bits(n)) + np.abs(exact) * 2.0**-24  # grid rounding + the final float32 one
    assert (np.abs(got - exact) <= bound).all()
    assert (got != exact.astype(np.float32)).any()  # the spread really is beyond the exact range


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_fused_kernel_matches_numpy_reference(dtype: Any, k: int) -> None:
    rng = np.random.default_rng(k)
    m = 5000
    x = (rng.standard_normal((k + 1, m)) * 2.0 ** rng.integers(-60, 60, (k + 1, m))).astype(dtype)
    x[:, :3] = 0.0
    x[0, 1] = -0.0
    x[k, 4] = np.inf
    x[0, 5], x[k, 5] = np.inf, -np.inf
    x[1 % (k + 1), 6] = np.nan
    x[:, 7] = np.finfo(dtype).tiny / 8  # subnormal
    x[:, 8] = np.finfo(dtype).max
    x[:, 9] = -0.0  # every contribution -0.0: the result keeps the sign (NumPy's own sum would not)
    a, b = np.empty(m, dtype), np.empty(m, dtype)
    for div in (1.0, float(k + 1), 3.0):
        ia = exact_reduce(x[0], x[1:], a, div, backend="numpy")
        ib = exact_reduce(x[0], x[1:], b, div)
        assert ia == ib == 4
        assert a.tobytes() == b.tobytes()
        assert np.signbit(a[9]) and a[9] == 0
    same = x[0].copy()  # out may alias own
    exact_reduce(same, x[1:], same, 3.0)
    assert same.tobytes() == b.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(0, 300), st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float64]))
def test_kernel_is_order_independent(k: int, m: int, seed: int, dtype: Any) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((k + 1, m)) * 2.0 ** rng.integers(-40, 40, (k + 1, m))).astype(dtype)
    a, b = np.empty(m, dtype), np.empty(m, dtype)
    exact_reduce(x[0], x[1:], a, k + 1.0)
    y = x[rng.permutation(k + 1)]
    exact_reduce(y[0], y[1:], b, k + 1.0, backend="numpy")
    assert a.tobytes() == b.tobytes()


def test_sum_overflow_halts_every_rank() -> None:
    data = [np.array([1.0, 3e38, 2.0], np.float32) for _ in range(3)]
    for algo in ALGOS:
        bufs = [d.copy() for d in data]
        _, err = run(3, lambda r, t, a=algo: deterministic_allreduce(t, bufs[r], algorithm=a, op="sum", seq=2))
        assert all(isinstance(e, NonFiniteError) for e in err), (algo, err)


@pytest.mark.parametrize("n", [2, 3])
def test_ring_overflow_in_a_later_segment_halts_every_rank(n: int) -> None:
    """The owner marks the start of the overflowed segment, not of its chunk: that slot is checked too."""
    count, seg = 24 * n, 8  # 8 float32 per segment: three segments in every chunk
    data = [np.ones(count, np.float32) for _ in range(n)]
    for d in data:
        d[count - 3] = 3e38  # the last segment of the last chunk
    _, err = run(n, lambda r, t: deterministic_allreduce(t, data[r], op="sum", segment_bytes=4 * seg, seq=3))
    for e in err:
        assert isinstance(e, NonFiniteError) and e.contributor is None and e.index == count - seg, err
        assert "overflowed although every input was finite (first at element" in str(e)


@pytest.mark.parametrize("algo", ALGOS)
def test_nonfinite_halts_every_rank(algo: str) -> None:
    data = contributions(3, 10, 5, seed=1)
    data[2][4] = np.inf
    bufs = [d.copy() for d in data]
    _, err = run(3, lambda r, t: deterministic_allreduce(t, bufs[r], algorithm=algo, seq=1))
    assert all(isinstance(e, NonFiniteError) and "rank 2" in str(e) for e in err), err


def test_group_api_and_usage() -> None:
    data = contributions(4, 500, 20, seed=3)

    def body(r: int, t: Any) -> tuple[bytes, bytes, bytes, int]:
        g = ProcessGroup(t)
        a = g.allreduce(data[r].copy(), deterministic=True, algorithm="star")
        b = g.allreduce(data[r].copy(), deterministic=True, algorithm="ring")
        m = g.allreduce(data[r].copy(), deterministic=True, op="max")  # exact in any order: the plain form
        with pytest.raises(UsageError):
            g.allreduce(data[r].astype(np.int32), deterministic=True)
        assert not g.poisoned  # refused before anything was sent
        return a.tobytes(), b.tobytes(), m.tobytes(), g.seq

    out, err = run(4, body)
    assert err == [None] * 4
    assert len({o[0] for o in out} | {o[1] for o in out}) == 1
    assert out[0][2] == np.max(np.stack(data), axis=0).tobytes()
    assert out[0][3] == 3  # one sequence number per allreduce


def test_plain_against_deterministic_is_a_mismatch_not_a_hang() -> None:
    from gradcoll.algorithms import ring_allreduce
    from gradcoll.errors import CollectiveMismatch

    data = contributions(3, 64, 3, seed=4)

    def body(r: int, t: Any) -> None:
        if r == 1:
            ring_allreduce(t, data[r].copy(), seq=5, timeout=5.0)
        else:
            deterministic_allreduce(t, data[r].copy(), seq=5, timeout=5.0)

    _, err = run(3, body)
    assert all(isinstance(e, CollectiveMismatch) for e in err), err


def test_two_ranks_need_no_grid() -> None:
    """Two contributions: the commutative float64 sum, equal to the reference at any spread."""
    data = contributions(2, 3000, 120, seed=8)
    ref = (np.stack(data).astype(np.float64).sum(0) / 2).astype(np.float32)
    for algo in ALGOS:
        assert allreduce_all(data, algo)[0].tobytes() == ref.tobytes()
        assert allreduce_all(data[::-1], algo)[1].tobytes() == ref.tobytes()


def _det_rank(store: Any, rank: int, size: int, kind: str, perm: list[int]) -> list[bytes]:
    from gradcoll.transport import shm, tcp

    t = (tcp if kind == "tcp" else shm).create(store, rank, size, timeout=20)
    try:
        data = contributions(size, 5001, 40, seed=21)
        out = []
        for i, algo in enumerate(ALGOS):
            buf = data[perm[rank]].copy()
            deterministic_allreduce(t, buf, algorithm=algo, seq=i, timeout=20, segment_bytes=4096)
            out.append(buf.tobytes())
        return out
    finally:
        t.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_same_bits_across_transports_and_processes(kind: str) -> None:
    """Processes over tcp/shm, contributions permuted, give the bits of threads over inproc."""
    want = allreduce_all(contributions(3, 5001, 40, seed=21), "ring")[0].tobytes()
    for rank_results in spawn_ranks(_det_rank, 3, kind, [2, 0, 1], timeout=90):
        assert rank_results == [want] * len(ALGOS)


@pytest.mark.parametrize("algo", ALGOS)
def test_absent_peer_is_a_timeout_naming_it(algo: str) -> None:
    from gradcoll.errors import CollectiveTimeout

    data = contributions(3, 300, 3, seed=6)
    ts = create_world(3, timeout=10.0)

    def body(r: int) -> None:
        if r != 2:  # rank 2 never calls
            deterministic_allreduce(ts[r], data[r].copy(), algorithm=algo, seq=3, timeout=1.0, segment_bytes=256)

    _, err = gather_ranks(body, 3)
    for e in err[:2]:
        assert isinstance(e, CollectiveTimeout), err
        assert 2 in e.missing and "deterministic" in str(e) and "step" in str(e) and "seq 3" in str(e), e
    assert err[2] is None


@pytest.mark.parametrize("algo", ALGOS)
def test_wrong_length_on_one_rank_is_a_mismatch(algo: str) -> None:
    from gradcoll.errors import CollectiveMismatch

    data = contributions(3, 64, 3, seed=9)
    data[1] = data[1][:60]
    _, err = run(3, lambda r, t: deterministic_allreduce(t, data[r].copy(), algorithm=algo, seq=7, timeout=5.0))
    assert all(isinstance(e, CollectiveMismatch) for e in err), err
    assert all("rank 1" in str(e) for e in err), err

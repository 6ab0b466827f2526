"""Bitwise-reproducible allreduce: same bits for any algorithm, world layout and permutation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms.deterministic import deterministic_allreduce, fraction_bits
from gradcoll.errors import NonFiniteError, UsageError
from gradcoll.group import ProcessGroup
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world


def run(n: int, fn: Any) -> tuple[list[Any], list[BaseException | None]]:
    """``fn(rank, transport)`` on ``n`` threads over a fresh inproc world."""
    ts = create_world(n, timeout=10.0)
    return gather_ranks(lambda r: fn(r, ts[r]), n)

ALGOS = ("ring", "star", "recursive_doubling")


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
    data = [np.array([1e-40, -3e38, 2.5], np.float32), np.array([1e-40, 3e38, 0.5], np.float32)]
    # 2.5 and 0.5 lie 127 binades below the largest magnitude: below the grid they round to 0 (documented).
    assert allreduce_all(data, "ring", "sum")[0].tolist() == [0.0, 0.0, 0.0]


def test_nonfinite_halts_every_rank() -> None:
    data = contributions(3, 10, 5, seed=1)
    data[2][4] = np.inf
    bufs = [d.copy() for d in data]
    _, err = run(3, lambda r, t: deterministic_allreduce(t, bufs[r], seq=1))
    assert all(isinstance(e, NonFiniteError) and "rank 2" in str(e) for e in err), err


def test_group_api_and_usage() -> None:
    data = contributions(4, 500, 20, seed=3)

    def body(r: int, t: Any) -> tuple[bytes, bytes, int]:
        g = ProcessGroup(t)
        a = g.allreduce(data[r].copy(), deterministic=True, algorithm="star")
        b = g.allreduce(data[r].copy(), deterministic=True, algorithm="ring")
        with pytest.raises(UsageError):
            g.allreduce(data[r].copy(), deterministic=True, op="max")
        return a.tobytes(), b.tobytes(), g.seq

    out, err = run(4, body)
    assert err == [None] * 4
    assert len({o[0] for o in out} | {o[1] for o in out}) == 1
    assert out[0][2] == 4  # two sequence numbers per deterministic allreduce

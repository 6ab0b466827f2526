"""A tcp group prepares a plain call once per size (``algorithms.prepared``, its ``rounds`` route: ``_planned.Prepared``).

A plain ``allreduce`` (a float32/float64 NumPy array, ``auto``, mean or sum)
that ``auto`` sends to recursive doubling, halving-doubling or the ring
builds its plan, its descriptor and its transport's rounds
(``tcp_rounds.Runner``) at its first call of that size, and reuses them: the
calls after it only compute the descriptor tag, write the tags and run the
compiled call. These tests check, on real tcp links between threads, that
the plan is built once, that the results are the exact sums, that the cache
stays bounded, and that a call the transport declines before a byte moves
runs the algorithm's own path with the same sequence number.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import _planned
from gradcoll.group import process_group
from gradcoll.group.process_group import ProcessGroup
from gradcoll.testing import gather_ranks, threaded_group
from gradcoll.transport import tcp, tcp_rounds

pytestmark = pytest.mark.timeout(120)
needs_io = pytest.mark.skipif(tcp._IO is None, reason="gradcoll.transport._tcp_io is not built: `make install`")


def run(n: int, fn: Any) -> list[Any]:
    groups = [ProcessGroup(t) for t in threaded_group(tcp.create, n, timeout=20)]
    try:
        results, errors = gather_ranks(lambda r: fn(groups[r]), n, join_timeout=60)
    finally:
        for g in groups:
            g.close()
    assert errors == [None] * n, errors
    return results


def exact(g: ProcessGroup, count: int, dtype: Any, op: str = "sum") -> bool:
    """One allreduce of ``rank + 1 + i`` (integers: every order of the sum is exact)."""
    x = np.arange(count, dtype=dtype) + (g.rank + 1)
    g.allreduce(x, op=op)
    n = g.size
    want = np.arange(count, dtype=np.float64) * n + n * (n + 1) // 2
    return bool(np.array_equal(x, (want / n if op == "mean" else want).astype(dtype)))


@needs_io
@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_size_is_prepared_once_and_its_calls_are_exact(n: int, monkeypatch) -> None:
    built: list[tuple[str, int]] = []
    real = _planned.Prepared.__init__

    def spy(self: Any, t: Any, sched: Any, *a: Any) -> None:
        built.append((sched.algo, a[1]))
        real(self, t, sched, *a)

    monkeypatch.setattr(_planned.Prepared, "__init__", spy)

    def fn(g: ProcessGroup) -> list[Any]:
        out = [exact(g, count, dt, op) for _ in range(3)
               for count, dt, op in ((1000, np.float32, "sum"), (300_000, np.float64, "sum"), (300_000, np.float64, "mean"))]
        return [all(out), g.seq, g.stats().ops["allreduce"].count,
                sum(p.route == "rounds" for p in g._prepared.values())]

    res = run(n, fn)
    assert res == [[True, 9, 9, 3]] * n, res
    # one plan per rank and per (size, dtype, op): recursive doubling needs a power-of-two group
    assert len(built) == 3 * n, built
    assert {algo for algo, _ in built} <= {"recursive_doubling", "halving_doubling", "ring"}


@needs_io
def test_the_prepared_calls_stay_bounded(monkeypatch) -> None:
    monkeypatch.setattr(process_group, "_KEEP", 3)

    def fn(g: ProcessGroup) -> list[Any]:
        ok = [exact(g, count, np.float32) for count in (10, 20, 30, 40, 50, 10)]
        return [all(ok), len(g._prepared) <= 3]

    assert run(4, fn) == [[True, True]] * 4


@needs_io
def test_a_declined_call_runs_the_algorithms_own_path_with_the_same_seq(monkeypatch) -> None:
    declined: list[int] = []

    def decline(self: Any, *a: Any) -> int:  # as a transport whose work another thread queued
        declined.append(1)
        return 0

    groups = [ProcessGroup(t) for t in threaded_group(tcp.create, 2, timeout=20)]
    try:
        def phase(_: int) -> list[Any]:
            return run_on(groups, lambda g: [exact(g, 1000, np.float32), g.seq])

        assert phase(0) == [[True, 1]] * 2  # prepared, run compiled
        with monkeypatch.context() as m:
            m.setattr(tcp_rounds.Runner, "__call__", decline)
            assert phase(1) == [[True, 2]] * 2  # declined: the algorithm's own path, seq 1
        assert declined, "the prepared call did not reach the transport"
        assert phase(2) == [[True, 3]] * 2
        assert [g.stats().ops["allreduce"].count for g in groups] == [3, 3]
    finally:
        for g in groups:
            g.close()


def run_on(groups: list[ProcessGroup], fn: Any) -> list[Any]:
    results, errors = gather_ranks(lambda r: fn(groups[r]), len(groups), join_timeout=60)
    assert errors == [None] * len(groups), errors
    return results

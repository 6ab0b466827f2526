"""ProcessGroup and Work over the inproc transport, ranks as threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, GroupPoisoned, NonFiniteError, TransportClosed, UsageError
from gradcoll.group.process_group import ProcessGroup, Work
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world


def run_groups(n: int, fn: Callable[[ProcessGroup], Any], timeout: float = 10.0) -> tuple[list[Any], list[Any]]:
    """Run ``fn(group)`` on ``n`` threads, one ProcessGroup each; returns (results, errors)."""
    groups = [ProcessGroup(t) for t in create_world(n, timeout=timeout)]
    try:
        return gather_ranks(lambda r: fn(groups[r]), n)
    finally:
        for g in groups:
            g.close()


def ok(n: int, fn: Callable[[ProcessGroup], Any], timeout: float = 10.0) -> list[Any]:
    results, errors = run_groups(n, fn, timeout)
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.mark.parametrize("algorithm", ["auto", "ring", "star", "recursive_doubling"])
def test_allreduce_in_place_returns_the_buffer(algorithm: str) -> None:
    def fn(g: ProcessGroup) -> bool:
        buf = np.full((3, 5), g.rank + 1, np.float32)
        out = g.allreduce(buf, algorithm=algorithm)
        return out is buf and bool((buf == 2.5).all())

    assert ok(4, fn) == [True] * 4


def test_strided_buffer_is_reduced_in_place() -> None:
    def fn(g: ProcessGroup) -> np.ndarray:
        base = np.zeros((6, 4), np.float64)
        view = base[:, 1]
        view[:] = g.rank
        g.allreduce(view, op="sum")
        return base

    for base in ok(3, fn):
        assert (base[:, 1] == 3).all() and (base[:, 0] == 0).all()


def test_ops_and_sequence_numbers() -> None:
    def fn(g: ProcessGroup) -> tuple:
        x = np.array([g.rank, -g.rank], np.float32)
        got = tuple(g.allreduce(x.copy(), op=op).tolist() for op in ("sum", "max", "min", "mean"))
        return got + (g.seq,)

    for r in ok(3, fn):
        assert r == ([3, -3], [2, 0], [0, -2], [1, -1], 4)


def test_async_work_runs_in_submission_order_and_overlaps() -> None:
    def fn(g: ProcessGroup) -> list:
        bufs = [np.full(1000, g.rank * 10 + k, np.float64) for k in range(5)]
        works = [g.allreduce(b, op="sum", async_op=True) for b in bufs]
        assert all(isinstance(w, Work) for w in works)
        sync = g.allreduce(np.ones(2), op="sum")  # queued behind the async ones
        assert all(w.is_completed() for w in works) and sync.tolist() == [3.0, 3.0]
        return [w.wait()[0] for w in works] + [w.exception() for w in works]

    for r in ok(3, fn):
        assert r == [30.0 + 3 * k for k in range(5)] + [None] * 5


def test_work_wait_with_timeout_and_result() -> None:
    go = threading.Event()

    def fn(g: ProcessGroup) -> Any:
        if g.rank == 1:
            go.wait(10)
            return g.barrier()
        w = g.barrier(async_op=True)
        with pytest.raises(CollectiveTimeout, match="still running"):
            w.wait(timeout=0.01)
        assert not w.is_completed() and w.exception() is None
        go.set()
        return w.result(timeout=10)

    ok(2, fn)


def test_allreduce_many_packs_mixed_shapes_and_dtypes() -> None:
    def fn(g: ProcessGroup) -> list:
        arrays = [np.full((2, 3), g.rank, np.float32), np.full(5, g.rank, np.float64),
                  np.full(1, g.rank, np.float32), np.zeros(0, np.float32)]
        before = g.seq
        out = g.allreduce_many(arrays, op="sum")
        assert out[0] is arrays[0] and g.seq == before + 2  # one collective per dtype
        return [a.tolist() for a in out]

    for r in ok(3, fn):
        assert r == [[[3.0] * 3] * 2, [3.0] * 5, [3.0], []]
    works = ok(2, lambda g: g.allreduce_many([np.ones(4, np.float32)], async_op=True).wait())
    assert [w[0].tolist() for w in works] == [[1.0] * 4] * 2


def test_nonfinite_poisons_the_group_on_every_rank() -> None:
    def fn(g: ProcessGroup) -> Any:
        x = np.ones(10, np.float32)
        if g.rank == 2:
            x[4] = np.inf
        with pytest.raises(NonFiniteError) as info:
            g.allreduce(x)
        assert (info.value.contributor, info.value.index, info.value.seq) == (2, 4, 0)
        assert g.poisoned
        with pytest.raises(GroupPoisoned, match=r"seq 0\) failed with NonFiniteError") as again:
            g.barrier()
        assert isinstance(again.value.__cause__, NonFiniteError)
        return True

    assert ok(3, fn) == [True] * 3


def test_failed_async_work_poisons_what_is_queued_behind_it() -> None:
    def fn(g: ProcessGroup) -> list:
        x = np.ones(4, np.float32)
        x[1] = np.nan if g.rank == 1 else 1.0
        first = g.allreduce(x, async_op=True)
        try:
            second = g.allreduce(np.ones(4, np.float32), async_op=True)
        except GroupPoisoned:  # the first had already failed (a slow machine): refused at the call instead
            with pytest.raises(NonFiniteError):
                first.wait(10)
            return [type(first.exception()).__name__, "GroupPoisoned"]
        with pytest.raises(GroupPoisoned):
            second.wait(10)
        return [type(first.exception()).__name__, type(second.exception()).__name__]

    assert ok(2, fn) == [["NonFiniteError", "GroupPoisoned"]] * 2


def test_usage_errors_do_not_poison() -> None:
    def fn(g: ProcessGroup) -> bool:
        for bad in (lambda: g.allreduce(np.ones(3, np.int64)), lambda: g.allreduce([1.0, 2.0]),
                    lambda: g.allreduce(np.ones(3), op="prod"), lambda: g.allreduce(np.ones(3), algorithm="magic"),
                    lambda: g.broadcast(np.ones(3), root=7), lambda: g.allgather(np.ones(2), out=np.ones(3))):
            with pytest.raises((UsageError, TypeError)):  # a list is an unsupported object: TypeError
                bad()
        assert g.seq == 0 and not g.poisoned
        return g.allreduce(np.ones(2)).tolist() == [1.0, 1.0]

    assert ok(2, fn) == [True, True]


def test_mismatch_and_timeout_messages_name_ranks_and_seq() -> None:
    _, errors = run_groups(2, lambda g: g.allreduce(np.ones(4 + g.rank, np.float32), algorithm="ring"))
    for e in errors:
        assert isinstance(e, CollectiveMismatch)
        assert "count=4" in str(e) and "count=5" in str(e) and "seq 0" in str(e)

    def late(g: ProcessGroup) -> Any:
        if g.rank == 1:
            return None
        return g.allreduce(np.ones(8), timeout=0.2)

    _, errors = run_groups(3, late)
    assert errors[1] is None
    for e in (errors[0], errors[2]):
        assert isinstance(e, CollectiveTimeout) and e.missing == [1] and e.seq == 0 and e.nbytes == 64


def test_close_fails_peers_and_queued_work() -> None:
    closed = threading.Event()

    def fn(g: ProcessGroup) -> Any:
        if g.rank == 0:
            g.close()
            closed.set()
            with pytest.raises(TransportClosed, match="group is closed"):
                g.barrier()
            return "closed"
        closed.wait(10)
        with pytest.raises(TransportClosed, match="peer 0"):
            g.allreduce(np.ones(3))
        return "saw it"

    assert ok(2, fn) == ["closed", "saw it"]
    (t,) = create_world(1)
    g = ProcessGroup(t)
    with g:
        g.barrier()
    assert t.closed


def test_collectives_through_the_group() -> None:
    def fn(g: ProcessGroup) -> tuple:
        b = g.broadcast(np.full(3, g.rank, np.int32), root=2)
        gathered = g.allgather(np.array([g.rank, g.rank * g.rank]))
        x = np.arange(10, dtype=np.float64) * (g.rank + 1)
        mine = g.reduce_scatter(x, op="sum")
        g.barrier()
        return b.tolist(), gathered.tolist(), mine.tolist()

    res = ok(3, fn)
    full = (np.arange(10) * 6.0).tolist()
    for r, (b, gathered, mine) in enumerate(res):
        assert b == [2, 2, 2] and gathered == [[0, 0], [1, 1], [2, 4]]
        assert mine == full[[0, 4, 7, 10][r]:[0, 4, 7, 10][r + 1]]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 6), shapes=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3), max_size=4))
def test_allreduce_many_property(n: int, shapes: list[list[int]]) -> None:
    def fn(g: ProcessGroup) -> list:
        arrays = [np.full(tuple(s), g.rank + 1.0, np.float32) for s in shapes]
        return [a.copy() for a in g.allreduce_many(arrays, op="mean")]

    for out in ok(n, fn):
        assert [a.shape for a in out] == [tuple(s) for s in shapes]
        assert all((a == (n + 1) / 2).all() for a in out)


def test_the_one_host_fast_path_gives_what_the_general_path_gives() -> None:
    """On a transport with a shared window, ``auto`` takes a shorter path for native float32/float64 C-contiguous
    buffers; every other buffer takes the general one. Both reduce the same bits, count the same seqs and stats."""
    def fn(g: ProcessGroup) -> list[Any]:
        out: list[Any] = []
        rng = np.random.default_rng(g.rank)
        for dt in (np.float32, np.float64, np.float16):
            a = rng.standard_normal((7, 9)).astype(dt)
            b = a.copy()
            g.allreduce(a, op="mean")                       # float32/float64: the fast path
            g.allreduce(b, op="mean", algorithm="direct")   # the general path, the same algorithm
            out.append(np.array_equal(a, b))
        strided = np.arange(6.0)
        view = np.zeros(12)[::2]
        view[:] = strided
        g.allreduce(view, op="sum")
        out.append(view.tolist() == (strided * g.size).tolist())
        readonly = np.ones(3, np.float32)
        readonly.flags.writeable = False
        for bad in (np.ones(3, ">f4"), readonly):  # a byte order and a buffer the fast path leaves to the general one
            with pytest.raises(UsageError):
                g.allreduce(bad)
        out.append((g.seq, g.poisoned, g.stats().ops["allreduce"].count))
        return out

    for res in ok(2, fn):
        assert res[:4] == [True, True, True, True]
        assert res[4] == (7, False, 7)


def test_a_fast_path_call_behind_a_pending_async_call_runs_after_it() -> None:
    """The one-host fast path runs a call inline only when nothing is queued: behind an async call it waits its
    turn (seqs in call order on every rank)."""
    def fn(g: ProcessGroup) -> tuple[float, float, int]:
        a = np.full(1000, g.rank + 1.0, np.float32)
        b = np.full(1000, 10.0 * (g.rank + 1), np.float32)
        work = g.allreduce(a, op="sum", async_op=True)
        g.allreduce(b, op="sum")
        work.wait()
        return float(a[0]), float(b[0]), g.seq

    for res in ok(2, fn):
        assert res == (3.0, 30.0, 2)


def test_the_fast_path_takes_the_deterministic_and_wire_variants_with_the_general_paths_bits() -> None:
    """``deterministic=True`` and ``wire_dtype=`` of a native buffer on one host take the fast path too; the bits,
    seqs and stats equal those of the general path (``algorithm="direct"``), and what it does not take (another op,
    a float64 wire) still raises as the general path does."""
    def fn(g: ProcessGroup) -> list[Any]:
        out: list[Any] = []
        rng = np.random.default_rng(10 + g.rank)
        for dt, kw in ((np.float32, {"deterministic": True}), (np.float64, {"deterministic": True}),
                       (np.float32, {"wire_dtype": "bf16"}), (np.float32, {"wire_dtype": "fp16"})):
            for count in (1000, 300_001):
                a = rng.standard_normal(count).astype(dt)
                b = a.copy()
                for _ in range(2):  # the second call of a size runs the compiled engine
                    a[:] = b
                    g.allreduce(a, op="mean", **kw)
                c = b.copy()
                g.allreduce(c, op="mean", algorithm="direct", **kw)
                out.append(a.tobytes() == c.tobytes())
        m = g.allreduce(np.full(8, g.rank, np.float32), op="max", deterministic=True)  # exact: the plain form
        out.append(m.tolist() == [g.size - 1.0] * 8)
        with pytest.raises(UsageError):
            g.allreduce(np.ones(8, np.float64), wire_dtype="bf16")
        out.append((g.seq, g.poisoned, g.stats().ops["allreduce"].count))
        return out

    for res in ok(2, fn, timeout=60):
        assert res[:-1] == [True] * 9, res
        assert res[-1] == (25, False, 25)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,count", [(2, 1000), (4, 1000), (4, 300_000), (3, 300_000)])
def test_the_tcp_fast_path_gives_what_the_general_path_gives(n: int, count: int, monkeypatch) -> None:
    """A group over tcp runs the plain mean and sum calls ``auto`` gives recursive doubling, halving-doubling or the
    ring as one compiled call of all their rounds (the prepared allreduce's ``rounds`` route), and so the calls that
    name it, whatever the buffer object, and async ones: the same bits, seqs, stats and poisoning as the guard's
    path."""
    from gradcoll.algorithms import _planned
    from gradcoll.testing import threaded_group
    from gradcoll.transport import tcp

    taken: list[int] = []
    real = _planned.Prepared.__call__  # the compiled call of one size (its plan made once)

    def spy(self: Any, seq: int, *a: Any) -> Any:
        taken.append(seq)
        return real(self, seq, *a)

    monkeypatch.setattr(_planned.Prepared, "__call__", spy)
    groups = [ProcessGroup(t) for t in threaded_group(tcp.create, n, timeout=20)]
    algos = {groups[0]._prepare((count, np.dtype(dt), "mean", "auto", True, None, False)).algorithm
             for dt in (np.float32, np.float64)}
    # the model's choice, one algorithm for both dtypes, and one that runs compiled (the ring in any group)
    assert len(algos) == 1 and algos <= {"recursive_doubling", "halving_doubling", "ring"}, algos
    assert algos == {"recursive_doubling"} if count < 100_000 else algos != {"recursive_doubling"}
    name = algos.copy().pop()

    def fn(r: int) -> list[Any]:
        g, out = groups[r], []
        rng = np.random.default_rng(r)
        for dt in (np.float32, np.float64):
            a = rng.standard_normal(count).astype(dt)
            b, c = a.copy(), a.copy()
            g.allreduce(a)                                        # the fast path
            g.allreduce(memoryview(b), algorithm=name)            # a buffer object: the same prepared call
            g.allreduce(c, algorithm=name)                        # by name
            out.append(a.tobytes() == b.tobytes() == c.tobytes())
        m = np.full(5, float(r))
        g.allreduce(m, op="max")                                  # another op: the general path
        out.append(m.tolist() == [n - 1.0] * 5)
        w = g.allreduce(np.ones(3, np.float32), async_op=True)    # async: a prepared call too
        out.append(w.wait(10).tolist() == [1.0] * 3)
        out.append((g.seq, g.stats().ops["allreduce"].count))
        bad = np.ones(count, np.float32)
        if r == n - 1:
            bad[4] = np.nan
        with pytest.raises(NonFiniteError, match=f"rank {n - 1}"):
            g.allreduce(bad)                                      # the fast path: it poisons as the general path
        out.append(g.poisoned)
        return out

    try:
        results, errors = gather_ranks(fn, n, join_timeout=60)
        assert errors == [None] * n, errors
        for res in results:
            assert res == [True, True, True, True, (8, 8), True], res
        # float32, float64 (auto, buffer object, named), async (recursive doubling), the NaN call; not max
        tiny = groups[0]._prepare((3, np.dtype(np.float32), "mean", "auto", True, None, False)).route
        want = [0, 1, 2, 3, 4, 5, 8] + ([7] if tiny == "rounds" else [])
        assert sorted(taken) == sorted(want * n), taken
    finally:
        for g in groups:
            g.close()

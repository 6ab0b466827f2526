"""group_mean (old name mean_reduce) and the group's collectives in both topologies, at several world sizes, over TCP."""

from __future__ import annotations

import numpy as np
import pytest

from gradcoll.errors import GradcollError, TransportError, UsageError
from gradcoll.node import connect_local, group_mean, mean_reduce
from gradcoll.testing import run_ranks


def _groups(world: int, topology: str = "mesh"):
    return connect_local(world, topology=topology, timeout=10, kernel_backend="numpy")


def _each(groups, fn, timeout: float = 20.0):
    try:
        return run_ranks([fn] * len(groups), groups, timeout=timeout, on_error=lambda: [g.close() for g in groups])
    finally:
        for g in groups:
            g.close()


def test_ring_sum_of_1_to_4_over_4_ranks_is_10_and_mean_2_5() -> None:
    def body(g):
        s = mean_reduce(g, np.array([g.rank + 1.0], np.float32), op="sum")
        m = mean_reduce(g, np.array([g.rank + 1.0], np.float32))
        return s[0], m[0]

    assert _each(_groups(4), body) == [(10.0, 2.5)] * 4


@pytest.mark.parametrize("flag", [{"float64_accumulate": True}, {"deterministic": True}])
def test_float64_accumulate_sums_in_float64_under_either_name(flag: dict) -> None:
    values = [1e8, -1e8, 4.0, 4.0]

    def body(g):
        buf = np.array([values[g.rank]], np.float32)
        out = group_mean(g, buf, op="sum", **flag)
        assert out is buf and out.dtype == np.float32
        return out[0], mean_reduce(g, np.array([values[g.rank]], np.float32), **flag)[0]

    assert _each(_groups(4), body) == [(8.0, 2.0)] * 4


def test_the_old_names_are_aliases_and_the_flag_names_must_agree() -> None:
    import gradcoll.node as node

    assert node.mean_reduce is node.group_mean
    (g,) = _groups(1)
    try:
        with pytest.raises(UsageError, match="disagree"):
            group_mean(g, np.ones(2, np.float32), float64_accumulate=True, deterministic=False)
        with pytest.raises(UsageError, match="deterministic must be true or false"):
            group_mean(g, np.ones(2, np.float32), deterministic="yes")  # type: ignore[arg-type]
        assert group_mean(g, np.ones(2, np.float32), float64_accumulate=True, deterministic=True).tolist() == [1, 1]
    finally:
        g.close()


@pytest.mark.parametrize("topology", ["mesh", "star"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_collective_works_in_both_topologies(topology: str, world: int) -> None:
    """The original's star could not run ring collectives beyond 2 ranks; gradcoll's star runs all of them."""
    def body(g):
        n, r = g.size, g.rank
        base = np.arange(7, dtype=np.float64)
        want = base + (n - 1) / 2
        mean = mean_reduce(g, base + r)
        np.testing.assert_allclose(mean, want)
        for algo in ("ring", "star", "recursive_doubling"):
            np.testing.assert_allclose(g.allreduce(base + r, algorithm=algo), want)
        np.testing.assert_array_equal(g.broadcast(np.full(3, float(r)), root=n - 1), [n - 1.0] * 3)
        np.testing.assert_array_equal(g.allgather(np.array([r, r * r]))[:, 1], [k * k for k in range(n)])
        g.barrier()
        return float(mean.sum())

    assert len(set(_each(_groups(world, topology), body))) == 1


@pytest.mark.parametrize("count", [0, 1, 3, 1001])
def test_mean_reduce_matches_numpy_for_odd_sizes(count: int) -> None:
    rng = np.random.default_rng(count)
    rows = rng.normal(size=(3, count)).astype(np.float32)
    out = _each(_groups(3), lambda g: mean_reduce(g, rows[g.rank].copy()))
    for o in out:
        np.testing.assert_allclose(o, rows.mean(axis=0), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(o, out[0])  # bit-identical on every rank


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_a_failed_reduce_raises_instead_of_returning_zeros(topology: str) -> None:
    groups = _groups(3, topology)
    groups[2].close()  # a rank that went away
    try:
        def body(g):
            with pytest.raises(GradcollError) as info:
                mean_reduce(g, np.ones(4, np.float32), timeout=10)
            return info.value

        errors = run_ranks([body] * 2, groups[:2], timeout=20)
        assert any(isinstance(e, TransportError) for e in errors)
    finally:
        for g in groups:
            g.close()


def test_mean_reduce_misuse() -> None:
    (g,) = _groups(1)
    try:
        with pytest.raises(UsageError, match="'mean' or 'sum'"):
            mean_reduce(g, np.ones(2), op="max")
        with pytest.raises(UsageError, match="float16/32/64"):
            mean_reduce(g, np.ones(2, np.int32))
        with pytest.raises(UsageError, match="float16/32/64"):
            mean_reduce(g, [1.0, 2.0])  # type: ignore[arg-type]
        np.testing.assert_array_equal(mean_reduce(g, np.array([3.0])), [3.0])
    finally:
        g.close()

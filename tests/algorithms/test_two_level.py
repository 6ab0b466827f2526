"""The two-level allreduce over the inproc transport: host layouts, ops, errors in every step, the error path.

Each test runs twice: over one inproc world (steps 1 and 3 as messages, ``intra="star"``) and over a routed
world, the layout of a tcp group (``RoutedTransport``: an inproc world per host, whose shared window steps 1
and 3 go through, ``intra="window"``, between the group's world).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE
from gradcoll.algorithms.two_level import host_layout, two_level_allreduce
from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, UsageError
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world
from gradcoll.transport.routed import RoutedTransport

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "interleaved": ["a", "b", "a", "b"],
    "uneven": ["a", "a", "a", "b", "c", "c"],
    "one host": ["a"] * 3,
    "one per host": ["a", "b", "c", "d", "e"],
    "3x3": [h for h in "abc" for _ in range(3)],
}


INTRA = ["star", "window"]


def routed_world(hosts: list[str], timeout: float) -> list[Any]:
    """One transport per rank as a tcp group's two-level allreduce has it: the host's ranks through their own world."""
    net = create_world(len(hosts), timeout=timeout)
    out: list[Any] = list(net)
    for members in host_layout(hosts):
        local = create_world(len(members), timeout=timeout)
        for i, r in enumerate(members):
            out[r] = RoutedTransport(net[r], local[i], members)
    return out


def run(hosts: list[str], fn: Any, timeout: float = 10.0, intra: str = "star") -> tuple[list[Any],
                                                                                       list[BaseException | None]]:
    ts = routed_world(hosts, timeout) if intra == "window" else create_world(len(hosts), timeout=timeout)
    return gather_ranks(lambda r: fn(r, ts[r]), len(hosts))


def test_host_layout_groups_ranks_by_host_in_rank_order() -> None:
    assert host_layout(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("op", ["mean", "sum", "max", "min"])
@pytest.mark.parametrize("cross", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("intra", INTRA)
def test_matches_the_reference_on_every_layout(layout: str, op: str, cross: str, intra: str) -> None:
    hosts = LAYOUTS[layout]
    n = len(hosts)
    rng = np.random.default_rng(n)
    data = [rng.integers(-50, 50, 1037).astype(np.float64) for _ in range(n)]  # integers: every order is exact
    bufs = [d.copy() for d in data]
    stack = np.stack(data)
    want = {"mean": stack.sum(0) / n, "sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}[op]
    _, errors = run(hosts, lambda r, t: two_level_allreduce(t, bufs[r], hosts=hosts, op=op, cross=cross,
                                                              segment_bytes=512, seq=3, intra=intra), intra=intra)
    assert errors == [None] * n
    for b in bufs:
        np.testing.assert_allclose(b, want, rtol=1e-15)
        assert b.tobytes() == bufs[0].tobytes()  # bitwise the same on every rank


@pytest.mark.parametrize("intra", INTRA)
def test_registered_and_float32_and_empty(intra: str) -> None:
    hosts = LAYOUTS["2x2"]
    bufs = [np.full(10, r + 1, np.float32) for r in range(4)]
    empty = [np.zeros(0, np.float32) for _ in range(4)]
    _, errors = run(hosts, lambda r, t: (ALLREDUCE["two_level"](t, bufs[r], hosts=hosts),
                                         ALLREDUCE["two_level"](t, empty[r], hosts=hosts, seq=1)), intra=intra)
    assert errors == [None] * 4
    assert all((b == 2.5).all() for b in bufs)


@pytest.mark.parametrize("intra", INTRA)
def test_bad_input_halts_every_rank_naming_the_contributor(intra: str) -> None:
    hosts = LAYOUTS["uneven"]
    bufs = [np.ones(500, np.float32) for _ in hosts]
    bufs[4][123] = np.inf  # a non-leader of host c
    _, errors = run(hosts, lambda r, t: two_level_allreduce(t, bufs[r], hosts=hosts, seq=2),
                    intra=intra)
    assert all(isinstance(e, NonFiniteError) for e in errors), errors
    assert {e.contributor for e in errors} == {4} and "element 123" in str(errors[0])  # type: ignore[union-attr]


@pytest.mark.parametrize("intra", INTRA)
def test_overflow_between_leaders_halts_every_rank(intra: str) -> None:
    hosts = LAYOUTS["2x2"]
    big = np.finfo(np.float32).max
    bufs = [np.full(300, big if r < 2 else big / 2, np.float32) for r in range(4)]
    _, errors = run(hosts, lambda r, t: two_level_allreduce(t, bufs[r], hosts=hosts, op="sum", seq=2),
                    intra=intra)
    assert all(isinstance(e, NonFiniteError) and "overflowed" in str(e) for e in errors), errors


@pytest.mark.parametrize("intra", INTRA)
def test_a_rank_calling_something_else_is_a_mismatch_on_every_rank(intra: str) -> None:
    hosts = LAYOUTS["2x2"]

    def rank(r: int, t: Any) -> Any:
        if r == 3:
            return ALLREDUCE["ring"](t, np.ones(64, np.float32), seq=5, timeout=5.0)
        return two_level_allreduce(t, np.ones(64, np.float32), hosts=hosts, seq=5, timeout=5.0)

    _, errors = run(hosts, rank, intra=intra)
    assert all(isinstance(e, CollectiveMismatch) for e in errors), errors


@pytest.mark.parametrize("absent", [1, 2])  # a member (its leader waits in step 1), a leader (step 2)
@pytest.mark.parametrize("intra", INTRA)
def test_a_rank_that_never_arrives_is_named_on_every_other(absent: int, intra: str) -> None:
    hosts = LAYOUTS["2x2"]

    def rank(r: int, t: Any) -> Any:
        if r == absent:
            return None
        return two_level_allreduce(t, np.ones(64, np.float32), hosts=hosts, seq=1, timeout=0.5)

    _, errors = run(hosts, rank, intra=intra)
    for r, e in enumerate(errors):
        if r != absent:
            assert isinstance(e, CollectiveTimeout) and absent in e.missing, (r, e)


def test_bad_arguments() -> None:
    t = create_world(2)[0]
    with pytest.raises(UsageError, match="hosts names 3 ranks"):
        two_level_allreduce(t, np.ones(4, np.float32), hosts=["a", "a", "b"])
    with pytest.raises(UsageError, match="cross must be"):
        two_level_allreduce(t, np.ones(4, np.float32), hosts=["a", "b"], cross="star")


# -- the window steps (intra="window") ------------------------------------------------------------------------------
def test_auto_takes_the_window_where_the_host_is_routed_through_shared_memory() -> None:
    from gradcoll.algorithms import _two_level_window as win

    hosts = LAYOUTS["2x2"]
    assert all(win.available(t) for t in routed_world(hosts, 5.0))
    assert not any(win.available(t) for t in create_world(4))
    with pytest.raises(UsageError, match="intra='window' needs"):
        two_level_allreduce(create_world(2)[0], np.ones(4, np.float32), hosts=["a", "b"], intra="window")


def test_window_pieces_over_several_calls_are_the_stars_bits() -> None:
    """Buffers of several pieces, three calls in a row (each piece's buffers in turn), three members a host:
    bitwise what the star's messages give, and the integers' exact mean."""
    from gradcoll.algorithms._two_level_window import PIECE_BYTES

    hosts = LAYOUTS["3x3"]
    n = len(hosts)
    count = (5 * PIECE_BYTES) // 2 // 4 + 7  # 2.5 pieces of float32 and a tail
    rng = np.random.default_rng(7)
    data = [rng.integers(-1000, 1000, count).astype(np.float32) for _ in range(n)]
    want = np.stack(data).astype(np.float64).sum(0) / n
    results: dict[str, list[list[np.ndarray]]] = {}
    for intra in INTRA:
        bufs = [[d * (k + 1) for d in data] for k in range(3)]

        def rank(r: int, t: Any, bufs: list[list[np.ndarray]] = bufs, intra: str = intra) -> None:
            for k in range(3):
                two_level_allreduce(t, bufs[k][r], hosts=hosts, seq=k, intra=intra)

        _, errors = run(hosts, rank, intra=intra)
        assert errors == [None] * n
        results[intra] = bufs
    for k in range(3):
        for r in range(n):
            assert results["window"][k][r].tobytes() == results["star"][k][r].tobytes()
            np.testing.assert_allclose(results["window"][k][r], want * (k + 1), rtol=1e-6)


def test_a_member_with_another_count_is_a_mismatch_naming_it_on_every_rank() -> None:
    hosts = LAYOUTS["2x2"]

    def rank(r: int, t: Any) -> Any:
        return two_level_allreduce(t, np.ones(80 if r == 3 else 64, np.float32), hosts=hosts, seq=4, timeout=5.0,
                                   intra="window")

    _, errors = run(hosts, rank, intra="window")
    assert all(isinstance(e, CollectiveMismatch) for e in errors), errors
    assert all("rank 3" in str(e) for e in errors), errors


def test_hosts_other_than_the_routes_take_the_messages() -> None:
    """A routed transport whose hosts differ from the call's: the window would hold the wrong ranks."""
    ts = routed_world(LAYOUTS["2x2"], 5.0)
    other = ["a", "b", "a", "b"]
    with pytest.raises(UsageError, match="intra='window' needs"):
        two_level_allreduce(ts[0], np.ones(4, np.float32), hosts=other, intra="window")
    bufs = [np.full(50, r, np.float64) for r in range(4)]
    _, errors = gather_ranks(lambda r: two_level_allreduce(ts[r], bufs[r], hosts=other, op="sum"), 4)
    assert errors == [None] * 4 and all((b == 6).all() for b in bufs)

"""The cost model of groups spanning hosts (gradcoll.model.hierarchy) against the real code on simulated hosts."""

from __future__ import annotations

import pytest

from gradcoll.algorithms import auto_thresholds, select_allreduce
from gradcoll.algorithms.simulate import simulate
from gradcoll.model import hierarchy
from gradcoll.model.costmodel import AlphaBeta, link_model, predict, stored_models

REDUCE = 7.25e9
NET = link_model(10, 25e-6, REDUCE)
LOCAL = AlphaBeta(5e-6, 1 / 20e9, 1 / REDUCE)


def hosts_of(n: int, per_host: int) -> list[int]:
    return [r // per_host for r in range(n)]


@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("nbytes", [1 << 12, 1 << 20, 64 << 20])
def test_closed_forms_match_the_simulated_hosts(n: int, nbytes: int) -> None:
    layout, hosts = [8] * (n // 8), hosts_of(n, 8)
    for cross in hierarchy.CROSS:
        sim = max(simulate("two_level", n, nbytes, NET, hosts=hosts, local=LOCAL, cross=cross))
        inside = predict("star", 8, nbytes, LOCAL)
        assert sim == pytest.approx(inside + predict(cross, n // 8, nbytes, NET), rel=0.1), cross
    best = max(simulate("two_level", n, nbytes, NET, hosts=hosts, local=LOCAL,
                        cross=hierarchy.step_times(layout, nbytes, LOCAL, NET)[2]))
    assert hierarchy.two_level_time(layout, nbytes, LOCAL, NET) == pytest.approx(best, rel=0.1)
    rd = max(simulate("recursive_doubling", n, nbytes, NET, hosts=hosts, local=LOCAL))
    assert hierarchy.flat_time("recursive_doubling", layout, nbytes, LOCAL, NET) == pytest.approx(rd, rel=0.02)
    ring = max(simulate("ring", n, nbytes, NET, hosts=hosts, local=LOCAL))
    assert hierarchy.flat_time("ring", layout, nbytes, LOCAL, NET) == pytest.approx(ring, rel=0.12)


def test_the_simulated_hosts_move_messages_over_their_own_links() -> None:
    # Two ranks on one host with a free local link: only the network model's reduction is left.
    free = AlphaBeta(0.0, 0.0, 1 / REDUCE)
    t = simulate("ring", 2, 1 << 20, NET, hosts=["a", "a"], local=free)
    assert max(t) == pytest.approx((1 << 19) / REDUCE, rel=1e-6)
    assert max(simulate("ring", 2, 1 << 20, NET, hosts=["a", "b"], local=free)) > 10 * max(t)


def test_one_host_or_one_rank_per_host_is_not_two_level() -> None:
    assert not hierarchy.eligible([4]) and not hierarchy.eligible([1, 1, 1]) and hierarchy.eligible([2, 1])
    assert hierarchy.two_level_time([4], 1 << 20, LOCAL, NET) == pytest.approx(predict("star", 4, 1 << 20, LOCAL))
    assert hierarchy.pick([1, 1, 1, 1], 1 << 20, LOCAL, NET) in ("ring", "star", "recursive_doubling", "halving_doubling")


@pytest.mark.parametrize("layout", [(2, 2), (8, 8), (4,) * 8, (8,) * 128])
def test_auto_with_a_layout_is_the_models_choice(layout: tuple[int, ...]) -> None:
    models = stored_models()
    net, cores, max_ranks = models["tcp"]
    local = models["window"][0]  # a tcp group's steps inside a host go through the shared window
    n = sum(layout)
    node = hierarchy.Node(n, cores) if cores is not None and n <= max_ranks else None
    up, cross = hierarchy.node_split(layout, node, sleeping=True)
    table = auto_thresholds(n, "tcp", layout)
    assert table[0][0] == 0 and all(a[0] < b[0] for a, b in zip(table, table[1:], strict=False))
    frame_s = hierarchy.stored_frame_s()
    for nbytes in (64, 4096, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
        want = hierarchy.pick(layout, nbytes, local, net, node=node, node_up=up, node_cross=cross,
                              intra="window_star", frame_s=frame_s)
        assert select_allreduce(nbytes, n, "tcp", layout=layout) == want, nbytes
    assert select_allreduce(1 << 20, n, "tcp") != "two_level"  # no layout, no two-level


def test_the_window_steps_terms_and_the_frame() -> None:
    from gradcoll.model.costmodel import Node, work

    s = float(1 << 22)
    w = work("window_star", 4, s)  # every rank checks its input; members copy in, the leader adds its buffer and
    # 3 slots, copies out, members copy out; two syncs a piece of 1 MiB
    assert (w.messages, w.link_bytes, w.reduced, w.copied) == (8.0, 0.0, 4 * s, 3 * s)
    # the host's totals: the leader's sum (3 S) and 4 checks; the leader's S out, every member's S in and S out.
    # The path holds a check, the sum and the copies of the leader and of one member; the others the rest
    assert w.reduced + 3 * w.other_reduced == pytest.approx(7 * s)
    assert w.copied + 3 * w.other_copied == pytest.approx(7 * s) and w.streamed == 2 * s
    assert work("window_star", 2, s).other_copied == 0.0 and work("window_star", 2, 1000.0).messages == 2.0
    assert w.message == 1 << 20  # the pieces the window moves the buffer in
    node = Node(4, 2.0)
    assert hierarchy.node_split((2, 2), node) == (Node(2, 1.0), Node(2, 1.0))
    assert hierarchy.node_split((2, 2), node, sleeping=True) == (Node(2, 1.0), Node(2, 2.0))
    assert hierarchy.frame_time(1e-5, 4, node) == pytest.approx(2e-5) and hierarchy.frame_time(1e-5, 4, None) == 1e-5
    base = hierarchy.two_level_time((2, 2), s, LOCAL, NET, intra="window_star")
    assert hierarchy.two_level_time((2, 2), s, LOCAL, NET, intra="window_star", frame_s=1e-5) == pytest.approx(base + 1e-5)
    assert w.copied < work("star", 4, s).copied  # fewer copies on the path than the star's messages
    # a host whose ranks share a core keeps its slots in that core's caches: the network fit's last-level cache
    shared, own = Node(2, 1.0), Node(2, 2.0)
    assert hierarchy.host_model("window_star", LOCAL, NET, own) is LOCAL
    assert hierarchy.host_model("star", LOCAL, NET, shared) is LOCAL
    assert hierarchy.host_model("window_star", LOCAL, NET, shared).cache_bytes == max(LOCAL.cache_bytes,
                                                                                      NET.cache_bytes)
    with pytest.raises(Exception, match="intra must be one of"):
        hierarchy.step_times((2, 2), s, LOCAL, NET, intra="ring")
    assert hierarchy.stored_frame_s() > 0  # benches/bench_two_level.py --fit stored it


def test_the_window_piece_size_is_the_algorithms() -> None:
    from gradcoll.algorithms._two_level_window import PIECE_BYTES
    from gradcoll.model.work import WINDOW_PIECE_BYTES

    assert PIECE_BYTES == WINDOW_PIECE_BYTES

"""The alpha-beta-gamma cost model and the simulated transport (docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradcoll import kernels
from gradcoll.algorithms import DEFAULT_TRANSPORT, SEARCH_BYTES, auto_thresholds, select_allreduce
from gradcoll.algorithms.simulate import simulate
from gradcoll.errors import UsageError
from gradcoll.model.costmodel import ALGORITHMS, AlphaBeta, Node, best, crossovers, fit, out_of_l2, predict, stored_models, terms, work

MODEL = AlphaBeta(20e-6, 1 / 2e9, 1 / 5e9)


def test_terms_closed_forms() -> None:
    s = 1 << 20
    assert terms("ring", 8, s) == (14, 14 * s / 8, 7 * s / 8)
    assert terms("star", 8, s) == (2, 14 * s, 7 * s)
    assert terms("recursive_doubling", 8, s) == (3, 3 * s, 3 * s)
    assert terms("recursive_doubling", 12, s) == (5, 5 * s, 4 * s)  # 3 rounds + fold + unfold
    assert terms("ring", 1, s) == (0.0, 0.0, 0.0)
    with pytest.raises(UsageError):
        terms("nope", 4, s)


def test_predict_is_linear_in_the_parameters() -> None:
    t = predict("ring", 4, 4096, MODEL)
    assert t == pytest.approx(6 * 20e-6 + 6 * 1024 / 2e9 + 3 * 1024 / 5e9)


def test_fit_recovers_known_parameters() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for n in (2, 4):
        for algo in ALGORITHMS:
            for k in range(12, 27, 2):
                t = predict(algo, n, 1 << k, MODEL) * (1 + 0.01 * rng.standard_normal())
                rows.append({"algorithm": algo, "ranks": n, "size": 1 << k, "time_avg_us": t * 1e6})
    m = fit(rows)
    assert m.alpha_s == pytest.approx(MODEL.alpha_s, rel=0.05)
    assert m.beta_s_per_byte == pytest.approx(MODEL.beta_s_per_byte, rel=0.05)
    assert m.gamma_s_per_byte == pytest.approx(MODEL.gamma_s_per_byte, rel=0.1)


def test_fit_drops_a_negative_parameter() -> None:
    truth = AlphaBeta(0.0, 1e-9, 1e-10)
    rows = [{"algorithm": a, "ranks": 2, "size": s, "time_avg_us": predict(a, 2, s, truth) * 1e6}
            for a in ALGORITHMS for s in (1 << 16, 1 << 20, 1 << 24)]
    m = fit(rows)
    assert m.alpha_s >= 0 and m.beta_s_per_byte > 0 and m.gamma_s_per_byte >= 0


def test_fit_reads_the_current_bench_fields_and_the_earlier_names() -> None:
    # gradcoll bench --json writes iter_mean_us_avg_over_ranks (the default time_key); rows under the earlier name
    # time_avg_us fit the same, and so do the stored files, read through load_rows.
    from gradcoll.cli.bench import load_rows

    rows = [{"algorithm": a, "ranks": n, "size": s, "iter_mean_us_avg_over_ranks": predict(a, n, s, MODEL) * 1e6}
            for a in ALGORITHMS for n in (2, 4) for s in (1 << 16, 1 << 20, 1 << 24)]
    earlier = [{**{k: v for k, v in r.items() if not k.startswith("iter_")}, "time_avg_us": r["iter_mean_us_avg_over_ranks"]}
               for r in rows]
    assert fit(rows) == fit(earlier)
    assert fit(rows).beta_s_per_byte == pytest.approx(MODEL.beta_s_per_byte, rel=1e-6)
    stored = sorted((Path(__file__).resolve().parents[2] / "benches" / "results" / "costmodel").glob("shm_*_2.json"))
    assert stored, "the stored cost-model measurements are missing"
    measured = [r for path in stored for r in load_rows(str(path))]
    assert "iter_mean_us_avg_over_ranks" in measured[0] and "time_avg_us" not in measured[0]
    m = fit(measured)
    assert m.alpha_s > 0 and m.beta_s_per_byte + m.gamma_s_per_byte > 0


def test_crossovers_are_where_best_changes() -> None:
    for n in (2, 8, 1024):
        for size, before, after in crossovers(MODEL, n):
            assert best(n, size - 4, MODEL) == before
            assert best(n, size, MODEL) == after
    assert crossovers(MODEL, 2)[-1][2] == "ring"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [8, 12, 16])
@pytest.mark.parametrize("nbytes", [1 << 20, 1 << 30])
def test_sim_runs_real_code_and_matches_closed_form(algorithm: str, n: int, nbytes: int) -> None:
    times = simulate(algorithm, n, nbytes, MODEL)
    assert len(times) == n
    assert max(times) == pytest.approx(predict(algorithm, n, nbytes, MODEL), rel=0.02)


def test_sim_leaves_the_kernels_alone() -> None:
    # The simulated ranks get their kernels through backend=, so nothing of gradcoll.kernels is replaced.
    acc, mean = kernels.accumulate, kernels.mean_reduce
    simulate("ring", 4, 1 << 20, MODEL)
    simulate("star", 4, 1 << 20, MODEL)
    assert kernels.accumulate is acc and kernels.mean_reduce is mean
    a = np.ones(4, np.float32)
    kernels.accumulate(a, np.ones(4, np.float32))
    assert a.tolist() == [2.0] * 4


def test_sim_ring_pipelining_is_not_slower() -> None:
    # With 1 MiB segments part of the reduction hides behind the next transfer.
    seg = simulate("ring", 8, 64 << 20, MODEL, elems_per_rank=64, segment_bytes=1 << 20)
    assert max(seg) <= predict("ring", 8, 64 << 20, MODEL) * 1.02


LOOPBACK = AlphaBeta(30e-6, 0.0, 1 / 4e9, delta_s_per_byte=1 / 15e9, switch_s=100e-6, mem_s_per_byte=7e-11,
                     cache_bytes=16 << 20, l2_s_per_byte=5e-11, l2_bytes=2 << 20, wait_share=0.5, wait_busy_s=2e-3)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [2, 8, 12])
@pytest.mark.parametrize("nbytes", [1 << 20, 4 << 20, 1 << 30])
def test_sim_matches_closed_form_with_copies_and_cache(algorithm: str, n: int, nbytes: int) -> None:
    # delta (copies on each rank's CPU, half duplex) and both cache terms (the node's, and the per-core one by
    # message size) are in both the simulation and the closed form.
    assert max(simulate(algorithm, n, nbytes, LOOPBACK)) == pytest.approx(predict(algorithm, n, nbytes, LOOPBACK), rel=0.02)


def test_work_counts_copies_on_the_critical_path() -> None:
    s = 1 << 20
    assert work("ring", 4, s).copied == 4 * 3 * s / 4  # every step copies S/n in and S/n out
    assert work("star", 4, s).copied == 7 * s  # the root's 2(n-1) S + its own copy; both ends of the star stream
    assert work("recursive_doubling", 4, s).copied == 4 * s
    assert work("recursive_doubling", 6, s)[:4] == (4, 4 * s, 3 * s, 6 * s)  # fold and unfold stream: S each
    assert work("halving_doubling", 4, s)[:4] == (4, 1.5 * s, 0.75 * s, 3 * s)  # the ring's bytes in 2 log2 p rounds
    assert work("halving_doubling", 6, s)[:4] == (6, 3.5 * s, 1.75 * s, 5 * s)  # and recursive doubling's fold, unfold
    # The streamed copies leave the critical path's cores, not the node's memory: the cache term still counts them.
    assert [work(a, 6, s).streamed for a in ALGORITHMS] == [0.0, 2 * s, 2 * s, 2 * s]
    assert work("recursive_doubling", 4, s).streamed == 0.0


def test_per_core_cache_term_goes_by_message_size() -> None:
    # A core touches 4 copies of a message (user and transport buffer, out and in): 512 KiB fit a 2 MiB cache,
    # 1 MiB half miss; two ranks time-sharing the core double the working set.
    assert out_of_l2(512 << 10, 2 << 20) == 0.0
    assert out_of_l2(1 << 20, 2 << 20) == pytest.approx(0.5)
    assert out_of_l2(512 << 10, 2 << 20, ranks_per_core=2.0) == pytest.approx(0.5)
    assert out_of_l2(1 << 20, 0.0) == 0.0
    l2_only = AlphaBeta(0.0, 0.0, 1e-9, delta_s_per_byte=1e-9, l2_s_per_byte=1e-9, l2_bytes=2 << 20)
    base = AlphaBeta(0.0, 0.0, 1e-9, delta_s_per_byte=1e-9)
    s = 2 << 20
    # 2 ranks: the ring's messages are S/2 = 1 MiB (half out of cache), recursive doubling's S (3/4 out).
    w = work("ring", 2, s)
    assert predict("ring", 2, s, l2_only) == pytest.approx(predict("ring", 2, s, base) + 0.5 * 1e-9 * (w.reduced + w.copied))
    w = work("recursive_doubling", 2, s)
    assert predict("recursive_doubling", 2, s, l2_only) == pytest.approx(
        predict("recursive_doubling", 2, s, base) + 0.75 * 1e-9 * (w.reduced + w.copied))
    assert predict("ring", 2, 1 << 20, l2_only) == predict("ring", 2, 1 << 20, base)


def test_waiting_ranks_share_the_cores_for_the_transports_busy_window() -> None:
    # 4 ranks on 2 cores: the star's root works while 3 ranks wait; for the first wait_busy_s they stay runnable.
    cpu = AlphaBeta(0.0, 0.0, 1e-9, delta_s_per_byte=1e-9)
    waits = AlphaBeta(0.0, 0.0, 1e-9, delta_s_per_byte=1e-9, wait_share=0.5, wait_busy_s=2e-3)
    node = Node(4, 2)
    for s in (1 << 16, 1 << 20, 1 << 24):
        root = predict("star", 4, s, cpu, node=node)  # all CPU: the root's work
        assert predict("star", 4, s, waits, node=node) == pytest.approx(root + 0.5 * min(root, 2e-3))
        # Every rank busy (the ring): the node's CPU is already shared, no one waits long.
        assert predict("ring", 4, s, waits, node=node) == pytest.approx(predict("ring", 4, s, cpu, node=node))
    # A core per rank: waiting costs nothing.
    assert predict("star", 4, 1 << 20, waits, node=Node(4, 4)) == pytest.approx(predict("star", 4, 1 << 20, cpu))


def test_sim_streams_a_message_to_an_idle_receiver_only() -> None:
    # An idle receiver copies out behind the sender's copy in; one busy copying its own message in does not.
    copy_only = AlphaBeta(10e-6, 0.0, 0.0, delta_s_per_byte=1e-9)
    s = 1 << 24
    assert max(simulate("star", 2, s, copy_only)) == pytest.approx(2 * 10e-6 + 3 * s * 1e-9, rel=1e-6)
    assert max(simulate("recursive_doubling", 2, s, copy_only)) == pytest.approx(10e-6 + 2 * s * 1e-9, rel=1e-6)
    assert max(simulate("ring", 2, s, copy_only)) == pytest.approx(2 * 10e-6 + 4 * (s / 2) * 1e-9, rel=1e-6)


def test_node_sharing_scales_symmetric_algorithms_not_the_star() -> None:
    cpu_only = AlphaBeta(0.0, 0.0, 1e-9, delta_s_per_byte=1e-9)
    s = 1 << 24
    for algo in ("ring", "recursive_doubling"):  # every rank busy: 4 ranks on 2 cores take twice as long
        assert predict(algo, 4, s, cpu_only, node=Node(4, 2)) == pytest.approx(2 * predict(algo, 4, s, cpu_only))
    # The star's non-roots idle while the root works: the root keeps a core.
    assert predict("star", 4, s, cpu_only, node=Node(4, 2)) == pytest.approx(predict("star", 4, s, cpu_only))
    # A node with a core per rank changes nothing but the cache it shares; extra wake-up cost only when ranks
    # outnumber cores.
    assert predict("ring", 4, s, cpu_only, node=Node(4, 4)) == pytest.approx(predict("ring", 4, s, cpu_only))
    assert predict("ring", 4, s, LOOPBACK, node=Node(4, 4)) > predict("ring", 4, s, LOOPBACK)
    assert predict("ring", 4, 4096, LOOPBACK, node=Node(4, 2)) > predict("ring", 4, 4096, LOOPBACK) + 6 * 100e-6 * 0.99


def test_fit_recovers_the_loopback_model() -> None:
    rng = np.random.default_rng(1)
    rows = []
    for n in (2, 4):
        for algo in ALGORITHMS:
            for k in range(16, 27):
                t = predict(algo, n, 1 << k, LOOPBACK, node=Node(n, 2)) * (1 + 0.01 * rng.standard_normal())
                rows.append({"algorithm": algo, "ranks": n, "size": 1 << k, "cores": 2, "time_med_us": t * 1e6})
    params = ("alpha_s", "switch_s", "gamma_s_per_byte", "delta_s_per_byte", "mem_s_per_byte", "l2_s_per_byte",
              "wait_share")
    m = fit(rows, time_key="time_med_us", params=params, cache_bytes=16 << 20, l2_bytes=2 << 20, wait_busy_s=2e-3)
    for name in params:
        assert getattr(m, name) == pytest.approx(getattr(LOOPBACK, name), rel=0.15), name
    with pytest.raises(UsageError):
        fit(rows, params=("nope",))


def test_stored_models_load() -> None:
    models = stored_models()
    assert {"shm", "tcp"} <= set(models)
    for model, cores, max_ranks in models.values():
        assert model.alpha_s > 0 and model.delta_s_per_byte > 0 and model.gamma_s_per_byte > 0
        assert model.l2_bytes > 0  # the per-core cache of the machine measured on, recorded when fitting
        assert cores is None or cores >= 1
        assert max_ranks >= 2


@pytest.mark.parametrize("transport", ["shm", "tcp", None, "mpi"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 64, 1024])
def test_auto_thresholds_are_the_model_crossovers(transport: str | None, n: int) -> None:
    models = stored_models()
    model, cores, max_ranks = models.get(transport or DEFAULT_TRANSPORT) or models[DEFAULT_TRANSPORT]
    node = Node(n, cores) if cores is not None and n <= max_ranks else None  # as measured, else a core per rank
    lo, hi = SEARCH_BYTES
    xs = crossovers(model, n, lo=lo, hi=hi, node=node)
    table = auto_thresholds(n, transport)
    assert table == ((0, best(n, lo, model, node=node)), *((at, after) for at, _, after in xs))
    for at, algo in table[1:]:  # select_allreduce switches exactly there
        assert select_allreduce(at, n, transport) == algo
        assert select_allreduce(at - 4, n, transport) != algo
    assert select_allreduce(hi * 4, n, transport) == table[-1][1]
    assert select_allreduce(1, n, transport) == table[0][1]


def test_auto_keeps_the_shape() -> None:
    # Recursive doubling or the star for small buffers, a bandwidth-optimal one (the ring's bytes) for large ones.
    for n in (2, 3, 4, 8, 64, 1024):
        assert select_allreduce(1 << 30, n) in ("ring", "halving_doubling")
        assert select_allreduce(4 << 10, n) in ("recursive_doubling", "star")
    assert select_allreduce(64, 1) in ("recursive_doubling", "star", "ring")


def test_a_transports_piece_sizes_the_cache_term_of_its_recursive_doubling_rounds() -> None:
    whole = AlphaBeta(alpha_s=1e-5, beta_s_per_byte=0.0, gamma_s_per_byte=1e-10, l2_s_per_byte=1e-10,
                      l2_bytes=512 << 10)
    piece = AlphaBeta(**{**whole.__dict__, "piece_bytes": 256 << 10})
    node = Node(2, 2)
    s = 16 << 20
    # 4 copies of a 16 MiB message miss a 512 KiB cache almost entirely; of a 256 KiB piece, half of the time
    miss_whole, miss_piece = 1 - (512 << 10) / (4 * s), 1 - (512 << 10) / (4 * (256 << 10))
    saved = predict("recursive_doubling", 2, s, whole, node=node) - predict("recursive_doubling", 2, s, piece, node=node)
    # reduced S + copied 2 S, and its message's alpha (a compiled call costs call_s, here 0)
    assert saved == pytest.approx(1e-5 + 1e-10 * 3 * s * (miss_whole - miss_piece))
    for algo, n in (("star", 4), ("recursive_doubling", 3)):  # no step there: the whole message
        assert predict(algo, n, s, piece, node=Node(n, 2)) == predict(algo, n, s, whole, node=Node(n, 2))
    # The ring's rounds run compiled in a group of any size: its 8 MiB steps count the piece, and its two
    # messages' alphas are the call's call_s
    miss_step = 1 - (512 << 10) / (4 * s / 2)
    saved = predict("ring", 2, s, whole, node=node) - predict("ring", 2, s, piece, node=node)
    assert saved == pytest.approx(2e-5 + 1e-10 * (s / 2 + 2 * s) * (miss_step - miss_piece))  # reduced S/2 + copied 2 S
    assert predict("ring", 3, s, piece, node=Node(3, 2)) < predict("ring", 3, s, whole, node=Node(3, 2))


def test_a_compiled_call_costs_call_s_once_where_messages_cost_alpha_each() -> None:
    base = AlphaBeta(alpha_s=2e-5, beta_s_per_byte=0.0, gamma_s_per_byte=1e-10, piece_bytes=1 << 20, round_s=1e-6)
    called = AlphaBeta(**{**base.__dict__, "call_s": 7e-6})
    for algo, n in (("recursive_doubling", 4), ("halving_doubling", 4), ("ring", 3)):  # compiled: one call each
        assert predict(algo, n, 1 << 16, called) - predict(algo, n, 1 << 16, base) == pytest.approx(7e-6)
    for algo, n in (("star", 4), ("recursive_doubling", 3)):  # through the queues: alpha per message, no call
        assert predict(algo, n, 1 << 16, called) == predict(algo, n, 1 << 16, base)
    assert predict("star", 4, 1 << 16, base) - predict("star", 4, 1 << 16, AlphaBeta(**{**base.__dict__, "alpha_s": 0.0})) \
        == pytest.approx(2 * 2e-5)  # the star's two messages on the critical path

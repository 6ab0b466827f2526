"""The alpha-beta-gamma cost model and the simulated transport (docs/scaling.md)."""

from __future__ import annotations

import numpy as np
import pytest

from gradcoll import kernels
from gradcoll.costmodel import ALGORITHMS, AlphaBeta, best, crossovers, fit, predict, terms
from gradcoll.errors import UsageError
from gradcoll.transport.sim import simulate

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


def test_sim_restores_the_real_kernels() -> None:
    acc = kernels.accumulate
    simulate("ring", 4, 1 << 20, MODEL)
    assert kernels.accumulate is acc
    a = np.ones(4, np.float32)
    kernels.accumulate(a, np.ones(4, np.float32))
    assert a.tolist() == [2.0] * 4


def test_sim_ring_pipelining_is_not_slower() -> None:
    # With 1 MiB segments part of the reduction hides behind the next transfer.
    seg = simulate("ring", 8, 64 << 20, MODEL, elems_per_rank=64, segment_bytes=1 << 20)
    assert max(seg) <= predict("ring", 8, 64 << 20, MODEL) * 1.02

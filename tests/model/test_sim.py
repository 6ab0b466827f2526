"""The simulated network's kernel backend (gradcoll.model.sim.SimKernels) and the old module path of the simulator."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from gradcoll import kernels
from gradcoll.model.costmodel import AlphaBeta
from gradcoll.model.sim import SimKernels, SimTransport, SimWorld

GAMMA, DELTA = 1e-9, 3e-9
MODEL = AlphaBeta(0.0, 0.0, GAMMA, delta_s_per_byte=DELTA)


def _rank(scale: float = 1.0) -> SimTransport:
    return SimTransport(SimWorld(2, MODEL, scale), 0)


def test_reductions_charge_the_calling_ranks_clock_and_compute_nothing() -> None:
    t = _rank(scale=8.0)
    assert isinstance(t.kernels, SimKernels)
    acc = np.ones(100, np.float32)
    kernels.accumulate(acc, np.full(100, 5.0, np.float32), divide_by=2, backend=t.kernels)
    assert acc.tolist() == [1.0] * 100  # not computed
    assert t.clock == pytest.approx(GAMMA * 400 * 8)  # gamma per byte of the incoming contribution, scaled
    rows = np.ones((3, 100), np.float32)
    out = np.zeros(100, np.float32)
    assert kernels.mean_reduce(rows, out=out, op="sum", backend=t.kernels) is out
    assert out.tolist() == [0.0] * 100
    # Two incoming rows reduced, the root's own row copied in: 400 * 8 bytes each.
    assert t.clock == pytest.approx(GAMMA * 3200 + GAMMA * 2 * 3200 + DELTA * 3200)
    before = t.clock
    kernels.mean_reduce([rows[0], rows[1]], out=out, backend=t.kernels)  # a list of rows costs the same per row
    assert t.clock - before == pytest.approx(GAMMA * 3200 + DELTA * 3200)
    kernels.check_finite(np.array([np.nan], np.float32), backend=t.kernels)  # no payload moved: nothing to check
    assert t.clock - before == pytest.approx(GAMMA * 3200 + DELTA * 3200)


def test_each_rank_charges_its_own_clock() -> None:
    world = SimWorld(3, MODEL)
    ranks = [SimTransport(world, r) for r in range(3)]
    kernels.accumulate(np.ones(10, np.float32), np.ones(10, np.float32), backend=ranks[1].kernels)
    assert [t.clock for t in ranks] == [0.0, pytest.approx(GAMMA * 40), 0.0]


def test_the_old_path_of_the_simulator_still_imports() -> None:
    old = importlib.import_module("gradcoll.transport.sim")
    from gradcoll.algorithms import simulate as new

    assert old is new
    from gradcoll.transport.sim import SimTransport as OldTransport
    from gradcoll.transport.sim import SimWorld as OldWorld
    from gradcoll.transport.sim import simulate

    assert OldTransport is SimTransport and OldWorld is SimWorld
    assert len(simulate("ring", 3, 1 << 20, MODEL)) == 3


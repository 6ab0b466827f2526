"""Where the direct allreduce turns from one-shot to two-shot: the window entry of the stored models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms.direct import direct_allreduce, forced_mode
from gradcoll.errors import UsageError
from gradcoll.model.costmodel import FITTED_PATH
from gradcoll.model.window_model import DEFAULT_ONE_SHOT_BYTES, WINDOW_MODEL, direct_one_shot_bytes, measured_crossovers
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world

pytestmark = pytest.mark.timeout(60)


def rows(n: int, one: list[float], two: list[float]) -> list[dict[str, Any]]:
    sizes = [4096 << k for k in range(len(one))]
    return ([{"ranks": n, "size": s, "algorithm": "direct_one_shot", "t": t} for s, t in zip(sizes, one, strict=True)]
            + [{"ranks": n, "size": s, "algorithm": "direct_two_shot", "t": t} for s, t in zip(sizes, two, strict=True)])


def test_the_crossover_is_the_last_size_of_the_prefix_where_one_shot_is_not_slower() -> None:
    got = measured_crossovers(rows(2, [10, 11, 30, 12], [10, 10.5, 20, 20])
                              + rows(4, [50, 60], [10, 10])
                              + rows(8, [1, 1, 1], [2, 2, 2]), "t")
    # 2 ranks: within 10% at 4K and 8K, 1.5x slower at 16K (the cheaper 32K after it does not count)
    assert got == {"2": 8192, "4": 4095, "8": 16384}


def test_the_stored_crossovers_decide_and_the_model_beyond_them(tmp_path: Path) -> None:
    stored = json.loads(Path(FITTED_PATH).read_text())
    entry = dict(stored["transports"].get(WINDOW_MODEL) or stored["transports"]["shm"])
    entry["one_shot_bytes"] = {"2": 12345, "4": 777}
    entry["max_ranks"] = 4
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps({"transports": {**stored["transports"], WINDOW_MODEL: entry}}))
    assert direct_one_shot_bytes(2, str(path)) == 12345
    assert direct_one_shot_bytes(3, str(path)) == 12345  # between measured world sizes: the smaller one's
    assert direct_one_shot_bytes(4, str(path)) == 777
    assert isinstance(direct_one_shot_bytes(8, str(path)), int)  # beyond: the model's crossover
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"transports": {}}))
    assert direct_one_shot_bytes(2, str(none)) == DEFAULT_ONE_SHOT_BYTES


def test_gradcoll_direct_mode_forces_a_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    n, count = 3, 1000  # one-shot by size: the variable makes it two-shot, with the same bits
    data = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(n)]
    out: dict[str, list[bytes]] = {}
    for mode in ("one-shot", "two-shot"):
        monkeypatch.setenv("GRADCOLL_DIRECT_MODE", mode)
        assert forced_mode() == mode
        ts = create_world(n, timeout=10)
        bufs = [d.copy() for d in data]
        try:
            _, errors = gather_ranks(lambda r: direct_allreduce(ts[r], bufs[r], seq=1), n)
            plans = ts[0].shared_window.cache["window-run"].plans
        finally:
            for t in ts:
                t.close()
        assert errors == [None] * n
        assert [key[5] for key in plans] == [mode == "two-shot"]  # the key's two-shot flag
        out[mode] = [b.tobytes() for b in bufs]
    assert out["one-shot"] == out["two-shot"]
    monkeypatch.setenv("GRADCOLL_DIRECT_MODE", "three-shot")
    with pytest.raises(UsageError, match="GRADCOLL_DIRECT_MODE"):
        forced_mode()

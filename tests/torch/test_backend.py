"""The torch.distributed backend "gradcoll": collectives, DDP, the comm hook, errors, timeouts.

Every test starts real ranks (``gradcoll launch``, 127.0.0.1) running
``tests/torch/torch_ranks.py`` and checks what each rank wrote against exact
values. Skipped without PyTorch: ``pip install 'gradcoll[torch]'``.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)")

from gradcoll.cli.launch import launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # each launch imports torch in every rank: slow on a busy 2-core machine

RANKS = Path(__file__).with_name("torch_ranks.py")


def run(tmp_path: Path, n: int, scenario: str, *args: str, backend: str = "tcp", ok: bool = True,
        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``n`` ranks; every rank's results (None for a rank that wrote none)."""
    out = io.StringIO()
    res = launch([sys.executable, str(RANKS), scenario, str(tmp_path), *args], n, backend=backend, out=out,
                 timeout=250, env=env)
    if ok:
        assert res.ok, out.getvalue()[-6000:]
    files = [tmp_path / f"rank{r}.json" for r in range(n)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(tmp_path_factory.mktemp("collectives"), 3, "collectives")


def _reduce(op: str, n: int) -> list[float]:
    rows = np.array([[r + 1.0, -2.0 * r, 0.25] for r in range(n)])
    return {"sum": rows.sum(0), "avg": rows.mean(0), "max": rows.max(0), "min": rows.min(0),
            "premul": 0.5 * rows.sum(0)}[op].tolist()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int64", "int32"])
def test_all_reduce_every_op_and_dtype(collectives: list[dict[str, Any]], dtype: str) -> None:
    for op in ("sum", "avg", "max", "min", "premul"):
        if dtype.startswith("int") and op in ("avg", "premul"):
            continue
        want = _reduce(op, 3)
        if dtype.startswith("int"):
            want = [math.trunc(v) for v in _reduce(op, 3)] if op in ("max", "min") else [6.0, -6.0, 0.0]
        for res in collectives:
            same_dtype, got = res[f"all_reduce/{dtype}/{op}"]
            assert same_dtype
            # float16/bfloat16 inputs are exact here; sums are accumulated in float32 and rounded once
            np.testing.assert_allclose(got, want, rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-6)


def test_async_work_and_future(collectives: list[dict[str, Any]]) -> None:
    for res in collectives:
        waited, completed, future_value, tensor = res["async"]
        assert waited is True and completed is True
        assert future_value == tensor == [3.0] * 5


def test_broadcast_gather_scatter_barrier(collectives: list[dict[str, Any]]) -> None:
    n = len(collectives)
    for rank, res in enumerate(collectives):
        assert res["broadcast"] == [float(n - 1)] * 3
        assert res["all_gather"] == [[r, 10.0 * r] for r in range(n)]
        assert res["all_gather_into_tensor"] == [v for r in range(n) for v in (r, -r)]
        assert res["reduce_scatter"] == [sum(10.0 * rank + r for r in range(n)), float(n)]
        out, src = res["reduce_scatter_tensor"]
        assert out == [2.0 * rank, 2.0 * rank + 1] and src == list(map(float, range(2 * n)))  # the input is kept


def test_subgroup_from_new_group(collectives: list[dict[str, Any]]) -> None:
    n = len(collectives)
    assert collectives[0]["subgroup"] == [float(n - 1), 2, 0]
    assert collectives[n - 1]["subgroup"] == [float(n - 1), 2, 1]
    assert all("subgroup" not in res for res in collectives[1 : n - 1])


def test_unsupported_calls_say_what_is_supported(collectives: list[dict[str, Any]]) -> None:
    for res in collectives:
        errs = res["errors"]
        assert errs["product"]["type"] == "UnsupportedError" and "SUM, AVG, MAX, MIN, PREMUL_SUM" in errs["product"]["message"]
        assert "uint32" in errs["dtype"]["message"] and "float32, float64, float16, bfloat16" in errs["dtype"]["message"]
        for call in ("gather", "send"):
            assert errs[call]["type"] == "UnsupportedError", errs[call]
            assert errs[call]["runtime"] and errs[call]["gradcoll"]
            assert "supported: all_reduce, broadcast, all_gather" in errs[call]["message"]
        assert res["after_errors"] == [3.0] * 3


def test_one_host_uses_shared_memory_and_own_group_shares_the_store(collectives: list[dict[str, Any]]) -> None:
    for res in collectives:
        assert res["transport"] == "shm"
        assert res["own_group"] == [3.0, 3.0]


@pytest.mark.parametrize("method", ["tcp", "file"])
def test_init_methods_and_transport_override(tmp_path: Path, method: str) -> None:
    # tcp://: Options(transport="tcp"); file://: GRADCOLL_BACKEND=tcp (what `gradcoll launch` sets)
    results = run(tmp_path, 2, "init_methods", method, str(tmp_path / "store"))
    for res in results:
        assert res == {"avg": [1.5] * 4, "transport": "tcp"}


def test_ddp_matches_gloo_on_the_backend_and_with_the_comm_hook(tmp_path: Path) -> None:
    results = run(tmp_path, 2, "ddp")
    for res in results:
        assert res["buckets"] > 1  # DDP's bucketing is exercised
        np.testing.assert_allclose(res["gradcoll"], res["gloo"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(res["hook"], res["gloo"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results[0]["gradcoll"], results[1]["gradcoll"])


def test_nonfinite_raises_on_every_rank_naming_rank_and_parameter(tmp_path: Path) -> None:
    results = run(tmp_path, 3, "nonfinite", "1")
    for rank, res in enumerate(results):
        direct = res["all_reduce"]
        assert direct["type"] == "NonFiniteGradientError" and direct["runtime"], direct
        assert f"rank {rank}:" in direct["message"] and "rank 1 contributed nan" in direct["message"]
        for case in ("ddp", "hook"):  # through DDP's C++ reducer: a RuntimeError carrying the message
            err = res[case]
            assert err["runtime"] and "NonFiniteGradientError" in err["message"], err
            assert f"rank {rank}: non-finite gradient" in err["message"] and "rank 1 contributed" in err["message"]
        assert "parameter a.weight[" in res["hook"]["message"], res["hook"]


@pytest.mark.parametrize("kind", ["dead", "stall"])
def test_a_failed_peer_is_named_within_the_timeout(tmp_path: Path, kind: str) -> None:
    results = run(tmp_path, 3, "peer_failure", kind, env={"FAIL_TIMEOUT": "6"})
    for rank in (0, 1):
        err = results[rank]["error"]
        assert err["runtime"] and err["gradcoll"] and f"rank {rank}:" in err["message"], err
        assert results[rank]["seconds"] < 6 + 2, results[rank]  # the timeout, plus time to report
        if kind == "dead":
            assert err["type"] == "TransportBroken" and "rank 2 died" in err["message"], err
        else:
            assert err["type"] == "CollectiveTimeout" and "rank(s) 2 stalled" in err["message"], err
    assert results[2] == (None if kind == "dead" else {"stalled": True})

"""The prepared allreduce (``gradcoll.algorithms.prepared``): one decision per call shape, refusals before a byte.

Real groups over shm and tcp, ranks as threads. Each test checks what a
user sees: the result against NumPy, the same bits on every rank, a
``UsageError`` on every rank that leaves the group usable, and the route
the call was prepared with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gradcoll import kernels as K
from gradcoll.algorithms import SCHEDULES
from gradcoll.algorithms._handshake import ALGOS
from gradcoll.errors import UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.testing import gather_ranks, threaded_group
from gradcoll.transport import shm, tcp

pytestmark = pytest.mark.timeout(120)
CREATE = {"tcp": tcp.create, "shm": shm.create}


def on_group(transport: str, n: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    groups = [ProcessGroup(t, timeout=20) for t in threaded_group(CREATE[transport], n, timeout=20)]
    try:
        results, errors = gather_ranks(lambda r: fn(groups[r]), n, join_timeout=90)
    finally:
        for g in groups:
            g.close()
    assert errors == [None] * n, errors
    return results


def usable(g: ProcessGroup) -> bool:
    x = np.full(4, g.rank, np.float32)
    g.allreduce(x, op="sum")
    return not g.poisoned and x.tolist() == [sum(range(g.size))] * 4


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_refusal_before_anything_is_sent_leaves_the_group_usable(transport: str) -> None:
    def fn(g: ProcessGroup) -> list[Any]:
        out = []
        bad: list[dict[str, Any]] = [{"algorithm": "nope"}, {"op": "prod"}, {"wire_dtype": "int8"},
                                     {"deterministic": True, "buf": np.ones(8, np.int32)}]
        if transport == "tcp":
            bad.append({"algorithm": "direct"})  # the shared window needs ranks that share memory
        else:
            bad.append({"algorithm": "direct", "wire_dtype": "bf16", "op": "max"})  # no such window form
        for kw in bad:
            buf = kw.pop("buf", np.ones(8, np.float32))
            with pytest.raises(UsageError):
                g.allreduce(buf, **kw)
            out.append(usable(g))
        return out + [g.seq]

    for res in on_group(transport, 3, fn):
        assert res == [True] * 5 + [5], res  # one sequence number per allreduce that ran, none for the refused


def test_auto_never_picks_a_schedule_that_cannot_run_the_call() -> None:
    """On one host ``auto`` is the direct allreduce, which has no wire ``max`` and no exact wire sum: such calls run
    another schedule, with the right result."""
    def fn(g: ProcessGroup) -> list[Any]:
        rng = np.random.default_rng(g.rank)
        x = rng.standard_normal(1001).astype(np.float32)
        got = []
        for kw in ({"wire_dtype": "bf16", "op": "max"}, {"wire_dtype": "fp16", "deterministic": True},
                   {"wire_dtype": "bf16", "op": "min"}):
            y = x.copy()
            g.allreduce(y, **kw)
            prep = next(p for k, p in g._prepared.items() if k[3] == "auto" and k[5] == kw["wire_dtype"]
                        and k[2] == kw.get("op", "mean") and k[6] == kw.get("deterministic", False))
            got.append((prep.algorithm, y.tobytes()))
        return got

    res = on_group("shm", 3, fn)
    assert all(r == res[0] for r in res)  # the same bits on every rank
    rounded = []
    for r in range(3):  # every contribution rounded to bf16 once
        enc = np.empty(1001, np.uint16)
        K.encode_wire(np.random.default_rng(r).standard_normal(1001).astype(np.float32), enc, wire="bf16")
        rounded.append(np.empty(1001, np.float32))
        K.decode_wire(enc, rounded[-1], wire="bf16")
    for (algo, got), want in zip(res[0][::2], (np.max(rounded, 0), np.min(rounded, 0)), strict=True):
        assert algo != "direct"
        assert np.frombuffer(got, np.float32).tobytes() == want.astype(np.float32).tobytes()
    assert res[0][1][0] != "direct"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_deterministic_gives_the_same_bits_under_every_schedule_the_group_can_run(transport: str) -> None:
    names = [a for a, s in SCHEDULES.items() if s.needs != "window" or transport == "shm"] + ["auto"]

    def fn(g: ProcessGroup) -> list[bytes]:
        x = np.random.default_rng(7 + g.rank).standard_normal(20_001).astype(np.float32) * 2.0 ** g.rank
        out = []
        for algo in names:
            for wire in (None, "bf16"):
                y = x.copy()
                if algo == "direct" and wire:  # the window has no exact wire form: refused, the group usable
                    with pytest.raises(UsageError):
                        g.allreduce(y, algorithm=algo, deterministic=True, wire_dtype=wire)
                    continue
                g.allreduce(y, algorithm=algo, deterministic=True, wire_dtype=wire)
                out.append((wire, y.tobytes()))
        return [b for w, b in out if w is None] + [b for w, b in out if w == "bf16"]

    res = on_group(transport, 4, fn)
    k = len(names)  # the exact ones, then the exact bf16 ones
    assert len({b for r in res for b in r[:k]}) == 1, "deterministic: not the same bits on every schedule and rank"
    assert len({b for r in res for b in r[k:]}) == 1, "deterministic bf16: not the same bits everywhere"


def test_each_shape_is_prepared_once_with_one_route() -> None:
    def fn(g: ProcessGroup) -> list[Any]:
        for _ in range(3):
            g.allreduce(np.ones(1000, np.float32))
            g.allreduce(np.ones(1000, np.float32), op="max")
            g.allreduce(np.ones(1000, np.float32), deterministic=True)
        return sorted((k[2], k[6], p.route) for k, p in g._prepared.items())

    for res in on_group("tcp", 4, fn):
        assert res == [("max", False, "guarded"), ("mean", False, "rounds"), ("mean", True, "guarded")], res
    for res in on_group("shm", 2, fn):
        assert res == [("max", False, "window"), ("mean", False, "window"), ("mean", True, "window")], res


def test_every_schedule_has_a_rows_form_and_a_record_code() -> None:
    for name, entry in SCHEDULES.items():
        assert name in ALGOS
        assert entry.rows is not None or entry.needs == "window", name

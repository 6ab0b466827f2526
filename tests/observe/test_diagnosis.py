"""Stall warnings, stats(), traces and ``gradcoll stragglers`` (ranks as threads over inproc)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcoll import HashStore, init_process_group
from gradcoll.cli import main
from gradcoll.group.process_group import ProcessGroup
from gradcoll.observe.stragglers import rank_stragglers
from gradcoll.observe.trace import load_events, trace_path
from gradcoll.transport.inproc import create_world


def run_ranks(size: int, fn: Callable[[ProcessGroup, int], Any], **options: Any) -> list[Any]:
    """``fn(group, rank)`` on ``size`` threads, each with a group from init_process_group (control channel)."""
    store = HashStore(timeout=20)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def target(r: int) -> None:
        try:
            g = init_process_group("inproc", rank=r, world_size=size, timeout=20, store=store, **options)
            try:
                results[r] = fn(g, r)
            finally:
                g.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


class _Watch(logging.Handler):
    """Collects gradcoll log messages; ``done`` is set once ``want`` says they suffice."""

    def __init__(self, want: Callable[[list[str]], bool]) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.want, self.done = want, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.want(self.messages):
            self.done.set()


@pytest.fixture
def watch() -> Any:
    handlers: list[_Watch] = []

    def make(want: Callable[[list[str]], bool]) -> _Watch:
        h = _Watch(want)
        logging.getLogger("gradcoll").addHandler(h)
        handlers.append(h)
        return h

    yield make
    for h in handlers:
        logging.getLogger("gradcoll").removeHandler(h)


def test_stall_warning_names_arrived_and_missing_ranks_on_every_rank(caplog: Any, watch: Any) -> None:
    caplog.set_level(logging.WARNING, logger="gradcoll")
    late = threading.Event()

    def enough(msgs: list[str]) -> bool:
        return (any(m.startswith("rank 0: ") and "has waited" in m and "arrived:" in m for m in msgs)
                and any(m.startswith("rank 1: ") and "arrived:" in m for m in msgs)
                and any(m.startswith("rank 2: ") and "for this rank" in m for m in msgs))

    w = watch(enough)

    def fn(g: ProcessGroup, r: int) -> np.ndarray:
        if r == 2:
            assert late.wait(20)  # released by the test once every rank has logged
        return g.allreduce(np.full(8, float(r), np.float32), op="sum")  # type: ignore[no-any-return]

    runner = threading.Thread(target=lambda: out.append(run_ranks(3, fn, stall_warning_s=0.3)))
    out: list[Any] = []
    runner.start()
    try:
        assert w.done.wait(20), w.messages
    finally:
        late.set()
        runner.join(60)
    assert [r.tolist() for r in out[0]] == [[3.0] * 8] * 3  # the collective kept waiting and then finished
    msgs = [r.getMessage() for r in caplog.records if r.name == "gradcoll"]
    r0 = next(m for m in msgs if m.startswith("rank 0: ") and "arrived:" in m)
    assert "allreduce (seq 0, 32 bytes) has waited" in r0
    assert "arrived: 0, 1;" in r0 and "not arrived: 2 (idle" in r0 and "still waiting" in r0
    assert "arrived: 0, 1;" in next(m for m in msgs if m.startswith("rank 1: ") and "arrived:" in m)
    r2 = next(m for m in msgs if m.startswith("rank 2: "))
    assert "has waited" in r2 and "(seq 0, 32 bytes) for this rank, which has not arrived (idle" in r2


def test_stall_warning_without_control_channel_gives_the_local_view(watch: Any) -> None:
    w = watch(lambda msgs: any("no control channel" in m for m in msgs))
    t0, t1 = create_world(2, timeout=20)
    g0, g1 = ProcessGroup(t0, stall_warning_s=0.2), ProcessGroup(t1, stall_warning_s=None)
    work = g0.barrier(async_op=True)
    try:
        assert w.done.wait(20)
        g1.barrier()
        work.wait(20)
    finally:
        g0.close()
        g1.close()
    assert any(m.startswith("rank 0: barrier (seq 0, 0 bytes) has waited") for m in w.messages)


def test_stats_count_bytes_and_recent_records() -> None:
    def fn(g: ProcessGroup, r: int) -> Any:
        for _ in range(3):
            g.allreduce(np.ones(100, np.float32), algorithm="ring")
        g.broadcast(np.zeros(10, np.float64))
        return g.stats()

    for s in run_ranks(2, fn, stall_warning_s=None):
        assert (s.count, s.bytes) == (4, 3 * 400 + 80)
        assert s.ops["allreduce"].count == 3 and s.ops["allreduce"].bytes == 1200
        assert s.ops["broadcast"].count == 1
        assert [(x.op, x.algorithm, x.seq) for x in s.recent] == [("allreduce", "ring", i) for i in range(3)] + [
            ("broadcast", "", 3)]
        for x in s.recent:
            assert x.ok and x.end >= x.start and 0.0 <= x.wait_s <= x.duration + 1e-3
        assert 0.0 <= s.wait_s <= s.total_s + 1e-3


def test_stats_window_bounds_the_recent_records() -> None:
    (t,) = create_world(1)
    with ProcessGroup(t, stats_window=2, stall_warning_s=None) as g:
        for _ in range(5):
            g.barrier()
        s = g.stats()
    assert s.count == 5 and [x.seq for x in s.recent] == [3, 4]


def test_trace_names_the_slow_rank(tmp_path: Path, capsys: Any) -> None:
    path = str(tmp_path / "run.json")
    slow = threading.Barrier(3)

    def fn(g: ProcessGroup, r: int) -> None:
        for _ in range(4):
            slow.wait(20)  # everyone leaves the step together; rank 2 then computes longer
            if r == 2:
                threading.Event().wait(0.03)  # rank 2's extra "compute" (the straggling under test)
            g.allreduce(np.ones(64, np.float32))

    run_ranks(3, fn, trace=path)
    files = [trace_path(path, r, 3) for r in range(3)]
    doc = json.loads(Path(files[1]).read_text())
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(ev) == 4 and {e["pid"] for e in ev} == {1} and ev[0]["args"]["seq"] == 0
    rows, summary = rank_stragglers(load_events(files))
    assert summary["collectives"] == 4 and rows[0].rank == 2 and rows[0].last == 4
    assert rows[0].caused_wait_s > 0.04  # two ranks waited ~30 ms for it, four times
    merged = str(tmp_path / "merged.json")
    assert main(["stragglers", *files, "--merge", merged]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:2] == ["2", "4/4"]
    assert main(["stragglers", merged, "--top", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_start_and_stop_trace(tmp_path: Path) -> None:
    (t,) = create_world(1)
    with ProcessGroup(t, stall_warning_s=None) as g:
        g.barrier()
        g.start_trace()
        g.barrier()
        written = g.stop_trace(str(tmp_path / "t.json"))
        g.barrier()
    assert written == str(tmp_path / "t.json")
    ev = [e for e in load_events([written]) if e["ph"] == "X"]
    assert [e["args"]["seq"] for e in ev] == [1]

"""Host layout and subgroups: who shares a host, split() / new_group(), and their guarantees on real transports."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import gradcoll
from gradcoll import GroupPoisoned, HashStore, NonFiniteError, UsageError, init_process_group
from gradcoll.group import NonMember, ProcessGroup
from gradcoll.group.topology import HOST_VAR, local_host
from gradcoll.transport.inproc import create_world
from tests.helpers import spawn_ranks


def threads(size: int, fn: Callable[[ProcessGroup], Any], backend: str = "inproc", timeout: float = 60.0) -> list[Any]:
    """``fn(group)`` on ``size`` threads, each with a group from ``init_process_group`` over one HashStore."""
    store = HashStore(timeout=30)
    out: dict[int, Any] = {}

    def target(r: int) -> None:
        g = None
        try:
            g = init_process_group(backend, rank=r, world_size=size, timeout=10, store=store, stall_warning_s=None)
            out[r] = fn(g)
        except BaseException as exc:  # noqa: BLE001 - raised below
            out[r] = exc
        finally:
            if g is not None:
                g.close()

    ts = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert all(not t.is_alive() for t in ts), "a rank hung"
    for r in range(size):
        if isinstance(out[r], BaseException):
            raise AssertionError(f"rank {r} failed: {type(out[r]).__name__}: {out[r]}") from out[r]
    return [out[r] for r in range(size)]


# -- host layout ------------------------------------------------------------------------------------------------
def test_local_host_is_the_variable_or_the_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_VAR, "node-7")
    assert local_host() == "node-7"
    monkeypatch.setenv(HOST_VAR, " ")
    assert local_host() == __import__("socket").gethostname()


def test_a_group_on_one_host_knows_it_and_takes_a_layout() -> None:
    t = create_world(4)
    g = ProcessGroup(t[0], stall_warning_s=None)
    assert g.hosts == (local_host(),) * 4 and g.host_ranks == (0, 1, 2, 3) and g.stats().hosts == g.hosts
    h = ProcessGroup(t[1], hosts=["a", "b", "a", "b"], stall_warning_s=None)
    assert h.host == "b" and h.host_ranks == (1, 3) and h.host_layout() == [[0, 2], [1, 3]]
    assert h.stats().host_ranks == (1, 3)
    with pytest.raises(UsageError, match="hosts names 3 ranks"):
        ProcessGroup(t[2], hosts=["a", "b", "c"])
    g.close()
    h.close()


# -- split over threads -------------------------------------------------------------------------------------------
def test_split_gives_members_a_group_of_their_own_and_others_a_clear_error() -> None:
    def fn(g: ProcessGroup) -> Any:
        g.allreduce(np.ones(8, np.float32))  # the parent's sequence moves on; the child's starts at 0
        sub = g.split([3, 1])
        if g.rank in (0, 2):
            assert isinstance(sub, NonMember) and sub.ranks == (3, 1)
            with pytest.raises(UsageError, match=r"rank \d of the parent group is not a member .* parent ranks \[3, 1\]"):
                sub.allreduce(np.ones(3, np.float32))
            with pytest.raises(UsageError, match="may call barrier"):
                sub.barrier()
            return None
        assert isinstance(sub, ProcessGroup) and sub.size == 2 and sub.rank == [3, 1].index(g.rank) and sub.seq == 0
        x = np.full(5, g.rank, np.float64)
        sub.allreduce(x, op="sum")
        b = np.full(3, float(g.rank), np.float32)
        sub.broadcast(b, root=0)  # sub rank 0 is parent rank 3
        gathered = sub.allgather(np.array([g.rank], np.int64))
        rs = sub.reduce_scatter(np.arange(4, dtype=np.float32) * (g.rank + 1), op="sum")
        sub.barrier()
        out = (x.tolist(), b.tolist(), gathered.ravel().tolist(), rs.tolist(), sub.seq, g.seq)
        sub.close()
        return out

    res = threads(4, fn)
    for r in (1, 3):
        x, b, gathered, rs, sub_seq, parent_seq = res[r]
        assert x == [4.0] * 5 and b == [3.0] * 3 and gathered == [3, 1] and sub_seq == 5
        assert rs == ([0.0, 6.0] if r == 3 else [12.0, 18.0])  # chunk k of (x*4 + x*2) lands on sub rank k
        assert parent_seq > 1  # the split's own rounds are the parent's collectives
    assert gradcoll.new_group is not None


def test_split_called_with_different_ranks_fails_on_every_rank() -> None:
    def fn(g: ProcessGroup) -> str:
        with pytest.raises(UsageError, match=r"rank\(s\) \[2\] called split with other ranks"):
            g.split([0, 1] if g.rank != 2 else [0, 2])
        with pytest.raises(UsageError, match="listed twice"):
            g.split([0, 0])
        g.allreduce(np.ones(4, np.float32))  # nothing was poisoned
        return "ok"

    assert threads(3, fn) == ["ok"] * 3


def test_failures_stay_in_their_own_group() -> None:
    def fn(g: ProcessGroup) -> Any:
        sub = gradcoll.new_group(g, [0, 1, 2])
        assert isinstance(sub, ProcessGroup)
        bad = np.ones(16, np.float32)
        if g.rank == 1:
            bad[3] = np.nan
        with pytest.raises(NonFiniteError):
            sub.allreduce(bad)
        assert sub.poisoned and not g.poisoned
        x = np.ones(16, np.float32)
        g.allreduce(x, op="sum")  # the parent is untouched
        with pytest.raises(GroupPoisoned):
            sub.allreduce(np.ones(4, np.float32))
        with pytest.raises(NonFiniteError):
            g.allreduce(bad)  # and the other way round: a fresh subgroup of a poisoned parent is not possible,
        sub.close()  # but one built before keeps working
        return x[0]

    assert threads(3, fn) == [3.0] * 3


def test_parent_and_child_run_at_the_same_time_from_two_threads() -> None:
    def fn(g: ProcessGroup) -> Any:
        sub = g.split([0, 1, 2, 3])
        assert isinstance(sub, ProcessGroup)
        errors: list[BaseException] = []

        def child() -> None:
            try:
                for i in range(40):
                    y = np.full(3000, g.rank + i, np.float64)
                    sub.allreduce(y, op="sum", algorithm="ring")
                    assert (y == 6 + 4 * i).all()
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        t = threading.Thread(target=child)
        t.start()
        for i in range(40):
            x = np.full(2000, 2 * g.rank - i, np.float64)
            g.allreduce(x, op="sum", algorithm="recursive_doubling")
            assert (x == 12 - 4 * i).all()
        t.join(30)
        sub.close()
        assert not errors, errors
        return True

    assert threads(4, fn, backend="tcp") == [True] * 4


# -- over processes: the layout, the trace and the two-level allreduce -------------------------------------------
def _two_hosts(store: Any, rank: int, size: int, trace_dir: str) -> Any:
    from gradcoll.transport import tcp, tcp_rounds

    os.environ[HOST_VAR] = "hostA" if rank < size // 2 else "hostB"
    rounds: list[int] = []  # what each compiled call of rounds did (the leaders' step between the hosts)
    real = tcp_rounds.exchange_plan

    def spy(*a: Any, **k: Any) -> int:
        rounds.append(int(real(*a, **k)))
        return rounds[-1]

    tcp_rounds.exchange_plan = spy  # type: ignore[assignment]
    g = init_process_group("tcp", store=store, rank=rank, world_size=size, timeout=20, stall_warning_s=None,
                           trace=os.path.join(trace_dir, "run.json"))
    out: dict[str, Any] = {"hosts": g.hosts, "host_ranks": g.host_ranks, "stats_hosts": g.stats().hosts}
    x = np.arange(100_003, dtype=np.float64) * (rank + 1)
    g.allreduce(x, op="sum", algorithm="two_level")
    out["two_level"] = bool(np.array_equal(x, np.arange(100_003, dtype=np.float64) * (size * (size + 1) // 2)))
    out["routed"] = g._routed.name if g._routed is not None else None
    # the 4 ranks share one machine whatever hosts GRADCOLL_HOST names: the shm links inside a "host" count them
    out["crowd"] = (g._crowd, getattr(getattr(g._routed, "local", None), "crowd", None))
    y = np.full(1000, float(rank), np.float32)
    g.allreduce(y, algorithm="two_level")  # mean, now over the links built by the first call
    out["mean"] = float(y[0])
    host = g.split_by_host(backend="shm")
    z = np.ones(10, np.float32)
    host.allreduce(z, op="sum")
    out["host_group"] = (host.size, host.transport.name, float(z[0]), host.hosts)
    out["host_group_crowd"] = (host._crowd, host.transport.crowd)
    host.close()
    out["ops"] = [r.algorithm for r in g.stats().recent if r.op == "allreduce"]
    out["rounds"] = list(rounds)
    bad = np.ones(5000, np.float32)
    if rank == 3:
        bad[4444] = np.inf
    try:
        g.allreduce(bad, algorithm="two_level")
    except NonFiniteError as exc:
        out["bad"] = (exc.contributor, exc.index)
    out["compiled"] = tcp._IO is not None
    g.close()
    return out


def test_two_hosts_of_two_ranks_over_tcp(tmp_path: Any) -> None:
    res = spawn_ranks(_two_hosts, 4, str(tmp_path), timeout=90)
    layout = ("hostA", "hostA", "hostB", "hostB")
    for r, out in enumerate(res):
        assert out["hosts"] == layout == out["stats_hosts"]
        assert out["host_ranks"] == ((0, 1) if r < 2 else (2, 3))
        assert out["two_level"] and out["mean"] == 1.5
        assert out["routed"] == "tcp+shm"
        assert out["crowd"] == (4, 4) and out["host_group_crowd"] == (4, 4), out
        assert out["host_group"] == (2, "shm", 2.0, ("hostA",) * 2 if r < 2 else ("hostB",) * 2)
        assert out["ops"] == ["two_level", "two_level"]
        assert out["bad"] == (3, 4444)
        if out["compiled"]:  # the leaders' step ran its rounds in one compiled call (1: recursive doubling, 2: ring)
            assert (out["rounds"] and set(out["rounds"]) <= {1, 2}) if r in (0, 2) else out["rounds"] == [], out
    doc = json.loads((tmp_path / "run.rank2.json").read_text())
    assert doc["otherData"]["gradcoll"]["hosts"] == list(layout)
    assert any(e.get("args", {}).get("name") == "rank 2 @ hostB" for e in doc["traceEvents"])


def _two_hosts_one_dies(store: Any, rank: int, size: int, victim: int) -> Any:
    import time

    from gradcoll.algorithms import two_level

    os.environ[HOST_VAR] = "hostA" if rank < size // 2 else "hostB"
    g = init_process_group("tcp", store=store, rank=rank, world_size=size, timeout=5, stall_warning_s=None)
    x = np.full(3 << 18, float(rank), np.float32)  # 3 MiB: three pieces through the host's window
    g.allreduce(x, algorithm="two_level")
    assert float(x[0]) == 1.5 and g._routed is not None and g._routed.name == "tcp+shm"
    if rank == victim:  # dies as its second call starts: its peers are inside the collective, waiting for it
        up, down = two_level.INTRA["window"]

        def die(*a: Any) -> None:
            os._exit(1)

        two_level.INTRA["window"] = (die, down)
    t0 = time.monotonic()
    try:
        g.allreduce(x, algorithm="two_level")
    except gradcoll.GradcollError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("victim", [1, 2])  # a member (its leader waits on the window), a leader (step 2, step 3)
def test_a_rank_killed_inside_the_window_steps_is_named_on_every_survivor(victim: int) -> None:
    res = spawn_ranks(_two_hosts_one_dies, 4, victim, timeout=90, dead=[victim])
    for r, out in enumerate(res):
        if r == victim:
            continue
        kind, text, took = out
        assert kind == "TransportBroken" and f"rank {victim} died during two-level allreduce" in text, (r, out)
        assert took < 5 + 3, (r, out)  # within the call's timeout and the error path's grace

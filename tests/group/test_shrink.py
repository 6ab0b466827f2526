"""ProcessGroup.shrink(): one of 4 ranks dies mid-training, the other 3 agree and finish with equal parameters."""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import threading
from typing import Any

import numpy as np
import pytest

from gradcoll import HashStore, ShrinkFailed, UsageError, init_process_group
from gradcoll.errors import GradcollError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.transport.inproc import create_world

STEPS, DIE_AT = 8, 3


def _grad(rank: int, step: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 * rank + step).standard_normal(n).astype(np.float32)


def train(g: ProcessGroup, n: int, die: Any = None) -> tuple[np.ndarray, list[int]]:
    """SGD on a toy objective; on a failure shrink, re-sync from the new rank 0 and redo the step."""
    params = np.zeros(n, np.float32)
    old_rank, history, step = g.rank, [g.size], 0
    while step < STEPS:
        if die is not None and step == DIE_AT:
            die(g)
            return params, history
        grad = _grad(old_rank, step, n)
        try:
            g.allreduce(grad)
        except GradcollError:
            g = g.shrink(timeout=15)
            history.append(g.size)
            # The failed step may have completed on some survivors and not on others:
            # take parameters and step from the new rank 0.
            state = np.array([step], np.float64)
            g.broadcast(state)
            g.broadcast(params)
            step = int(state[0])
            continue
        params -= 0.1 * grad
        step += 1
    g.close()
    return params, history


def test_shrink_over_inproc_threads() -> None:
    store, size, n = HashStore(timeout=30), 4, 1000
    results: dict[int, Any] = {}

    def target(r: int) -> None:
        try:
            g = init_process_group("inproc", rank=r, world_size=size, timeout=5, store=store)
            results[r] = train(g, n, die=(lambda g: g.close()) if r == 3 else None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[r] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    survivors = [results[r] for r in range(3)]
    for res in survivors:
        assert not isinstance(res, BaseException), res
    assert all(h == [4, 3] for _, h in survivors)
    for params, _ in survivors[1:]:
        np.testing.assert_array_equal(params, survivors[0][0])
    # The survivors' training matches a 3-rank run of the remaining steps.
    assert np.isfinite(survivors[0][0]).all() and survivors[0][0].any()


def _proc_rank(rank: int, size: int, path: str, backend: str, where: str, out: Any) -> None:
    from gradcoll.store import FileStore

    store = FileStore(path, timeout=30)
    g = init_process_group(backend, rank=rank, world_size=size, timeout=3, store=store, stall_warning_s=None)
    store.close()
    n = 1 << 20  # 4 MiB of float32: long enough to die inside it (halving-doubling on 4 tcp ranks, or the ring)

    def die(g: ProcessGroup) -> None:
        if where == "between":
            os._exit(1)
        # Exit at this rank's 3rd transport call of the allreduce below: past the reduce-scatter, so the peers
        # are inside the collective with it (4 ranks make 4 calls in halving-doubling, at least 12 in the
        # ring), or at the one call of tcp's compiled rounds (a tcp_rounds.Runner: every round of the allreduce),
        # where the peers are inside it too. A timer could miss a collective that finishes first.
        calls = [0]

        def hooked(fn: Any, whole: bool) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3 or whole:
                    with open(path + ".died", "w") as f:  # tells the parent whether it died inside the collective
                        f.write("inside" if g._diag.rec.current is not None else "outside")
                    os._exit(1)
                return fn(*a, **k)
            return call

        for name in ("isend", "irecv", "sendrecv", "exchange_reduce"):
            if hasattr(g.transport, name):
                setattr(g.transport, name, hooked(getattr(g.transport, name), False))
        if hasattr(g.transport, "plan_runner"):  # tcp's rounds in one compiled call: die as it starts
            from gradcoll.transport import tcp_rounds

            tcp_rounds.Runner.__call__ = hooked(tcp_rounds.Runner.__call__, True)  # type: ignore[method-assign]
        g.allreduce(_grad(rank, DIE_AT, n))
        threading.Event().wait(30)

    try:
        params, history = train(g, n, die=die if rank == size - 1 else None)
        out.put((rank, "ok", params.tobytes(), history))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", []))


@pytest.mark.parametrize(("backend", "where"), [("tcp", "between"), ("tcp", "inside"), ("shm", "between")])
def test_shrink_over_processes_one_of_four_dies(backend: str, where: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradcoll-shrink-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_proc_rank, args=(r, 4, path, backend, where, out), daemon=True) for r in range(4)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        try:
            while len(got) < 3:
                rank, status, value, history = out.get(timeout=90)
                assert status == "ok", f"rank {rank}: {value}"
                got[rank] = (value, history)
        except queue.Empty:
            raise AssertionError(f"ranks {sorted({0, 1, 2} - set(got))} gave no result") from None
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
        if where == "inside":
            with open(path + ".died") as f:
                assert f.read() == "inside"
    assert sorted(got) == [0, 1, 2]
    assert all(h == [4, 3] for _, h in got.values())
    assert got[0][0] == got[1][0] == got[2][0]


def test_shrink_needs_a_control_channel() -> None:
    (t,) = create_world(1)
    with ProcessGroup(t) as g, pytest.raises(UsageError, match="control channel"):
        g.shrink()


def test_shrink_of_a_single_rank() -> None:
    g = init_process_group("inproc", rank=0, world_size=1, store=HashStore(), timeout=5)
    g2 = g.shrink(timeout=2)
    try:
        assert (g2.rank, g2.size) == (0, 1)
        assert g2.allreduce(np.ones(3, np.float32)).tolist() == [1.0, 1.0, 1.0]
    finally:
        g2.close()


def test_a_live_rank_that_joins_too_late_is_left_out_and_told_so() -> None:
    store, done = HashStore(timeout=30), threading.Event()
    results: dict[int, Any] = {}

    def target(r: int) -> None:
        g = init_process_group("inproc", rank=r, world_size=3, timeout=5, store=store, stall_warning_s=None)
        try:
            if r == 2:  # alive (its monitor answers pings) but calls shrink() only after the others decided
                assert done.wait(30)
            g2 = g.shrink(timeout=2.0)
            results[r] = (g2.rank, g2.size, g2.allreduce(np.full(2, r + 1.0, np.float32), op="sum").tolist())
            g2.close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            results[r] = exc
        finally:
            if r < 2 and len([k for k in results if k < 2]) == 2:
                done.set()
            g.close()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0] == (0, 2, [3.0, 3.0]) and results[1] == (1, 2, [3.0, 3.0])
    assert isinstance(results[2], ShrinkFailed) and "left out" in str(results[2])

"""The window conformance checks: one per-rank program per promise of ``Window`` (``gradcoll.transport.base``).

Every transport whose ``shared_memory`` is True passes them. Each check is
``program(window, ctx)`` on a window every rank of the group just mapped
(``WINDOW_BYTES`` a slot); ``run_window_check`` runs one with ranks as
threads, ``check_window`` all of them and, given the transport's ``create``,
the dead-peer check on a real process that gets SIGKILLed (which also checks
that nothing is left in ``/dev/shm``). ``run_spmd`` runs them with this
process as one rank (under ``mpirun``).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CollectiveTimeout, TransportBroken, TransportClosed, UsageError
from ..store import FileStore
from ..transport.base import Transport, Window
from ..transport.window import PROBE_S, WindowAlarm
from .checks import Check, Ctx, _raises
from .runners import run_ranks

__all__ = ["WINDOW_CHECKS", "WINDOW_BYTES", "run_window_check", "check_window", "dead_window_peer", "run_window_spmd",
           "no_window"]

WINDOW_BYTES = 1 << 20
WINDOW_CHECKS: dict[str, Check] = {}


def _check(size: int) -> Callable[[Callable[[Window, Ctx], None]], Check]:
    def register(fn: Callable[[Window, Ctx], None]) -> Check:
        check = Check(fn.__name__.lstrip("_"), size, fn)  # type: ignore[arg-type]
        WINDOW_CHECKS[check.name] = check
        return check
    return register


def _others(w: Window) -> list[int]:
    return [r for r in range(w.size) if r != w.rank]


@_check(0)
def _layout(w: Window, ctx: Ctx) -> None:
    """Every rank sees every slot, of ``slot_bytes``, 64-byte aligned and apart, and writable only by its owner."""
    assert w.slot_bytes >= WINDOW_BYTES and w.slot_bytes % 64 == 0
    slots = [w.slot(r) for r in range(w.size)]
    addrs = sorted(s.ctypes.data for s in slots)
    assert all(a % 64 == 0 for a in addrs), f"slot addresses {addrs} are not 64-byte aligned"
    assert all(b - a >= w.slot_bytes for a, b in zip(addrs, addrs[1:], strict=False)), "slots overlap"
    assert all(s.nbytes == w.slot_bytes for s in slots)
    assert w.layout().rank == w.rank and w.layout().size == w.size
    assert w.state(w.rank) == "open"


@_check(0)
def _publish_then_read(w: Window, ctx: Ctx) -> None:
    """What a rank stored before ``publish`` is what every other rank reads after ``wait`` (many rounds)."""
    me, n = w.rank, w.size
    words = w.slot_bytes // 4
    for i in range(1, 31):
        mine = w.slot(me).view(np.uint32)
        mine[:] = np.uint32(i * 1000 + me)
        w.publish(0, i)
        w.wait(range(n), 0, i, 10)
        for r in _others(w):
            got = w.slot(r).view(np.uint32)
            assert got[0] == got[words - 1] == i * 1000 + r, f"round {i}: rank {r}'s slot reads {got[0]}, {got[-1]}"
        w.publish(1, i)  # nobody writes its slot again before every rank has read it
        w.wait(range(n), 1, i, 10)
    assert w.counter(me, 0) == 30 and all(w.counter(r, 1) == 30 for r in range(n))


@_check(0)
def _descriptors(w: Window, ctx: Ctx) -> None:
    """Each rank's ring of descriptors reads back everywhere, entry k mod DESCRIPTORS."""
    me = w.rank
    for k in range(w.DESCRIPTORS + 2):
        w.describe(k, bytes([me, k]) * 32)
    w.publish(2, 1)
    w.wait(range(w.size), 2, 1, 10)
    for r in range(w.size):
        for k in range(w.DESCRIPTORS):
            want = bytes([r, k + w.DESCRIPTORS if k < 2 else k]) * 32
            assert w.descriptor(r, k) == want, f"rank {r} descriptor {k}"
    w.report(me)[:] = me + 1
    w.publish(2, 2)
    w.wait(range(w.size), 2, 2, 10)
    assert all(int(w.report(r)[63]) == r + 1 for r in range(w.size))


@_check(0)
def _timeout_names_the_late(w: Window, ctx: Ctx) -> None:
    """A wait that runs out names exactly the ranks whose counter did not get there; the rest may be ahead."""
    me, n = w.rank, w.size
    if me != n - 1:
        w.publish(3, 5)
    if me == 0:
        start = time.monotonic()
        exc = _raises(CollectiveTimeout, lambda: w.wait(range(n), 3, 5, 0.3), rank=0, within=5)
        assert exc.missing == [n - 1], f"missing {exc.missing}, not [{n - 1}]"
        assert time.monotonic() - start >= 0.3
    ctx.barrier()
    w.wait([me], 3, 99, 0.0)  # a rank never waits for itself


@_check(0)
def _waiting_takes_no_core(w: Window, ctx: Ctx) -> None:
    """A rank that waits half a second sleeps in the kernel: it uses little of a core meanwhile."""
    me, n = w.rank, w.size
    if me == 0:
        cpu = time.thread_time()
        w.wait(range(n), 4, 1, 10)
        used = time.thread_time() - cpu
        assert used < 0.25, f"waiting 0.5 s used {used:.3f} s of CPU"
    else:
        time.sleep(0.5)  # the thing being waited for: this rank is late on purpose
        w.publish(4, 1)
    ctx.barrier()


@_check(0)
def _peer_closes(w: Window, ctx: Ctx) -> None:
    """A rank that closes its window before getting there: every waiter gets TransportClosed naming it, at once."""
    me, n = w.rank, w.size
    if me == n - 1:
        ctx.barrier()
        w.close()
        assert w.closed
        w.close()  # idempotent
        return
    ctx.barrier()
    _raises(TransportClosed, lambda: w.wait([n - 1], 5, 1, 10), rank=me, peer=n - 1, within=5)
    assert w.state(n - 1) == "closed"


@_check(0)
def _alarm_wakes_every_waiter(w: Window, ctx: Ctx) -> None:
    """An alarm fails every rank's waits on anyone, with the raiser's record, and it sticks."""
    me = w.rank
    record = bytes([0xA5]) * 64
    if me == 0:
        ctx.barrier()
        time.sleep(0.1)  # let the others fall asleep first: the alarm must wake sleepers
        w.alarm(record)
        assert w.alarm_record(0) == record and w.state(0) == "alarm"
        return
    ctx.barrier()
    waited_on = [r for r in _others(w) if r != 0] or [0]  # a rank other than the raiser, where there is one
    exc = _raises(WindowAlarm, lambda: w.wait(waited_on, 6, 1, 10), rank=me, peer=0, within=5)
    assert exc.record == record
    _raises(WindowAlarm, lambda: w.wait(waited_on, 6, 1, 10), rank=me, peer=0, within=1)


@_check(0)
def _own_close_stops_own_waits(w: Window, ctx: Ctx) -> None:
    """Closing a rank's own window from another thread ends its wait (TransportClosed naming itself)."""
    me = w.rank
    if me == 0:
        threading.Timer(0.2, w.close).start()
        _raises(TransportClosed, lambda: w.wait(_others(w), 6, 1, 10), rank=0, within=5)


def _wait(barrier: threading.Barrier) -> None:
    barrier.wait()


def run_window_check(name: str, make_group: Callable[[int], Sequence[Transport]], *, size: int = 3,
                     timeout: float = 60.0) -> None:
    """Run one window check with ranks as threads over ``make_group(size)``."""
    check = WINDOW_CHECKS[name]
    n = check.size or size
    group = list(make_group(n))
    barrier = threading.Barrier(n, timeout=timeout)

    def abort() -> None:
        barrier.abort()
        for t in group:
            t.close()

    try:
        wins = run_ranks([lambda t: t.window(WINDOW_BYTES, 30)] * n, group, timeout=timeout, on_error=abort)
        assert all(isinstance(w, Window) for w in wins), f"{group[0].name}: window() gave {wins}"
        ctx = Ctx(lambda: _wait(barrier))
        run_ranks([lambda w: check.program(w, ctx)] * n, wins, timeout=timeout, on_error=abort)
    finally:
        for t in group:
            t.close()


# -- a rank that is SIGKILLed while others wait for it ---------------------------------------------
def _victim(create: Callable[..., Transport], path: str, options: dict[str, Any]) -> None:
    t = create(FileStore(path, timeout=30), 1, 2, timeout=30, **options)
    w = t.window(WINDOW_BYTES, 30)
    assert w is not None
    w.publish(0, 1)
    threading.Event().wait(60)  # idle until killed


def dead_window_peer(create: Callable[..., Transport], options: dict[str, Any] | None = None,
                     shm_dir: str = "/dev/shm") -> None:
    """Kill the peer's process: the waiter gets TransportBroken naming it within ``PROBE_S`` and a second;
    no segment of either process is left in ``shm_dir``; a new group right after starts cleanly."""
    with tempfile.TemporaryDirectory(prefix="gradcoll-window-") as tmp:
        path = os.path.join(tmp, "store")
        store = FileStore(path, timeout=30)
        proc = multiprocessing.get_context("spawn").Process(target=_victim, args=(create, path, options or {}),
                                                            daemon=True)
        proc.start()
        try:
            t = create(store, 0, 2, timeout=30, **(options or {}))
            try:
                w = t.window(WINDOW_BYTES, 30)
                assert w is not None
                w.wait([1], 0, 1, 30)
                proc.kill()  # not reaped yet: detection must not rely on the parent waiting
                _raises(TransportBroken, lambda: w.wait([1], 0, 2, 15), rank=0, peer=1, within=PROBE_S + 1.0)
                assert w.state(1) == "dead"
            finally:
                t.close()
        finally:
            proc.kill()
            proc.join(10)
            store.close()
        if os.path.isdir(shm_dir):
            left = [f for f in os.listdir(shm_dir) if f.startswith(f"gcshm-{os.getpid()}-")
                    or (proc.pid is not None and f.startswith(f"gcshm-{proc.pid}-"))]
            assert not left, f"segments left behind: {left}"


def check_window(make_group: Callable[[int], Sequence[Transport]], *, create: Callable[..., Transport] | None = None,
                 options: dict[str, Any] | None = None, size: int = 3) -> None:
    """Run every window check (and, given ``create=``, the dead-peer one); raise on the first failure."""
    for name in WINDOW_CHECKS:
        run_window_check(name, make_group, size=size)
    if create is not None:
        dead_window_peer(create, options)


def run_window_spmd(make_transport: Callable[[], Transport], barrier: Callable[[], None]) -> list[str]:
    """Run the window checks with this process as one rank (e.g. under ``mpirun``); return the names run."""
    ran = []
    for name, check in WINDOW_CHECKS.items():
        t = make_transport()
        try:
            w = t.window(WINDOW_BYTES, 30)
            assert w is not None, f"{t.name}: no window although shared_memory is {t.shared_memory}"
            check.program(w, Ctx(barrier))  # type: ignore[arg-type]  # window checks take the window
            ran.append(name)
        finally:
            barrier()
            t.close()
    return ran


def no_window(t: Transport) -> None:
    """For transports whose ranks share no memory: ``window`` is None and ``shared_memory`` False."""
    if t.shared_memory:
        raise UsageError(f"{t.name} says its ranks share memory")
    assert t.window(WINDOW_BYTES) is None and t.group_window() is None

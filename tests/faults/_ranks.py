"""Rank bodies of the collective fault tests; they run in forkserver children (see :mod:`._harness`).

A rank bootstraps through a FileStore, runs ``warm`` checked allreduces, then
plays its part in the fault: the victim dies (SIGKILL from the parent while it
waits on its pipe, or by its own hand after ``kill_after`` transport calls
inside a collective) or stalls (blocks on its pipe until the parent releases
it); every survivor keeps calling allreduce until one raises. Each rank
reports over its pipe (``Connection.send`` is synchronous, so a report sent
just before a SIGKILL still arrives). Times are ``time.monotonic()``, which
is one clock for every process of the host.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SIZES = (1, 7, 100, 70_001, 1000, 4099)  # elements; mixed, odd splits; call 3 (the first faulty one) pipelines
#: The buffer sizes of the fault matrix (float64 elements): 4 KiB, and 64 MiB (a ring of 1 MiB segments, a
#: star and a butterfly of whole buffers, still in flight when the fault strikes).
BUFFERS = {"mixed": SIZES, "4KiB": (512,), "64MiB": (8 << 20,)}


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def expected_sum(n: int, size: int, i: int) -> np.ndarray:
    """The allreduce(sum) result of :func:`contribution` over ``size`` ranks, exactly."""
    return np.arange(n, dtype=np.float64) * (size * (size + 1) // 2) + size * i


def contribution(n: int, rank: int, i: int) -> np.ndarray:
    """Rank ``rank``'s input of call ``i``: small integers, so float64 sums are exact in any order."""
    return np.arange(n, dtype=np.float64) * (rank + 1) + i


def _arm_self_kill(transport: Any, after: int, conn: Any, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` (SIGKILL, or SIGSTOP) to this process at the ``after``-th transport call from now."""
    calls = [0]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == after:
                conn.send(("killed", transport.rank, time.monotonic()))
                os.kill(os.getpid(), sig)
            return fn(*a, **k)
        return hooked

    # the last one: tcp's compiled small-message step
    for name in ("isend", "irecv", "sendrecv", "exchange_reduce"):
        if hasattr(transport, name):
            setattr(transport, name, wrap(getattr(transport, name)))
    if hasattr(transport, "plan_runner"):  # tcp's rounds in one call (every plan's: the group's prepared calls too)
        from gradcoll.transport import tcp_rounds

        tcp_rounds.Runner.__call__ = wrap(tcp_rounds.Runner.__call__)  # type: ignore[method-assign]
    win = getattr(transport, "shared_window", None)
    if win is not None:  # the direct allreduce: no transport call inside a collective, so die between two pieces
        from gradcoll.algorithms import _window_run

        _window_run.BATCH_BYTES = 1
        runner = win.cache.get("window-run")
        if hasattr(runner, "batch_bytes"):
            runner.batch_bytes = 1  # back to Python after every piece, where the wait accounting is hooked
        note = transport.note_wait

        def between_pieces(seconds: float) -> None:
            conn.send(("killed", transport.rank, time.monotonic()))
            os.kill(os.getpid(), sig)
            note(seconds)

        transport.note_wait = between_pieces


def rank_main(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """One rank of a fault scenario; everything it learns goes to the parent over ``conn``."""
    from gradcoll.errors import GroupPoisoned
    from gradcoll.group.rendezvous import init_process_group

    size, victim, fault, algo = cfg["size"], cfg["victim"], cfg["fault"], cfg["algorithm"]
    fds0 = fd_count()
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "fds0": fds0, "verified": 0, "wrong": 0}
    try:
        g = init_process_group(cfg["transport"], f"file://{cfg['store']}", rank, size, timeout=cfg["boot_timeout"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("boot-failed", rank, f"{type(e).__name__}: {e}"))
        return
    g.timeout = cfg["timeout"]
    i = 0

    sizes = BUFFERS[cfg.get("buffer", "mixed")]

    t_call = [0.0]

    def one() -> None:
        nonlocal i
        n = sizes[i % len(sizes)]
        buf = contribution(n, rank, i)
        t_call[0] = time.monotonic()  # the collective's own time starts here, not with building its input
        g.allreduce(buf, op="sum", algorithm=algo)
        if np.array_equal(buf, expected_sum(n, size, i)):
            report["verified"] += 1
        else:
            report["wrong"] += 1
        i += 1

    for _ in range(cfg["warm"]):
        one()
    report["fds_warm"] = fd_count()
    if rank == victim and fault in ("kill", "stall"):
        conn.send(("ready", rank, time.monotonic()))
        conn.recv()  # "kill": never returns (SIGKILL); "stall": returns when the parent releases us
        g.close()
        conn.send(("released", rank, time.monotonic()))
        return
    if rank == victim and fault in ("kill-mid", "stop-mid"):
        _arm_self_kill(g.transport, cfg["kill_after"], conn, signal.SIGKILL if fault == "kill-mid" else signal.SIGSTOP)
    conn.send(("entering", rank, time.monotonic()))
    for _ in range(cfg["after"]):
        try:
            one()
        except BaseException as e:  # noqa: BLE001 - the point of the exercise
            report.update(t_call=t_call[0], t_exc=time.monotonic(), exc=type(e).__name__, msg=str(e),
                          peer=getattr(e, "peer", None), missing=getattr(e, "missing", None),
                          seq=g.seq - 1, poisoned=False)
            log = cfg.get("trace_dir")
            if log:  # the whole chain, for a failure's post-mortem
                import traceback

                with open(os.path.join(log, f"rank{rank}.txt"), "w") as f:
                    f.write("".join(traceback.format_exception(e)))
            try:
                g.allreduce(np.zeros(3), algorithm=algo)
            except GroupPoisoned:
                report["poisoned"] = True
            except BaseException as e2:  # noqa: BLE001
                report["after_poison"] = f"{type(e2).__name__}: {e2}"
            break
    g.close()
    report["fds1"] = fd_count()
    conn.send(("result", rank, report))


def rss_bytes() -> int:
    """Private resident memory of this process (RssAnon).

    Total RSS also counts the shm transport's rings (2 x 8 MiB per peer,
    mapped in full at start-up): shared memory, not a leak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


SOAK_SIZES = (1, 3, 16, 100, 257, 1000, 4096, 65_536)  # mostly small; one in eight is 256 KiB of float32


def soak_main(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """``cfg["iters"]`` checked allreduces of mixed sizes and algorithms; reports RSS and fds at start and end."""
    from gradcoll.group.rendezvous import init_process_group

    size = cfg["size"]
    g = init_process_group(cfg["transport"], f"file://{cfg['store']}", rank, size, timeout=60.0)
    g.timeout = 30.0
    algos = ("auto", "ring", "star", "recursive_doubling")
    bufs = {n: np.empty(n, np.float32) for n in SOAK_SIZES}
    wrong = 0

    def one(i: int) -> None:
        nonlocal wrong
        n = SOAK_SIZES[i % len(SOAK_SIZES)]
        buf = bufs[n]
        buf[:] = (rank + 1) + (i % 7)  # small integers: the float32 sum is exact
        g.allreduce(buf, op="sum", algorithm=algos[(i // len(SOAK_SIZES)) % len(algos)])
        if not (buf == size * (size + 1) // 2 + size * (i % 7)).all():
            wrong += 1

    warm = cfg["warm"]
    for i in range(warm):  # every size x algorithm once: workspaces and caches reach their steady size
        one(i)
    start = (rss_bytes(), fd_count(), time.monotonic())
    for i in range(warm, warm + cfg["iters"]):
        one(i)
    end = (rss_bytes(), fd_count(), time.monotonic())
    g.close()
    conn.send({"rank": rank, "rss0": start[0], "rss1": end[0], "fds0": start[1], "fds1": end[1],
               "seconds": end[2] - start[2], "wrong": wrong, "calls": cfg["iters"]})

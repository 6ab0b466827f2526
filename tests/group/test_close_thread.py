"""close() from another thread while this rank is inside an allreduce: TransportClosed on every rank, tcp and shm.

Two ranks as real processes through init_process_group (so the group has
its control channel): rank 0 closes its group from a second thread at its
third transport call inside a 64 MiB ring allreduce (over tcp, while
the compiled call of all the steps starts or runs: the close wakes it, it
hands its frames to the engine, and the engine fails them). Over tcp the
halving-doubling's compiled call is closed the same way. Rank 1 must name rank
0 as the rank that closed its group, never report a reset or a broken link.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)


def _rank(path: str, r: int, backend: str, out: Any, algo: str = "ring") -> None:
    from gradcoll.group.rendezvous import init_process_group

    g = init_process_group(backend, f"file://{path}", r, 2, timeout=20, startup_timeout=15)
    g.allreduce(np.ones(10))
    if r == 0:
        calls, isend = [0], g.transport.isend

        def hooked(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:  # inside the collective: another thread closes the group, and returns
                t = threading.Thread(target=g.close)
                t.start()
                t.join(10)
            return isend(*a, **k)

        g.transport.isend = hooked  # type: ignore[method-assign]
        if hasattr(g.transport, "plan_runner"):  # tcp runs the steps in one compiled call: close while it starts or runs
            from gradcoll.algorithms import _witness
            from gradcoll.transport import tcp_rounds

            plan, note, told = tcp_rounds.Runner.__call__, _witness.note_closing, threading.Event()

            def noted(t: Any) -> None:
                note(t)
                told.set()

            _witness.note_closing = noted  # type: ignore[assignment]

            def planned(*a: Any, **k: Any) -> Any:
                t = threading.Thread(target=g.close)
                t.start()
                # the close has told the peer (which may drop its link now) and is on its way to the transport: a
                # call that could finish all its frames before the close lands would return, not fail
                told.wait(10)
                try:
                    return plan(*a, **k)
                finally:
                    t.join(10)

            tcp_rounds.Runner.__call__ = planned  # type: ignore[method-assign]
    try:
        g.allreduce(np.ones(8 << 20), algorithm=algo)
        out.put((r, "returned", ""))
    except Exception as exc:  # noqa: BLE001 - shipped to the parent
        out.put((r, type(exc).__name__, str(exc)))
    g.close()


@pytest.mark.scenario("close() from another thread during an allreduce", raised="TransportClosed")
@pytest.mark.parametrize("backend,algo", [("tcp", "ring"), ("shm", "ring"), ("tcp", "halving_doubling")])
def test_close_from_another_thread_is_transport_closed_on_both(backend: str, algo: str) -> None:
    ctx = multiprocessing.get_context("forkserver")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradcoll-close-") as tmp:
        procs = [ctx.Process(target=_rank, args=(os.path.join(tmp, "s"), r, backend, out, algo)) for r in range(2)]
        for p in procs:
            p.start()
        got = {r: (cls, msg) for r, cls, msg in (out.get(timeout=60) for _ in range(2))}
        for p in procs:
            p.join(10)
    assert got[0][0] == "TransportClosed" and "this rank's transport was closed" in got[0][1], got
    assert got[1][0] == "TransportClosed", got
    name = algo.replace("_", "-")
    assert f"rank 1: rank 0 closed its process group during {name} allreduce (seq 1)" in got[1][1], got

"""Shared windows: every transport that shares memory passes the window checks (``gradcoll.testing``).

Ranks are threads for the behavioural checks; the dead-peer check kills a
real peer process (and checks that nothing is left in ``/dev/shm``). MPI
runs the same checks under ``mpirun`` when Open MPI and mpi4py are here.
Transports whose ranks share no memory (tcp) have no window.
"""

from __future__ import annotations

import importlib

import pytest

from gradcoll import testing
from gradcoll.testing.window_checks import dead_window_peer, no_window
from gradcoll.transport import inproc, shm, tcp, window
from tests.helpers import mpi_reports, mpi_skip_reason, run_mpi

GROUPS = {
    "shm": lambda n: testing.threaded_group(shm.create, n, timeout=30, ring_bytes=1 << 16),
    "inproc": lambda n: inproc.create_world(n, timeout=30),
}

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("check", list(testing.WINDOW_CHECKS))
@pytest.mark.parametrize("transport", list(GROUPS))
@pytest.mark.parametrize("size", [2, 3])
def test_window_check(transport: str, check: str, size: int) -> None:
    testing.run_window_check(check, GROUPS[transport], size=size)


def test_shm_window_of_a_killed_peer() -> None:
    dead_window_peer(shm.create, {"ring_bytes": 1 << 16})


def test_tcp_has_no_window() -> None:
    ts = testing.threaded_group(tcp.create, 2, timeout=30)
    try:
        for t in ts:
            no_window(t)
    finally:
        for t in ts:
            t.close()


def test_one_rank_window() -> None:
    t = inproc.create_world(1)[0]
    w = t.window(1 << 10)
    assert w is not None and w.size == 1 and w.slot(0).nbytes >= 1 << 10
    w.publish(0, 3)
    w.wait([0], 0, 99, 0.0)
    t.close()
    assert w.closed


def test_compiled_protocol_has_the_same_layout() -> None:
    try:
        compiled = importlib.import_module("gradcoll.transport._window_c")
    except ImportError:
        pytest.skip("the extension gradcoll.transport._window_c is not built (make install builds it)")
    assert compiled.LAYOUT == window.LAYOUT


def test_python_protocol_interoperates(monkeypatch) -> None:
    """The fallback waits and publishes (no extension) keep every promise too."""
    monkeypatch.setattr(window, "_compiled", lambda: None)
    for check in ("publish_then_read", "timeout_names_the_late", "peer_closes", "alarm_wakes_every_waiter",
                  "waiting_takes_no_core"):
        testing.run_window_check(check, GROUPS["shm"], size=3)


@pytest.mark.mpi
def test_mpi_window_checks() -> None:
    reason = mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    proc = run_mpi("window", n=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = mpi_reports(proc.stdout, "window checks")
    assert sorted(reports) == ["0", "1"], proc.stdout
    assert all(set(testing.WINDOW_CHECKS) <= set(names) for names in reports.values()), proc.stdout

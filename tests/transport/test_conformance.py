"""Every transport passes the same suite: :func:`gradcoll.testing.check_transport`.

Ranks are threads of this process for the behavioural checks; the dead-peer
checks kill a real peer process. ``shm`` runs with a 64 KiB ring so that
large messages stream through many wrap-arounds. MPI runs the same checks
under ``mpirun`` (one rank per process) when Open MPI and mpi4py are here
(``test_mpi.py``).
"""

from __future__ import annotations

import importlib

import pytest

from gradcoll import testing
from gradcoll.transport import shm, tcp

SHM_OPTIONS = {"ring_bytes": 1 << 16}


def _inproc_group(n: int) -> list:
    return importlib.import_module("gradcoll.transport.inproc").create_world(n, timeout=30)


GROUPS = {
    "tcp": lambda n: testing.threaded_group(tcp.create, n, timeout=30),
    "shm": lambda n: testing.threaded_group(shm.create, n, timeout=30, **SHM_OPTIONS),
    "inproc": _inproc_group,
}


def _has_inproc() -> bool:
    try:
        return hasattr(importlib.import_module("gradcoll.transport.inproc"), "create_world")
    except ImportError:
        return False


@pytest.mark.parametrize("check", list(testing.CHECKS))
@pytest.mark.parametrize("transport", list(GROUPS))
def test_check(transport: str, check: str) -> None:
    if transport == "inproc" and not _has_inproc():
        pytest.skip("gradcoll.transport.inproc is not there")
    testing.run_check(check, GROUPS[transport], size=3, timeout=30)


@pytest.mark.parametrize("check", testing.PROCESS_CHECKS)
@pytest.mark.parametrize("transport, create, options", [("tcp", tcp.create, {}), ("shm", shm.create, SHM_OPTIONS)])
def test_dead_peer(transport: str, create, options: dict, check: str) -> None:
    testing.run_check(check, create=create, options=options, large=8 << 20)

"""MPI transport: the optional dependency is reported clearly; MPI-only behaviour runs under mpirun.

The shared conformance checks run under ``mpirun`` from
``test_conformance.py``; here: the missing-mpi4py message, tag range,
rank/communicator agreement and 64 MiB full-duplex exchange on 2 ranks.
"""

from __future__ import annotations

import sys

import pytest

from gradcoll.errors import BackendUnavailable
from gradcoll.transport import mpi
from tests.helpers import MPI_HINT, mpi_skip_reason, run_mpi


def test_missing_mpi4py_raises_backend_unavailable(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes "from mpi4py import MPI" fail
    with pytest.raises(BackendUnavailable, match=r"pip install gradcoll\[mpi\]") as info:
        mpi.create(None, 0, 1)
    assert "Open MPI" in str(info.value)


def test_import_is_lazy() -> None:
    assert "MPI" not in vars(mpi)  # importing gradcoll.transport.mpi never initialises MPI


@pytest.mark.mpi
def test_mpi_specifics_on_two_ranks() -> None:
    reason = mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    proc = run_mpi("specifics", n=2, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(ln for ln in proc.stdout.splitlines() if "OK" in ln) == ["rank 0 OK specifics", "rank 1 OK specifics"]


def test_skip_message_names_the_install() -> None:
    assert "pip install gradcoll[mpi]" in MPI_HINT and "Open MPI" in MPI_HINT

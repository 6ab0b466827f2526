"""MPI transport: the optional dependency is reported clearly; MPI-only behaviour runs under mpirun.

The shared conformance checks (``gradcoll.testing.run_spmd``) and the
MPI-only ones (tag range, rank/communicator agreement, 64 MiB full-duplex
exchange) run on 2 ranks under ``mpirun``; without MPI, the missing-mpi4py
message.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from gradcoll.errors import BackendUnavailable
from gradcoll.transport import mpi
from tests.helpers import MPI_HINT, mpi_reports, mpi_skip_reason, run_mpi


def test_missing_mpi4py_raises_backend_unavailable(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes "from mpi4py import MPI" fail
    with pytest.raises(BackendUnavailable, match=r"pip install gradcoll\[mpi\]") as info:
        mpi.create(None, 0, 1)
    assert "Open MPI" in str(info.value)


def test_import_is_lazy() -> None:
    assert "MPI" not in vars(mpi)  # importing gradcoll.transport.mpi never initialises MPI


def _mpirun(scenario: str, n: int = 2) -> str:
    """Run ``scenario`` of tests/helpers.py on ``n`` MPI ranks (skip without MPI); return its output."""
    reason = mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    proc = run_mpi(scenario, n=n, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.mpi
def test_mpi_specifics_on_two_ranks() -> None:
    out = _mpirun("specifics")
    assert sorted(re.findall(r"rank \d OK specifics", out)) == ["rank 0 OK specifics", "rank 1 OK specifics"], out


@pytest.mark.mpi
def test_mpi_conformance() -> None:
    out = _mpirun("conformance")
    reports = mpi_reports(out, "checks")
    assert sorted(reports) == ["0", "1"], out
    ran = reports["0"]
    assert {"ordering_and_tags", "sendrecv_duplex", "tag_mismatch", "timeouts", "peer_closes",
            "cancel_unstarted_recv", "cancel_finished", "note_wait"} <= set(ran)


@pytest.mark.mpi
def test_every_allreduce_over_links_gives_exact_sums_and_names_a_bad_input_over_mpi() -> None:
    # Four ranks: halving-doubling's two rounds, recursive doubling's two, the handshake before each call.
    reports = mpi_reports(_mpirun("allreduce", n=4), "algorithms")
    assert sorted(reports) == ["0", "1", "2", "3"], reports
    assert all(v == ["ring", "star", "recursive_doubling", "halving_doubling"] for v in reports.values()), reports


def test_skip_message_names_the_install() -> None:
    assert "pip install gradcoll[mpi]" in MPI_HINT and "Open MPI" in MPI_HINT


def test_reports_are_read_in_linear_time_whatever_follows_them() -> None:
    """mpirun's stream: lines run into each other, and a terminal escape may end one (this took minutes)."""
    names = "ring star recursive_doubling halving_doubling"
    out = (f"rank 3 OK 4 algorithms: {names}\n\x1b[0mrank 1 OK 4 algorithms: {names}rank 2 OK 4 algorithms: "
           f"{names}\x1b[0m\nrank 0 OK 4 algorithms: {names} \x1b[0m\n") * 50
    t0 = time.monotonic()
    reports = mpi_reports(out, "algorithms")
    assert time.monotonic() - t0 < 1.0
    assert reports == {r: names.split() for r in "0123"}

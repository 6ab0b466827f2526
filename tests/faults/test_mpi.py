"""A rank killed inside a collective over the ``mpi`` transport, under mpirun (4 ranks).

MPI decides what a dead rank means, not gradcoll: Open MPI's mpirun tears the
whole job down as soon as one rank dies, so survivors are killed before their
own timeout could fire. What is checked: mpirun ends (no hang) within the
collective timeout plus a grace, reports failure, and no survivor ever
returned a wrong result. See docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.faults.conftest import FULL, REPEATS
from tests.helpers import mpi_skip_reason

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60 + 40 * REPEATS)]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_rank.py")
ALGORITHMS = ("ring", "star", "recursive_doubling", "halving_doubling") if FULL else ("ring",)
GRACE = 10.0


@pytest.mark.skipif(mpi_skip_reason() is not None, reason=str(mpi_skip_reason()))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_mpirun_ends_the_job_when_a_rank_dies(algorithm, fault_log):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable, SCRIPT, algorithm]
    env = dict(os.environ, OMPI_MCA_btl_base_warn_component_unused="0", OMPI_MCA_rmaps_base_oversubscribe="1")
    for _ in range(REPEATS):
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        t_end = time.monotonic()
        events = [ln.split(" ", 4) for ln in res.stdout.splitlines() if ln.startswith("EVENT ")]
        kills = [float(e[3]) for e in events if e[2] == "kill"]
        assert kills, res.stdout + res.stderr
        detection = t_end - kills[0]
        raised = [e[4] for e in events if e[2] == "raised"]
        wrong = [e for e in events if e[2] == "WRONG"]
        fault_log(area="mpi", transport="mpi", algorithm=algorithm, fault="kill-mid", victim=2, timeout=2.0,
                  detection=[detection], errors=["job aborted by mpirun"] + sorted({r.split(":")[0] for r in raised}),
                  verified=sum(1 for e in events if e[2] == "ok"), wrong=len(wrong), hung=[], leaked_segments=[],
                  problems=[], wall=t_end - t0)
        assert res.returncode != 0
        assert not wrong
        assert detection < 2.0 + GRACE
        assert re.search(r"rank 2 .*(exited on signal 9|Killed)", res.stdout + res.stderr, re.S)

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
import sys
import time

import pytest

from tests.faults.conftest import FULL, REPEATS
from tests.helpers import mpi_skip_reason, run_mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60 + 40 * REPEATS)]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_rank.py")
ALGORITHMS = ("ring", "star", "recursive_doubling", "halving_doubling") if FULL else ("ring",)
GRACE = 10.0
# mpirun forwards each rank's output on its own, so one rank's line can land in
# the middle of another's: events are found anywhere, not only at a line start.
EVENT_RE = re.compile(r"EVENT (\d+) (\w+) (\d+\.\d+) (.*?)(?=EVENT \d+ \w+ \d|$)", re.M)


def parse_events(out: str) -> list[list[str]]:
    return [["EVENT", m.group(1), m.group(2), m.group(3), m.group(4)] for m in EVENT_RE.finditer(out)]


def test_events_are_found_when_lines_interleave():
    out = "EVENT 3 ok 1.5 call 2EVENT 2 kill 1.75 -\nEVENT 0 raised 2.0 GradcollError: rank 2: x\n"
    assert [(e[1], e[2], e[3], e[4]) for e in parse_events(out)] == [
        ("3", "ok", "1.5", "call 2"), ("2", "kill", "1.75", "-"), ("0", "raised", "2.0", "GradcollError: rank 2: x")]


@pytest.mark.skipif(mpi_skip_reason() is not None, reason=str(mpi_skip_reason()))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_mpirun_ends_the_job_when_a_rank_dies(algorithm, fault_log):
    for _ in range(REPEATS):
        t0 = time.monotonic()
        res = run_mpirun([sys.executable, SCRIPT, algorithm], 4, timeout=60)
        t_end = time.monotonic()
        events = parse_events(res.stdout)
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

"""A rank killed (SIGKILL) or stalled during a collective, at 4 ranks, for every transport and algorithm.

Real processes on 127.0.0.1 (see :mod:`._harness`). The contract checked by
:func:`._harness.problems`: after a kill every survivor raises within its
timeout plus one second, naming the dead rank, the operation and the
sequence number; after a stall every survivor raises CollectiveTimeout
listing the stalled rank; no rank hangs; every collective that completed
returned the exact sum; the group is poisoned afterwards; no file
descriptor and (shm) no shared-memory segment outlives the group. ``mpi``
is covered by test_mpi.py: under mpirun a dead rank ends the whole job.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tests.faults._harness import problems, run_collective_fault
from tests.faults.conftest import FULL, REPEATS

TRANSPORTS = ("tcp", "shm")
ALGORITHMS = ("ring", "star", "recursive_doubling", "direct")
SHARED = {"direct"}  # algorithms that need ranks sharing memory (the shm transport's window)
FAULTS = ("kill", "kill-mid", "stall")
TIMEOUT = {"kill": 2.0, "kill-mid": 2.0, "stall": 1.0}

if FULL:
    CASES = [(t, a, f, v) for t, a, f in itertools.product(TRANSPORTS, ALGORITHMS, FAULTS) for v in (0, 2, 3)
             if t == "shm" or a not in SHARED]
else:  # every transport, algorithm and fault at least once, in 6 scenarios
    CASES = [("tcp", "ring", "kill-mid", 2), ("shm", "star", "kill", 0), ("shm", "recursive_doubling", "kill-mid", 3),
             ("tcp", "star", "stall", 1), ("shm", "direct", "kill-mid", 1), ("shm", "direct", "stall", 3)]

pytestmark = pytest.mark.timeout(60 + 20 * REPEATS)


@pytest.mark.parametrize("transport,algorithm,fault,victim", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_survivors_raise_in_time_and_name_the_culprit(transport, algorithm, fault, victim, fault_log):
    failures = []
    for rep in range(REPEATS):
        t0 = time.monotonic()
        out = run_collective_fault(transport, algorithm, fault, victim=victim, timeout=TIMEOUT[fault])
        bad = problems(out)
        fault_log(area="collective", transport=transport, algorithm=algorithm, fault=fault, victim=victim,
                  timeout=out.timeout, detection=[out.detection(r) for r in out.survivors],
                  errors=sorted({out.reports.get(r, {}).get("exc", "none") for r in out.survivors}),
                  verified=sum(out.reports.get(r, {}).get("verified", 0) for r in out.survivors),
                  wrong=sum(out.reports.get(r, {}).get("wrong", 0) for r in out.survivors),
                  hung=out.hung, leaked_segments=out.leaked_segments, problems=bad,
                  wall=time.monotonic() - t0)
        failures += [f"repeat {rep}: {b}" for b in bad]
    assert not failures, "\n".join(failures)

"""A rank killed (SIGKILL) or stalled (never calls, or SIGSTOP mid-call) during a collective, at 4 ranks.

Real processes on 127.0.0.1 (see :mod:`._harness`), for tcp and shm, ring,
star, recursive doubling and auto, 4 KiB and 64 MiB buffers. The contract
checked by :func:`._harness.problems`: every survivor raises within its
timeout plus one second, and every survivor raises the same class naming
the root cause, not the neighbour that noticed it: after a kill
TransportBroken "rank V died during <op> (seq N), seen by rank W", after a
stall CollectiveTimeout(missing=[V]) "rank(s) V stalled in <op> (seq N)",
the same op and seq on every survivor; no rank hangs; every collective that completed
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
ALGORITHMS = ("ring", "star", "recursive_doubling", "halving_doubling", "direct", "auto")
SHARED = {"direct"}  # algorithms that need ranks sharing memory (the shm transport's window)
FAULTS = ("kill", "kill-mid", "stall", "stop-mid")
BUFFERS = ("4KiB", "64MiB")
#: Each call's timeout, by fault and buffer: a 64 MiB allreduce at 4 ranks must fit in it on a loaded machine.
TIMEOUT = {"kill": 2.0, "kill-mid": 2.0, "stall": 1.0, "stop-mid": 1.0}
BIG_TIMEOUT = 5.0

if FULL:  # every rank in turn, killed and stalled, for every transport, algorithm and buffer size
    CASES = [(t, a, f, v, b) for t, a, f, b in itertools.product(TRANSPORTS, ALGORITHMS, FAULTS, BUFFERS)
             for v in range(4) if t == "shm" or a not in SHARED]
else:  # every transport, algorithm, fault and buffer at least once, in 9 scenarios
    CASES = [("tcp", "ring", "kill-mid", 2, "mixed"), ("shm", "star", "kill", 0, "4KiB"),
             ("shm", "recursive_doubling", "kill-mid", 3, "mixed"), ("tcp", "star", "stall", 1, "mixed"),
             ("tcp", "auto", "stop-mid", 3, "4KiB"), ("shm", "auto", "kill-mid", 1, "64MiB"),
             ("shm", "direct", "kill-mid", 1, "mixed"), ("shm", "direct", "stall", 3, "4KiB"),
             ("shm", "direct", "stop-mid", 2, "64MiB")]

pytestmark = pytest.mark.timeout(60 + 20 * REPEATS)


@pytest.mark.parametrize("transport,algorithm,fault,victim,buffer", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_survivors_raise_in_time_and_name_the_culprit(transport, algorithm, fault, victim, buffer, fault_log):
    failures = []
    for rep in range(REPEATS):
        t0 = time.monotonic()
        timeout = BIG_TIMEOUT if buffer == "64MiB" else TIMEOUT[fault]
        out = run_collective_fault(transport, algorithm, fault, victim=victim, timeout=timeout, buffer=buffer)
        bad = problems(out)
        fault_log(area="collective", transport=transport, algorithm=algorithm, fault=fault, victim=victim, buffer=buffer,
                  timeout=out.timeout, detection=[out.detection(r) for r in out.survivors],
                  errors=sorted({out.reports.get(r, {}).get("exc", "none") for r in out.survivors}),
                  verified=sum(out.reports.get(r, {}).get("verified", 0) for r in out.survivors),
                  wrong=sum(out.reports.get(r, {}).get("wrong", 0) for r in out.survivors),
                  hung=out.hung, leaked_segments=out.leaked_segments, problems=bad,
                  root_named=not any("root cause" in b or "gave " in b or "name different" in b for b in bad),
                  wall=time.monotonic() - t0)
        failures += [f"repeat {rep}: {b}" for b in bad]
    assert not failures, "\n".join(failures)

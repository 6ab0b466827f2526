"""The coordinator under faults, every peer a real process on 127.0.0.1 (see :mod:`._coord`).

While a step runs (3 workers, ``timeout_s`` 1 s): a worker SIGKILLed
mid-step, one that never sends, a wrong step, a wrong length, a NaN, a
half-written frame (then silence, or then a close), an oversized frame and
random bytes from a joined worker. The coordinator must raise within
``timeout_s`` + 1 s naming the culprit, tell both other workers (naming it
too) and refuse further calls (poisoned).

While it waits for workers (2 expected): random bytes from a stranger, a
connection that opens and idles, and, with a secret configured, a worker
without it, one with the wrong one and a forged MAC. The coordinator must
refuse the stranger (close on it) and still admit and serve both legitimate
workers: their step's average is exact.
"""

from __future__ import annotations

import time

import pytest

from tests.faults._coord import JOIN_FAULTS, STEP_FAULTS, coord_problems, run_coord_fault
from tests.faults.conftest import FULL, REPEATS

TIMEOUT = 1.0
CASES = list(STEP_FAULTS + JOIN_FAULTS) if FULL else ["kill", "half-frame-close", "garbage", "stranger-random",
                                                       "forged-mac"]

pytestmark = pytest.mark.timeout(60 + 15 * REPEATS)


@pytest.mark.parametrize("fault", CASES)
def test_coordinator_names_the_culprit_and_serves_the_rest(fault, fault_log):
    failures = []
    for rep in range(REPEATS):
        t0 = time.monotonic()
        out = run_coord_fault(fault, TIMEOUT)
        bad = coord_problems(out, TIMEOUT)
        fault_log(area="coordinator", fault=fault, timeout=TIMEOUT, detection=[out.detection()],
                  errors=[type(out.server_exc).__name__ if out.server_exc else "none (served)"],
                  verified=2 if out.result is not None else 0, wrong=0, hung=out.hung, leaked_segments=[],
                  problems=bad, wall=time.monotonic() - t0)
        failures += [f"repeat {rep}: {b}" for b in bad]
    assert not failures, "\n".join(failures)

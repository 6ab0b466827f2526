"""A process group is driven by one thread at a time: a second thread entering a collective gets UsageError.

Serialising the two threads' calls would not help: their order would differ
between ranks and the results would pair up wrongly. Real tcp links on
127.0.0.1, two ranks as threads, each with two threads calling.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gradcoll.errors import UsageError
from gradcoll.group import ProcessGroup
from gradcoll.testing import gather_ranks, threaded_group
from gradcoll.transport import tcp

pytestmark = pytest.mark.timeout(60)


@pytest.mark.scenario("second thread enters a collective", raised="UsageError")
def test_a_second_thread_is_refused_and_nothing_is_lost() -> None:
    groups = [ProcessGroup(t) for t in threaded_group(tcp.create, 2, timeout=10)]
    inside = [threading.Event() for _ in range(2)]
    release = [threading.Event() for _ in range(2)]

    def rank(r: int) -> tuple[str, float]:
        g = groups[r]
        buf = np.full(1000, r + 1.0)
        if r == 0:  # rank 0 enters its allreduce and waits there, inside the collective, for rank 1
            t = threading.Thread(target=lambda: g.allreduce(buf, op="sum"))
            t.start()
            inside[0].set()
            release[1].wait(10)
            t.join(10)
            return "", float(buf[0])
        inside[0].wait(10)
        other = groups[0]
        while other._exec.seq == 0:  # rank 0's first thread has taken its seq: it is inside (or queued)
            threading.Event().wait(0.001)
        with pytest.raises(UsageError, match="driven by one thread at a time") as info:
            other.allreduce(np.zeros(4), op="sum")
        release[1].set()
        g.allreduce(buf, op="sum")
        return str(info.value), float(buf[0])

    results, errors = gather_ranks(rank, 2)
    assert errors == [None, None]
    assert results[0][1] == results[1][1] == 3.0  # the refused call took no seq and lost nothing
    assert "rank 0: " in results[1][0]
    for g in groups:
        assert g.seq == 1
        g.close()

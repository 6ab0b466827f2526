"""Every allreduce algorithm and collective over the real tcp and shm transports.

The algorithm suite (test_algorithms.py) runs on the in-process transport;
here the same collectives run over tcp and shm: ranks as threads of this
process for the sweep over world sizes and counts, and real processes
started by ``gradcoll launch`` for an end-to-end check.
"""

from __future__ import annotations

import io
import sys
import textwrap

import numpy as np
import pytest

from gradcoll import ProcessGroup
from gradcoll.algorithms import ALLREDUCE
from gradcoll.cli.launch import launch
from gradcoll.testing import run_ranks, threaded_group
from gradcoll.transport import shm, tcp

pytestmark = pytest.mark.timeout(120)

CREATE = {"tcp": tcp.create, "shm": shm.create}
ALGOS = sorted(ALLREDUCE)
SHARED = {"direct"}  # needs ranks that share memory (shm)


def algos(transport: str) -> list[str]:
    """The allreduce algorithms that run over ``transport``."""
    return [a for a in ALGOS if transport == "shm" or a not in SHARED]


def ref_sum(data: list[np.ndarray]) -> np.ndarray:
    acc = data[0].copy()
    for d in data[1:]:
        acc = acc + d
    return acc


@pytest.fixture(scope="module", params=sorted(CREATE))
def worlds(request):
    """Per transport: a cache of groups by world size, closed at the end."""
    made: dict[int, list[ProcessGroup]] = {}

    def get(n: int) -> list[ProcessGroup]:
        if n not in made:
            opts = {"ring_bytes": 1 << 16} if request.param == "shm" else {}
            made[n] = [ProcessGroup(t, timeout=20) for t in threaded_group(CREATE[request.param], n, timeout=20, **opts)]
        return made[n]

    get.name = request.param  # type: ignore[attr-defined]
    yield get
    for groups in made.values():
        for g in groups:
            g.close()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_allreduce_every_algorithm_and_count(worlds, n):
    groups = worlds(n)
    rng = np.random.default_rng(n)
    for algo in algos(worlds.name):
        for count in sorted({0, 1, max(n - 1, 0), n + 1, 1000, 100_003}):
            # Small integers: sums are exact in any order, so the reference is exact too.
            data = [rng.integers(-50, 50, count).astype(np.float32) for _ in range(n)]
            bufs = [d.copy() for d in data]
            run_ranks([lambda b, g=g: g.allreduce(b, op="sum", algorithm=algo) for g in groups], bufs, timeout=60)
            want = ref_sum(data)
            for b in bufs:
                assert np.array_equal(b, want), (worlds.name, algo, n, count)
            bufs = [d.copy() for d in data]
            run_ranks([lambda b, g=g: g.allreduce(b, op="mean", algorithm=algo) for g in groups], bufs, timeout=60)
            assert all(b.tobytes() == bufs[0].tobytes() for b in bufs), "mean differs between ranks"
            np.testing.assert_allclose(bufs[0], want / np.float32(n), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_other_collectives(worlds, n):
    groups = worlds(n)
    m = 1001
    bufs = [np.full(m, r + 1, np.float32) for r in range(n)]
    outs = run_ranks([lambda b, g=g: g.allgather(b) for g in groups], bufs, timeout=30)
    for o in outs:
        assert np.array_equal(np.asarray(o), np.stack([np.full(m, r + 1, np.float32) for r in range(n)]))
    for root in range(n):
        bufs = [np.full(m, r, np.float64) for r in range(n)]
        run_ranks([lambda b, g=g: g.broadcast(b, root=root) for g in groups], bufs, timeout=30)
        assert all(np.all(b == root) for b in bufs)
    run_ranks([lambda _, g=g: g.barrier() for g in groups], [None] * n, timeout=30)


BODY = """
import numpy as np, gradcoll
g = gradcoll.init_process_group(timeout=30)
r, n = g.rank, g.size
for algo in {algos!r}:
    for count in (0, 1, n + 1, 70_000):
        b = np.full(count, r + 1, np.float32)
        g.allreduce(b, op="sum", algorithm=algo)
        assert np.all(b == n * (n + 1) / 2), (algo, count, b[:4])
x = g.allgather(np.array([r], np.float64))
assert np.asarray(x).ravel().tolist() == list(range(n))
g.barrier()
print("ok", r)
g.close()
"""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_real_processes(tmp_path, backend):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(BODY.format(algos=algos(backend))))
    out = io.StringIO()
    res = launch([sys.executable, str(script)], 3, backend=backend, out=out, timeout=90)
    assert res.ok, out.getvalue()
    assert sorted(line for line in out.getvalue().splitlines() if " ok " in line) == [f"[{r}] ok {r}" for r in range(3)]

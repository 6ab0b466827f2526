"""ProcessGroup on framework buffers: torch CPU tensors, buffer objects, and device arrays (CUDA simulator)."""

from __future__ import annotations

import numpy as np
import pytest

import gradcoll
from gradcoll import ProcessGroup
from gradcoll.testing import run_ranks
from gradcoll.transport.inproc import create_world

pytestmark = pytest.mark.timeout(120)


def groups(n: int) -> list[ProcessGroup]:
    return [ProcessGroup(t, timeout=20) for t in create_world(n, timeout=20)]


def test_torch_tensors_in_place():
    torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]'")
    gs = groups(3)
    ts = [torch.full((4, 5), float(r)) for r in range(3)]
    run_ranks([lambda t, g=g: g.allreduce(t) for g in gs], ts, timeout=30)
    assert all(torch.equal(t, torch.full((4, 5), 1.0)) for t in ts)
    with pytest.raises(ValueError, match="not contiguous"):
        gs[0].allreduce(torch.zeros(4, 4).t())
    for g in gs:
        g.close()


def test_unsupported_objects_are_refused():
    g = groups(1)[0]
    with pytest.raises(TypeError, match="unsupported object"):
        g.allreduce({"not": "a buffer"})
    with pytest.raises(ValueError, match="dtype"):
        g.allreduce(np.ones(3, np.int32))
    g.close()


def test_device_arrays_reduce_on_the_device():
    from numba import cuda

    gs = groups(3)
    host = [np.arange(50, dtype=np.float32) * (r + 1) for r in range(3)]
    devs = [cuda.to_device(h) for h in host]
    run_ranks([lambda d, g=g: g.allreduce(d, op="mean") for g in gs], devs, timeout=60)
    want = (host[0] + host[1] + host[2]) / np.float32(3)
    for d in devs:
        assert d.copy_to_host().tobytes() == want.tobytes()
    devs = [cuda.to_device(h) for h in host]
    run_ranks([lambda d, g=g: g.allreduce(d, op="max") for g in gs], devs, timeout=60)
    assert all(np.array_equal(d.copy_to_host(), host[2]) for d in devs)
    bad = [h.copy() for h in host]
    bad[1][7] = np.nan
    devs = [cuda.to_device(h) for h in bad]
    errs = []

    def one(d, g):
        try:
            g.allreduce(d)
        except gradcoll.NonFiniteError as e:
            errs.append((e.contributor, e.index))

    run_ranks([lambda d, g=g: one(d, g) for g in gs], devs, timeout=60)
    assert sorted(errs) == [(1, 7)] * 3
    for g in gs:
        g.close()

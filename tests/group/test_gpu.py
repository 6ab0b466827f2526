"""Device-array allreduce on a real GPU (marked ``gpu``: skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest

from gradcoll import ProcessGroup
from gradcoll.testing import run_ranks
from gradcoll.transport.inproc import create_world


@pytest.mark.gpu
def test_device_allreduce_on_real_gpu():
    from numba import cuda

    gs = [ProcessGroup(t, timeout=30) for t in create_world(2, timeout=30)]
    host = [np.random.default_rng(r).standard_normal(1 << 20).astype(np.float32) for r in range(2)]
    devs = [cuda.to_device(h) for h in host]
    run_ranks([lambda d, g=g: g.allreduce(d) for g in gs], devs, timeout=60)
    want = (host[0] + host[1]) / np.float32(2)
    assert all(d.copy_to_host().tobytes() == want.tobytes() for d in devs)
    for g in gs:
        g.close()

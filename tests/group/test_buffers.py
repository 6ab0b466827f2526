"""The buffer conversion module: zero-copy views, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

from gradcoll.group.buffers import as_buffer, is_device_array


def test_numpy_is_itself():
    a = np.ones(4, np.float32)
    b = as_buffer(a)
    assert b.array is a and not b.device and b.source == "numpy"


def test_torch_cpu_tensor_is_zero_copy():
    torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]'")
    t = torch.zeros(5)
    b = as_buffer(t)
    b.array[2] = 7.0
    assert t[2].item() == 7.0 and b.source == "torch"
    with pytest.raises(ValueError, match="not contiguous"):
        as_buffer(torch.zeros(4, 4).t())
    p = torch.nn.Parameter(torch.ones(3))
    assert as_buffer(p).array.shape == (3,)


def test_dlpack_and_buffer_protocol():
    class Producer:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = np.arange(6, dtype=np.float64)
    b = as_buffer(Producer(a), writable=False)
    assert b.source == "dlpack" and np.shares_memory(b.array, a)
    ba = bytearray(8)
    v = as_buffer(ba)
    v.array[0] = 255
    assert ba[0] == 255


def test_refusals_name_the_object():
    with pytest.raises(TypeError, match="unsupported object builtins.dict"):
        as_buffer({"a": 1})
    with pytest.raises(ValueError, match="not C-contiguous"):
        as_buffer(np.ones((4, 4)).T)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(ro)
    assert as_buffer(ro, writable=False).array is ro


def test_device_arrays_are_recognised_under_the_simulator():
    from numba import cuda

    d = cuda.to_device(np.ones(4, np.float32))
    assert is_device_array(d)
    b = as_buffer(d)
    assert b.device and b.source == "cuda"

"""Test configuration shared by the whole suite.

The CUDA kernels run under numba's CUDA simulator on every run: the variable
must be set before numba is first imported, so it is set here, at the top of
the first module pytest loads. ``GRADCOLL_TEST_REAL_GPU=1`` leaves it off so
the ``gpu``-marked tests can use a real device.
"""

import os

if os.environ.get("GRADCOLL_TEST_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402


def _real_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _real_gpu():
        skip = pytest.mark.skip(reason="needs a real CUDA GPU: run with GRADCOLL_TEST_REAL_GPU=1 on a GPU machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

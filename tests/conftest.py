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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A test marked ``scenario(name, raised=...)`` is one row of docs/reliability.md's table under ``make faults``.

    With ``GRADCOLL_FAULT_LOG`` set, its run is appended to that file
    (``benches/faults_report.py`` reads it): the area (default
    ``security``), the scenario, what the test asserts every rank raised,
    the whole scenario's time (an upper bound of the detection time), and
    whether it passed (a failed run is a row with a problem).
    """
    outcome = yield
    mark = item.get_closest_marker("scenario")
    if mark is None or call.when != "call" or not os.environ.get("GRADCOLL_FAULT_LOG"):
        return
    from tests.faults._harness import log_fault

    report = outcome.get_result()
    params = getattr(item, "callspec", None) if mark.kwargs.get("per_variant", True) else None
    variant = ", ".join(str(v) for v in params.params.values()) if params is not None else ""
    log_fault(area=mark.kwargs.get("area", "security"), fault=mark.args[0], buffer=variant or None,
              transport=mark.kwargs.get("transport"), detection=[report.duration] if report.passed else [],
              errors=[mark.kwargs["raised"]] if report.passed and mark.kwargs.get("raised") else [],
              problems=[] if report.passed else [report.outcome])

"""Shared benchmark plumbing: collect timings and print ratio tables at the end.

Each bench records (group, variant, params) -> median seconds through the
``record`` fixture; a bench module may define ``bench_summary(results)`` that
turns them into ratios against the anchors measured in the same run. Benchmarks run with ``pytest benches/<file> --benchmark-enable``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

_KEY = pytest.StashKey[dict]()


@pytest.fixture
def record(benchmark, request):
    """Run ``fn`` under pytest-benchmark and remember its median under ``key``."""

    def _run(key: tuple, fn: Callable[[], object], **kw) -> None:
        benchmark.group = key[0]
        benchmark.pedantic(fn, warmup_rounds=2, **kw) if kw else benchmark(fn)
        if benchmark.stats is not None:
            request.config.stash.setdefault(_KEY, {})[key] = benchmark.stats.stats.median

    return _run


def pytest_terminal_summary(terminalreporter, config) -> None:
    results = config.stash.get(_KEY, {})
    if not results:
        return
    for mod in list(sys.modules.values()):
        fn = getattr(mod, "bench_summary", None)
        if not callable(fn) or not str(getattr(mod, "__file__", None) or "").startswith(str(config.rootpath)):
            continue
        text = fn(results)
        if text:
            terminalreporter.write_line("")
            for line in text.splitlines():
                terminalreporter.write_line(line)

"""Static checks: ``mypy --strict gradcoll`` and ``ruff check`` must both be clean.

Both tools run as subprocesses from the repository root, so they read their
settings from pyproject.toml. Each test is skipped when its tool is not
installed (``pip install -e .[test]`` brings both).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)  # a cold mypy cache takes a while on a small machine


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]' installs it)")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _report(res: subprocess.CompletedProcess[str]) -> str:
    return f"{' '.join(map(str, res.args))} exited {res.returncode}\n{res.stdout}{res.stderr}"


def test_mypy_strict() -> None:
    res = _run("mypy", "--strict", "gradcoll")
    assert res.returncode == 0, _report(res)


def test_ruff_check() -> None:
    res = _run("ruff", "check", "gradcoll", "tests", "benches", "examples")
    assert res.returncode == 0, _report(res)

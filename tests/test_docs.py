"""The documentation site builds with ``mkdocs build --strict`` (broken links and API refs fail it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_strict_build(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs not installed: pip install 'gradcoll[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings not installed: pip install 'gradcoll[docs]'")
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    r = subprocess.run(
        [exe, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=100, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()

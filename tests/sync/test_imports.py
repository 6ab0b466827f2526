"""gradcoll and gradcoll.sync import without pyarrow and grpcio; using them then says what to install."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["pyarrow"] = None  # makes `import pyarrow` raise ImportError
sys.modules["grpc"] = None
import gradcoll
import gradcoll.sync as s
from gradcoll.errors import BackendUnavailable
store = s.MemoryBlockStore()
assert store.get(store.put(b"x")) == b"x"
for use in (lambda: s.store_gradient_as_arrow([1.0]), lambda: s.GradientSyncClient):
    try:
        use()
    except BackendUnavailable as exc:
        print(exc)
    else:
        raise SystemExit("expected BackendUnavailable")
"""


def test_import_without_optional_dependencies():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "gradcoll[arrow]" in out.stdout and "gradcoll[grpc]" in out.stdout

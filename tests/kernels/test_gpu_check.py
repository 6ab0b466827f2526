"""benches/gpu_check.py runs end to end under the CUDA simulator, so the GPU check cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradcoll import kernels as K

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "gpu_check.py"


@pytest.mark.timeout(300)
@pytest.mark.skipif("cudasim" not in K.available_backends(), reason="needs numba-cuda (pip install -e .[cuda])")
def test_gpu_check_runs_under_the_simulator() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--sim"], capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "correctness: OK" in r.stdout
    for kernel in ("mean_reduce", "accumulate", "encode bf16", "encode fp16", "acc_wire bf16", "acc_wire fp16"):
        assert kernel in r.stdout, r.stdout
    assert "of_copy" in r.stdout

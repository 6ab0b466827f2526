"""The torch training example runs unchanged under Open MPI's mpirun, over the mpi and tcp transports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradcoll.cli.launch import free_port

pytestmark = pytest.mark.timeout(150)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_ddp_replacement.py"


def _skip_reason() -> str | None:
    if shutil.which("mpirun") is None:
        return "Open MPI not installed: apt-get install openmpi-bin libopenmpi-dev"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed: pip install 'gradcoll[mpi]'"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch not installed: pip install 'gradcoll[torch]'"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_example_under_mpirun(backend):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "4",
           "-x", f"GRADCOLL_BACKEND={backend}", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
           sys.executable, str(EXAMPLE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "max weight spread across ranks: 0.0" in r.stdout

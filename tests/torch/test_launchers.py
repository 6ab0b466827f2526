"""examples/torch_ddp_replacement.py under real launchers: torchrun (static and --standalone) and mpirun.

Each run trains the example on 2 ranks, once on gradcoll's own group
(``gradcoll.init_process_group()``, which meets in the store torchrun's agent
already serves on ``MASTER_PORT``) and once as a DDP script on
``dist.init_process_group("gradcoll")``; the ranks must end with the same
weights. Skipped without PyTorch (``pip install 'gradcoll[torch]'``) or, for
mpirun, without Open MPI (``apt-get install openmpi-bin``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)")

from gradcoll.cli.launch import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_ddp_replacement.py"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRADCOLL_BACKEND",
                  "TORCHELASTIC_USE_AGENT_STORE")


def _run(cmd: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


@pytest.mark.parametrize("rendezvous", ["standalone", "master_port"])
@pytest.mark.parametrize("mode", ["own", "ddp"])
def test_example_under_torchrun(rendezvous: str, mode: str) -> None:
    where = ["--standalone"] if rendezvous == "standalone" else [f"--master_port={free_port()}"]
    args = ["--ddp"] if mode == "ddp" else []
    out = _run([sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node=2", str(EXAMPLE), *args])
    # DDP on the backend picks shared memory by itself; gradcoll's own group takes its default, tcp
    assert f"max weight spread across ranks: 0.0 (transport {'shm' if mode == 'ddp' else 'tcp'})" in out, out


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI not installed: apt-get install openmpi-bin")
def test_ddp_example_under_mpirun() -> None:
    # dist.init_process_group("gradcoll") under mpirun: gradcoll.torch gives env:// RANK and WORLD_SIZE
    out = _run(["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2",
                "-x", f"MASTER_PORT={free_port()}", sys.executable, str(EXAMPLE), "--ddp"])
    assert "max weight spread across ranks: 0.0 (transport shm)" in out, out

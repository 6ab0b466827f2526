"""The two node examples run end to end in real processes (a few seconds each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script, args, expect", [
    ("node_pipeline.py", ["--topology", "star", "--inputs", "5"], "5 activations through star pipeline"),
    ("node_training.py", ["--topology", "mesh", "--epochs", "3"], "distributed vs single-process parameters"),
])
def test_example_runs(script: str, args: list[str], expect: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD", "PEERS", "TOPOLOGY", "DEVICE")}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert expect in done.stdout

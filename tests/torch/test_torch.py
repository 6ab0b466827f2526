"""gradcoll.torch: averaged gradients match DDP over gloo and a single process.

Skipped without PyTorch (``pip install torch==2.13.0``; CI's .ci/run installs it).
"""

from __future__ import annotations

import io
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)")

from gradcoll.cli.launch import launch  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STEPS, BATCH, LR = 5, 32, 0.1

COMMON = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(3, 3)   # never gets a gradient

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn({BATCH}, 8, generator=g)
    y = torch.randint(0, 4, ({BATCH},), generator=g)
    return x, y
"""

WORKER = COMMON + """
import os, sys, numpy as np
mode, out = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
model = Net()
opt = torch.optim.SGD(model.parameters(), lr={LR})
if mode == "ddp":
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
else:
    import gradcoll
    from gradcoll.torch import GradientSynchronizer, sync_gradients
    group = gradcoll.init_process_group("tcp", "env://", timeout=30)
    net = model
    sync = GradientSynchronizer(model, group, bucket_mb=0.0005) if mode == "hooks" else None
local = {BATCH} // world
for step in range({STEPS}):
    x, y = batch(step)
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    if mode == "nan" and step == 2 and rank == world - 1:
        model.b.weight.grad[1, 2] = float("nan")
    if mode == "sync":
        sync_gradients(model, group, bucket_mb=0.0005)
    elif mode == "hooks":
        sync.wait()
    elif mode == "nan":
        try:
            sync_gradients(model, group)
        except gradcoll.NonFiniteError as e:
            print("HALT", e.contributor, e)
            sys.exit(0)
    opt.step()
if rank == 0:
    np.save(out, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
"""


def single_process() -> np.ndarray:
    ns: dict = {}
    exec(textwrap.dedent(COMMON.format(BATCH=BATCH)), ns)
    model = ns["Net"]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = ns["batch"](step)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def run(tmp_path, mode: str, n: int) -> tuple[np.ndarray | None, str]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(BATCH=BATCH, STEPS=STEPS, LR=LR)))
    out = tmp_path / f"{mode}-{n}.npy"
    buf = io.StringIO()
    res = launch([sys.executable, str(script), mode, str(out)], n, out=buf, timeout=100)
    assert res.ok, buf.getvalue()
    return (np.load(out) if out.exists() else None), buf.getvalue()


@pytest.mark.parametrize("n", [2, 4])
def test_matches_ddp_and_single_process(tmp_path, n):
    ref = single_process()
    ddp, _ = run(tmp_path, "ddp", n)
    for mode in ("sync", "hooks"):
        got, _ = run(tmp_path, mode, n)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, ddp, rtol=1e-5, atol=1e-6)


def test_nan_halts_every_rank_naming_rank_and_parameter(tmp_path):
    _, log = run(tmp_path, "nan", 3)
    halts = [line for line in log.splitlines() if "HALT" in line]
    assert len(halts) == 3, log
    assert all(" HALT 2 " in line and "b.weight" in line for line in halts), halts


def test_bucketing_reverse_order_and_dtype_groups():
    from gradcoll.torch import make_buckets

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).double())
    bs = make_buckets(m, bucket_mb=25)
    assert [[n for n, _ in b.params] for b in bs] == [["1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert bs[0].buf.dtype == np.float64 and bs[1].buf.dtype == np.float32

"""gradcoll.torch without torch.distributed: sync_gradients and GradientSynchronizer on a gradcoll group.

Averaged gradients match DDP over gloo and a single process; GradientSynchronizer
copies rank 0's state and refuses different layouts; bfloat16 goes through the
group API. Skipped without PyTorch: ``pip install 'gradcoll[torch]'``.
"""

from __future__ import annotations

import io
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)")

from gradcoll.cli.launch import launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # each launch imports torch in every rank: slow on a busy 2-core machine

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
import torch.distributed as dist
import gradcoll
from gradcoll.torch import GradientSynchronizer, sync_gradients
mode, out = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode == "train":
    dist.init_process_group("gloo", init_method="env://")
group = gradcoll.init_process_group("tcp", "env://", timeout=60)  # shares torch's store when torch runs
flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy()

if mode == "train":  # DDP on gloo, sync_gradients and GradientSynchronizer, on the same batches
    models = {{k: Net() for k in ("ddp", "sync", "hooks")}}
    nets = {{"ddp": torch.nn.parallel.DistributedDataParallel(models["ddp"], find_unused_parameters=True),
            "sync": models["sync"], "hooks": models["hooks"]}}
    sync = GradientSynchronizer(models["hooks"], group, bucket_mb=0.0005)
    opts = {{k: torch.optim.SGD(m.parameters(), lr={LR}) for k, m in models.items()}}
    local = {BATCH} // world
    for step in range({STEPS}):
        x, y = batch(step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for k, net in nets.items():
            opts[k].zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            if k == "sync":
                sync_gradients(net, group, bucket_mb=0.0005)
            elif k == "hooks":
                sync.wait()
            opts[k].step()
    if rank == 0:
        np.savez(out, **{{k: flat(m) for k, m in models.items()}})

elif mode == "nan":
    model = Net()
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if rank == world - 1:
        model.b.weight.grad[1, 2] = float("nan")
    try:
        sync_gradients(model, group)
    except gradcoll.NonFiniteError as e:
        print("HALT", e.contributor, type(e).__name__, isinstance(e, RuntimeError), e)

elif mode == "misc":
    # every rank starts from other weights and buffers: rank 0's are copied to all
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    model.register_buffer("marker", torch.full((3,), float(rank)))
    GradientSynchronizer(model, group)
    state = torch.cat([t.detach().reshape(-1).double() for t in [*model.parameters(), *model.buffers()]])
    np.save(out + f".{{rank}}.npy", state.numpy())
    other = Net()  # rank 1 builds another model: every rank refuses it
    if rank == 1:
        other.b = torch.nn.Linear(16, 5)
    try:
        GradientSynchronizer(other, group)
    except gradcoll.UsageError as e:
        print("MISMATCH", e)
    # the group API takes bfloat16 tensors (sum and mean accumulate in float32), so does sync_gradients
    t = torch.full((4,), 1.5 + rank, dtype=torch.bfloat16)
    same = group.allreduce(t, op="mean") is t
    half = Net().to(torch.bfloat16)
    for p in half.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    sync_gradients(half, group)
    grads = torch.cat([p.grad.reshape(-1) for p in half.parameters()])
    print("BF16", same, t.dtype, t.tolist(), sorted(set(grads.float().tolist())))
group.close()
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


def run(tmp_path, mode: str, n: int) -> tuple[str, str]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(BATCH=BATCH, STEPS=STEPS, LR=LR)))
    out = str(tmp_path / f"{mode}-{n}")
    buf = io.StringIO()
    res = launch([sys.executable, str(script), mode, out], n, out=buf, timeout=250)
    assert res.ok, buf.getvalue()
    return out, buf.getvalue()


@pytest.mark.parametrize("n", [2, 4])
def test_matches_ddp_and_single_process(tmp_path, n):
    ref = single_process()
    out, _ = run(tmp_path, "train", n)
    got = np.load(out + ".npz")
    for mode in ("sync", "hooks"):
        np.testing.assert_allclose(got[mode], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[mode], got["ddp"], rtol=1e-5, atol=1e-6)


def test_nan_halts_every_rank_naming_rank_and_parameter(tmp_path):
    _, log = run(tmp_path, "nan", 3)
    halts = [line for line in log.splitlines() if "HALT" in line]
    assert len(halts) == 3, log
    assert all(" HALT 2 NonFiniteGradientError True " in line and "b.weight" in line for line in halts), halts


@pytest.fixture(scope="module")
def misc(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misc")
    out, log = run(tmp, "misc", 3)
    return out, log


def test_synchronizer_copies_rank0_parameters_and_buffers(misc):
    out, _ = misc
    ns: dict = {}
    exec(textwrap.dedent(COMMON.format(BATCH=BATCH)), ns)
    ref = torch.cat([p.detach().reshape(-1).double() for p in ns["Net"]().parameters()]).numpy()
    for r in range(3):
        np.testing.assert_array_equal(np.load(f"{out}.{r}.npy"), np.concatenate([ref, [0.0, 0.0, 0.0]]))


def test_synchronizer_refuses_different_layouts_on_every_rank(misc):
    lines = [line for line in misc[1].splitlines() if "MISMATCH" in line]
    assert len(lines) == 3, misc[1]
    for line in lines:
        assert "the ranks built different buckets" in line
        assert ("rank 1's parameter 'b.bias' is (5,) torch.float32 where rank 0's 'b.bias' is (4,) torch.float32 "
                "(bucket 0, position 2 in backward order)") in line, line


def test_bfloat16_tensors_through_the_group_and_sync_gradients(misc):
    lines = [line for line in misc[1].splitlines() if "BF16" in line]
    assert len(lines) == 3, misc[1]
    for line in lines:
        assert "BF16 True torch.bfloat16 [2.5, 2.5, 2.5, 2.5] [2.0]" in line, line


def test_bucketing_reverse_order_and_dtype_groups():
    from gradcoll.torch import make_buckets

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).double())
    bs = make_buckets(m, bucket_mb=25)
    assert [[n for n, _ in b.params] for b in bs] == [["1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert bs[0].buf.dtype == np.float64 and bs[1].buf.dtype == np.float32


def test_bucketing_keeps_bfloat16_apart():
    from gradcoll.torch import make_buckets

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    bs = make_buckets(m, bucket_mb=25)
    assert [b.wire for b in bs] == ["bf16", None]
    assert bs[0].buf.dtype == np.uint16 and bs[1].buf.dtype == np.float32

"""Train a small model data-parallel on gradcoll, two ways.

Run (any launcher: `gradcoll launch`, torchrun, mpirun):

    python -m gradcoll launch -n 4 examples/torch_ddp_replacement.py
    torchrun --nproc_per_node=2 examples/torch_ddp_replacement.py
    torchrun --standalone --nproc_per_node=2 examples/torch_ddp_replacement.py --ddp

Default: gradcoll's own group and ``GradientSynchronizer`` in place of
DistributedDataParallel (three lines change from a DDP script, marked
CHANGED). ``--ddp``: an unchanged DDP script whose one change is the
backend's name, ``dist.init_process_group("gradcoll")`` instead of "gloo".
"""

import sys

import torch
import torch.distributed as dist

import gradcoll
import gradcoll.torch  # registers the "gradcoll" backend of torch.distributed
from gradcoll.torch import GradientSynchronizer

use_ddp = "--ddp" in sys.argv[1:]
if use_ddp:
    dist.init_process_group("gradcoll")  # CHANGED: was dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    group = gradcoll.init_process_group(timeout=60)  # CHANGED: was dist.init_process_group("gloo")
    rank = group.rank
torch.manual_seed(rank)  # every rank starts differently: rank 0's weights are copied to the others
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
if use_ddp:
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
else:
    net = model
    sync = GradientSynchronizer(model, group, bucket_mb=0.01)  # CHANGED: was DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

gen = torch.Generator().manual_seed(1234)
teacher = torch.randn(20, 5, generator=gen)
for step in range(200):
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(step * 131 + rank))
    y = (x @ teacher).argmax(dim=1)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()  # buckets start averaging while backward runs
    if not use_ddp:
        sync.wait()  # CHANGED: finish the averaging before the step
    opt.step()
    if rank == 0 and step % 50 == 0:
        print(f"step {step:>3} loss {loss.item():.4f}")

# Every rank holds the same weights.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
if use_ddp:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    spread = max(float((g - gathered[0]).abs().max()) for g in gathered)
    transport = dist.distributed_c10d._get_default_group().transport
    dist.destroy_process_group()
else:
    rows = group.allgather(flat.numpy())
    spread = float(abs(rows - rows[0]).max())
    transport = group.transport.name
    group.close()
if rank == 0:
    print(f"max weight spread across ranks: {spread} (transport {transport})")

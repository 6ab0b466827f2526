"""Replace DistributedDataParallel's gradient averaging with gradcoll.

Run:  python -m gradcoll launch -n 4 examples/torch_ddp_replacement.py

The change from a torch DDP script is three lines (marked CHANGED): build a
gradcoll group instead of torch.distributed's, keep the plain model, and
wait for the synchroniser before ``optimizer.step()``.
"""

import torch

import gradcoll
from gradcoll.torch import GradientSynchronizer

group = gradcoll.init_process_group(timeout=60)  # CHANGED: was dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
sync = GradientSynchronizer(model, group, bucket_mb=1)  # CHANGED: was DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

gen = torch.Generator().manual_seed(1234)
teacher = torch.randn(20, 5, generator=gen)
for step in range(200):
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(step * 131 + group.rank))
    y = (x @ teacher).argmax(dim=1)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # buckets start averaging while backward runs
    sync.wait()  # CHANGED: finish the averaging before the step
    opt.step()
    if group.rank == 0 and step % 50 == 0:
        print(f"step {step:>3} loss {loss.item():.4f}")

# Every rank holds the same weights.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
gathered = group.allgather(flat)
if group.rank == 0:
    print("max weight spread across ranks:", float(abs(gathered - gathered[0]).max()))
group.close()

"""DDP on the gradwire backend: the README's PyTorch example.

    pip install .                                   # in the repository: library + command
    torchrun --standalone --nproc-per-node 2 python/examples/ddp_gradwire.py
    gradwire launch -n 2 -- python3 python/examples/ddp_gradwire.py

No gradwire import and no gradwire variable: the installed package's entry point makes
"gradwire" a backend name. Prints each rank's final loss and whether its parameters equal
rank 0's.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gradwire")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(rank)
for step in range(50):
    x = torch.randn(64, 32, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
first = params.clone()
dist.broadcast(first, src=0)
print(f"rank {rank}: backend {dist.get_backend()}, final loss {loss.item():.4f}, replicas identical: {torch.equal(first, params)}", flush=True)
del model, opt  # before the group goes (see python/tests/torch_backend.py)
dist.destroy_process_group()

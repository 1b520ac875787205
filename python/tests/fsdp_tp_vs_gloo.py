"""Under torchrun with 4 ranks (BACKEND is "gradwire" or "gloo"): 2-D parallel training on
a (dp=2, tp=2) DeviceMesh, as torch's own tutorials combine them: tensor parallelism
(`parallelize_module`, column-wise then row-wise linear layers, DTensor's collectives
inside each tp pair) under FSDP2 (`fully_shard` over the dp dimension), 6 SGD steps of an
MLP, each dp rank on its own data (the tp pair shares it). Also a DTensor redistributed
from sharded to replicated and back. Prints every step's loss (averaged over the ranks) as
"loss STEP VALUE", which the caller compares with gloo's run, then "fsdp tp: ok".

    fsdp_tp_vs_gloo.py BACKEND
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradwire.torch  # noqa: F401  (registers the backend)

backend = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, "run with 4 ranks (dp=2 x tp=2)"
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

# A DTensor sharded over tp, made whole, sharded again: every rank sees the same values.
full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
d = distribute_tensor(full, mesh["tp"], [Shard(0)])
whole = d.redistribute(mesh["tp"], [Replicate()]).to_local()
assert torch.equal(whole, full), whole
back = d.redistribute(mesh["tp"], [Shard(1)]).to_local()
assert torch.equal(back, full[:, mesh["tp"].get_local_rank() * 3 :][:, :3]), back
print(f"rank {rank}: redistribute ok", flush=True)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


torch.manual_seed(0)
model = Mlp()
parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
dp = mesh["dp"].get_local_rank()
g = torch.Generator().manual_seed(2000 + dp)
for step in range(6):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    if hasattr(mean, "full_tensor"):
        mean = mean.full_tensor()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"loss {step} {mean.item() / world:.9f}", flush=True)
dist.destroy_process_group()
print(f"rank {rank}: fsdp tp: ok", flush=True)
if backend == "gloo":
    # The reference's data is out. torch's gloo can abort in its own teardown at interpreter
    # exit ("terminate called without an active exception"), which is not the run under test.
    sys.stderr.flush()
    os._exit(0)

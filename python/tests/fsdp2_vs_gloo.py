"""Under torchrun (2 or 3 ranks; BACKEND is "gradwire" or "gloo"): what DeviceMesh-based
training needs of a backend. Prints one line per check and, for the training run, every
step's loss (averaged over the ranks) as "loss STEP VALUE", which the caller compares with
gloo's run of the same script:

    fsdp2_vs_gloo.py BACKEND [cuda]

With `cuda` (gradwire only; one GPU is enough: each rank is a "node" of its own, so NCCL
groups hold one rank and gradwire crosses between them) the mesh, the model and the data
are on the GPU, and the losses are compared with gloo's CPU run of the same script.

- the group has a name and its devices (`group_name`, `_device_types`);
- a subgroup made with `new_group` reduces and is destroyed (`destroy_process_group(g)`);
- `init_device_mesh` of 1-D and 2-D (dp x tp) meshes;
- `monitored_barrier` passes; on gradwire also with rank 1 late, where rank 0 must name it
  ("late: ..." lines) and the others time out waiting for the release;
- FSDP2: `fully_shard` on each linear layer and the model, 6 SGD steps of an MLP, each rank
  on its own data.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradwire.torch  # noqa: F401  (registers the backend)

backend = sys.argv[1]
on_gpu = sys.argv[2:] == ["cuda"]
torch.set_num_threads(1)
if on_gpu:
    os.environ["GRADWIRE_HOST_ID"] = f"node{os.environ['RANK']}"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
if on_gpu:
    torch.cuda.set_device(device)
group = dist.group.WORLD
assert isinstance(group.group_name, str) and group.group_name, group.group_name
assert torch.device("cpu") in group._device_types, group._device_types
print(f"rank {rank}: named {group.group_name!r}, devices {sorted(d.type for d in group._device_types)}", flush=True)

sub = dist.new_group(list(range(world)))
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t, group=sub)
assert t.tolist() == [world * (world + 1) / 2] * 3, t
dist.destroy_process_group(sub)
print(f"rank {rank}: new_group reduced and destroyed", flush=True)

mesh = init_device_mesh(device.type, (world,))
mesh2 = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
assert mesh2["tp"].size() == world and mesh2["dp"].size() == 1
print(f"rank {rank}: meshes {mesh} {mesh2}", flush=True)
try:
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    print(f"rank {rank}: monitored barrier passed", flush=True)
    monitored = True
except ValueError as e:  # torch 2.11 (checked) allows it on gloo alone, whatever the backend
    if backend == "gloo" or "only implemented for GLOO" not in str(e):
        raise
    print(f"rank {rank}: monitored barrier refused by torch {torch.__version__}: {e}", flush=True)
    monitored = False

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1000 + rank)
for step in range(6):
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"loss {step} {mean.item() / world:.9f}", flush=True)
if backend == "gradwire" and monitored:
    if rank == 1:
        time.sleep(3)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
        print(f"rank {rank}: late: passed", flush=True)
    except RuntimeError as e:
        print(f"rank {rank}: late: {e}", flush=True)
dist.destroy_process_group()
print(f"rank {rank}: fsdp2: ok", flush=True)
if backend == "gloo":
    # The reference's data is out. torch's gloo can abort in its own teardown at interpreter
    # exit ("terminate called without an active exception"), which is not the run under test.
    sys.stderr.flush()
    os._exit(0)

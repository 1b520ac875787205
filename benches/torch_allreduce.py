"""One rank of benches/torch_compare.sh: torch.distributed.all_reduce on the backend
$BACKEND ("gradwire" or "gloo"), sizes in turn, then DDP step time on a model of about 25 M
parameters. One backend per process: a gloo group beside the gradwire one slows gradwire's
16 MiB allreduce by 20 % here (gloo's threads take CPU time on 2 cores).

Prints on rank 0:  allreduce BYTES US  per size and  ddp PARAMS MS. Times are the slowest
rank's mean.
"""

import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch  # noqa: F401

torch.set_num_threads(1)
dist.init_process_group(os.environ["BACKEND"])
rank, world = dist.get_rank(), dist.get_world_size()
sizes = [int(s) for s in os.environ.get("SIZES", "").split()]


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=None)
    return t.item()


def timed(group, x, iters, warmup):
    for _ in range(warmup):
        dist.all_reduce(x, group=group)
    dist.barrier(group=None)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    return slowest((time.perf_counter() - t0) / iters)


for size in sizes:
    n = size // 4
    iters = max(5, min(200, (256 << 20) // max(size, 1)))
    x = torch.rand(n)
    t = timed(None, x, iters, max(1, iters // 5))
    if rank == 0:
        print(f"allreduce {size} {t * 1e6:.2f}", flush=True)

# DDP on a model of ~25 M parameters: forward, backward (buckets reduced during it), step.
steps = int(os.environ.get("DDP_STEPS", "10"))


def ddp_step_time(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(16, 2048)

    def step():
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    step()
    dist.barrier(group=None)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t = slowest((time.perf_counter() - t0) / steps)
    del ddp, opt, model
    gc.collect()
    return params, t


if steps > 0:
    p, t = ddp_step_time(None)
    if rank == 0:
        print(f"ddp {p} {t * 1e3:.1f}", flush=True)
gc.collect()
dist.destroy_process_group()
sys.exit(0)

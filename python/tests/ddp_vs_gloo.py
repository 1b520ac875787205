"""Run under `gradwire launch -n N -- python3 python/tests/ddp_vs_gloo.py`.

Trains the same small model twice with DistributedDataParallel from the same initial
weights and data: once with the gloo backend's own gradient allreduce, once with
gradwire's DDP comm hook. The loss trajectories must agree within a relative 1e-4.

Why 1e-4: both average the same float32 gradients and differ only in summation order
(≤ (W−1)·eps ≈ 4e-7 relative per step); 40 steps of SGD with momentum on this smooth
problem amplify that by far less than 100×. A wrong reduction — a sum instead of an
average, a bucket left out or reduced twice — moves the loss by more than 1e-2 within
a few steps.
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_problem  # the shared DDP test problem, beside this file

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

from gradwire import Comm  # noqa: E402 (after torch.distributed: it takes the next port)
from gradwire.ddp import allreduce_hook  # noqa: E402

comm = Comm()
assert (comm.rank, comm.size) == (rank, world)
op = os.environ.get("GRADWIRE_HOOK_OP", "avg")  # "sum" demonstrates that the check fails
STEPS = 40


def train(use_gradwire):
    model = ddp_problem.model()
    # Small buckets, so the hook runs several times per step.
    ddp = DDP(model, bucket_cap_mb=0.005)
    if use_gradwire:
        ddp.register_comm_hook(None, allreduce_hook(comm, op=op))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = ddp_problem.fit(ddp, opt, STEPS, rank, world)
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


gloo_losses, gloo_params = train(False)
gw_losses, gw_params = train(True)
rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(gloo_losses, gw_losses))
param_diff = (gloo_params - gw_params).abs().max().item()
if rank == 0:
    print(f"{world} ranks, {STEPS} steps; loss every 5th step (gloo | gradwire hook):")
    for s in range(0, STEPS, 5):
        print(f"  step {s:2d}: {gloo_losses[s]:.7f} | {gw_losses[s]:.7f}")
    print(f"  final:   {gloo_losses[-1]:.7f} | {gw_losses[-1]:.7f}")
    print(f"max relative loss difference {rel:.2e}, max parameter difference {param_diff:.2e}")
ok = rel <= 1e-4
print(f"rank {rank}: ddp hook vs gloo: {'1 passed, 0 failed' if ok else '0 passed, 1 failed'}")
# torch 2.15: a DDP module left to the interpreter's exit, after its process group is gone,
# aborts the process about half the time ("terminate called without an active exception";
# gloo alone does it too): collect the DDP modules first.
gc.collect()
comm.finalize()
dist.destroy_process_group()
sys.exit(0 if ok else 1)

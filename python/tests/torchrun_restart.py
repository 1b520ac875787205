"""Run under `torchrun --max-restarts 1`: in the first attempt rank 1 dies before
init_process_group while the others are inside it; torchrun restarts every rank, and the
second attempt's group must form from its own attempt's keys and allreduce correctly.
Prints "restart: ok" on each rank of the attempt that succeeds.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401  (registers the backend)

backend = sys.argv[1] if len(sys.argv) > 1 else "gradwire"
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if attempt == 0 and rank == 1:
    time.sleep(2)  # the others are inside init_process_group by now
    os._exit(1)
dist.init_process_group(backend)
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
world = dist.get_world_size()
assert torch.equal(x, torch.full((1000,), world * (world + 1) / 2)), x[:4]
dist.barrier()
print(f"restart: ok (rank {rank}, attempt {attempt})", flush=True)
dist.destroy_process_group()

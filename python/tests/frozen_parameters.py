"""Under `gradwire launch -n N`: a frozen parameter (requires_grad False) that the local
optimizer holds stays bit for bit what it was (rank 0's value, which the scheme hands every
rank at construction) through DASO's and BSP's training, including DASO's asynchronous
global merges and the epochs' ends, while the trainable ones move. Prints "frozen: ok".
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import gradwire.torch  # noqa: F401  (registers the backend)
from gradwire.optim import BSP, DASO

torch.set_num_threads(1)
dist.init_process_group("gradwire")
rank = dist.get_rank()
failures = []
for scheme in ("daso", "bsp"):
    torch.manual_seed(7 + rank)  # different on every rank: the scheme makes them equal
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model[0].weight.requires_grad_(False)
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = DASO(local, total_epochs=6, warmup_epochs=1, cooldown_epochs=1) if scheme == "daso" else BSP(local, interval=3)
    frozen, trained = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    start = torch.empty_like(frozen)
    start.copy_(frozen)
    dist.broadcast(start, src=0)
    if not torch.equal(frozen, start):
        failures.append(f"{scheme}: the frozen parameter differs from rank 0's after construction")
    for epoch in range(6):
        for step in range(8):
            g = torch.Generator().manual_seed(rank * 1000 + epoch * 10 + step)
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if scheme == "daso":
                opt.last_batch = 7
                opt.step()
            else:
                opt.step(last_of_epoch=step == 7)
        if scheme == "daso":
            opt.epoch_loss_logic(loss.detach())
    moved = (model[0].weight.detach() - frozen).abs().max().item()
    if moved != 0:
        failures.append(f"{scheme}: the frozen parameter moved by up to {moved:.3g}")
    if torch.equal(model[2].weight.detach(), trained):
        failures.append(f"{scheme}: the trainable parameter did not move")
for f in failures:
    print(f"rank {rank}: {f}", flush=True)
print("frozen: ok" if not failures else f"frozen: {len(failures)} failed", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)

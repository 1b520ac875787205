"""The small regression problem the DDP comparisons train (torch_backend.py against gloo,
ddp_vs_gloo.py for the communication hook): the same model, initial weights and data on
every backend, so loss trajectories can be compared step by step."""

import torch
import torch.distributed as dist
import torch.nn as nn


def model():
    """The model, with the same initial weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def fit(ddp, opt, steps, rank, world, loss_group=None):
    """Trains `ddp` for `steps` steps on this rank's fixed data stream; returns the loss
    averaged over ranks (through `loss_group`) at every step."""
    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.linspace(-1, 1, 16)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.sin(x @ w_true).unsqueeze(1)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=loss_group)
        losses.append(mean.item() / world)
    return losses

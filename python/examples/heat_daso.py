"""A training script written for Heat's DASO, as Heat's own example and test write one
(heat/examples/nn/imagenet-DASO.py, heat/optim/tests/test_dp_optimizer.py): the optimizer
wrapped as `ht.optim.DASO`, the model as `ht.nn.DataParallelMultiGPU`, `last_batch` set
every epoch, `daso.step()` after backward, `daso.epoch_loss_logic(loss)` after the epoch.
It runs on gradwire with one line changed: `import heat as ht` became the import below.

    gradwire launch -n 4 --netns --ranks-per-node 2 -- python3 python/examples/heat_daso.py

Data: ten 8x8 class patterns plus noise, made from a fixed seed (nothing to download).
Prints the test accuracy per epoch (rank 0) and, per rank, a checksum of the final
parameters (DASO's cool-down leaves every replica identical).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradwire.heat as ht  # was: import heat as ht


def print0(*args, **kwargs):
    if ht.MPI_WORLD.rank == 0:
        print(*args, **kwargs, flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def patterns(n, seed):
    g = torch.Generator().manual_seed(1234)
    protos = torch.randn(10, 1, 8, 8, generator=g)
    g.manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(protos[y] + 1.5 * torch.randn(n, 1, 8, 8, generator=g), y)


def train(loader, model, daso):
    model.train()
    daso.last_batch = len(loader) - 1  # must be set for DASO to work properly
    total = 0.0
    for data, target in loader:
        output = model(data)
        loss = F.cross_entropy(output, target)
        daso.zero_grad()
        loss.backward()
        daso.step()
        total += loss.item()
    return total / len(loader)


def validate(loader, model):
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            correct += (model(data).argmax(1) == target).sum().item()
    return correct / len(loader.dataset)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    torch.manual_seed(999999999)
    torch.set_num_threads(1)
    train_set, test_set = patterns(4096, 1), patterns(1024, 2)
    sampler = DistributedSampler(train_set, num_replicas=ht.MPI_WORLD.size, rank=ht.MPI_WORLD.rank, seed=3)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    daso_optimizer = ht.optim.DASO(
        local_optimizer=optimizer,
        total_epochs=args.epochs,
        max_global_skips=4,
        stability_level=0.05,
        warmup_epochs=2,
        cooldown_epochs=2,
    )
    htmodel = ht.nn.DataParallelMultiGPU(model, daso_optimizer)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss = train(train_loader, htmodel, daso_optimizer)
        acc = validate(test_loader, htmodel)
        daso_optimizer.epoch_loss_logic(loss)
        print0(f"epoch {epoch + 1}/{args.epochs}  train loss {loss:.4f}  test acc {100 * acc:.1f} %")
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(f"rank {ht.MPI_WORLD.rank}: final test acc {100 * acc:.1f} %, parameter checksum {params.double().sum().item():.12e} {params.double().abs().sum().item():.12e}", flush=True)


if __name__ == "__main__":
    main()

"""Under `gradwire launch -n N` (CI: 2 namespace nodes of 2 ranks): a model with BatchNorm
trained under DASO, BSP and each parameter-server scheme, every rank on its own data (so
its running statistics drift apart), ends with parameters and buffers bit-identical on
every rank after `finish()` (and under DASO, as under Heat's DDP, every batch whose
gradients the node averages starts from buffers identical inside the node); the floating buffers are the ranks' mean (checked against
the mean of every rank's buffers gathered just before, computed here in NumPy), the
batch counts rank 0's. A control run without `model=` shows the check can fail: there
the statistics differ. Prints "buffers: ok" per rank.

With the argument `cuda` the models train on the rank's CUDA device (benches/gpu.sh, each
rank a node of its own, so only the cross-node agreement is exercised there): DASO and BSP
device-resident, the parameter-server schemes through their host copies.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn

import gradwire.torch  # noqa: F401  (registers the backend)
from gradwire.optim import BSP, DASO, ParameterServer, resolve_comm

torch.set_num_threads(1)
device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
if device.type == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
comm = resolve_comm()
rank, world = comm.rank, comm.size
node = comm.node_local()
node_checks = [0]
failures = []
EPOCHS, BATCHES = 6, 6


def model_for(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 16),
        nn.BatchNorm1d(16, momentum=None),  # a cumulative average: another update rule
        nn.ReLU(),
        nn.Linear(16, 3),
    ).to(device)


def batch(epoch, step):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * epoch + step)
    # Each rank's inputs have their own offset and scale: its statistics are its own.
    x = torch.randn(8, 3, 4, 4, generator=g) * (1 + rank) + rank
    return x.to(device), torch.randint(0, 3, (8,), generator=g).to(device)


def gathered(vec):
    """Every rank's float64 `vec`, as a (world, n) array."""
    out = np.empty(world * vec.size, dtype=np.float64)
    comm.allgather(np.ascontiguousarray(vec, dtype=np.float64), out)
    return out.reshape(world, vec.size)


def state(model):
    """(parameters, floating buffers, other buffers), each flat float64."""
    params = np.concatenate([p.detach().reshape(-1).double().cpu().numpy() for p in model.parameters()])
    floating = np.concatenate([b.detach().reshape(-1).double().cpu().numpy() for b in model.buffers() if b.is_floating_point()])
    other = np.concatenate([b.detach().reshape(-1).double().cpu().numpy() for b in model.buffers() if not b.is_floating_point()])
    return params, floating, other


def train(scheme, with_model=True):
    model = model_for(seed=100 + rank)  # different on every rank: the scheme makes them equal
    given = model if with_model else None
    if scheme in ("daso", "bsp"):
        local = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        if scheme == "daso":
            opt = DASO(local, total_epochs=EPOCHS, warmup_epochs=1, cooldown_epochs=1, model=given)
            opt.last_batch = BATCHES - 1
        else:
            opt = BSP(local, interval=4, model=given)
    else:
        options = {"lr": 0.02} if scheme != "eamsgd" else {"lr": 0.02, "tau": 2}
        opt = ParameterServer(model if with_model else list(model.parameters()), scheme, **options)
    if with_model:
        _, fl, ot = state(model)
        g0 = gathered(np.concatenate([fl, ot]))
        if not (g0 == g0[0]).all():
            failures.append(f"{scheme}: the buffers differ across ranks after construction (not rank 0's)")
    for epoch in range(EPOCHS):
        steps = 0
        while True:
            if scheme in ("daso", "bsp"):
                if steps == BATCHES:
                    break
            elif opt.shared_pool:
                if not opt.claim_batch(BATCHES * world):
                    break
            elif steps == BATCHES:
                break
            x, y = batch(epoch, steps)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if scheme == "daso":
                opt.step()
                if with_model and opt._strategy.node_average_next:
                    # As Heat's DDP: the next batch starts from local index 0's buffers.
                    _, fl, ot = state(model)
                    mine = np.concatenate([fl, ot])
                    every = np.empty(node.size * mine.size)
                    node.allgather(mine, every)
                    if not (every.reshape(node.size, -1) == mine).all():
                        failures.append(f"daso: epoch {epoch} batch {steps}: the buffers differ inside the node before a node-averaged batch")
                    node_checks[0] += 1
            elif scheme == "bsp":
                opt.step(last_of_epoch=steps == BATCHES - 1)
            else:
                opt.step()
            steps += 1
        if scheme == "daso":
            opt.epoch_loss_logic(loss.detach())
        else:
            opt.end_epoch(loss.detach())
    # One more forward in training mode after the last agreement: each rank's statistics
    # move with its own data, which finish() must merge.
    x, _ = batch(EPOCHS, 0)
    with torch.no_grad():
        model(x)
    _, fl, ot = state(model)
    before_fl, before_ot = gathered(fl), gathered(ot)
    opt.finish()
    return model, before_fl, before_ot


for scheme in ("daso", "bsp", "ddcgu", "cyclic", "downpour", "eamsgd"):
    model, before_fl, before_ot = train(scheme)
    params, fl, ot = state(model)
    every = gathered(np.concatenate([params, fl, ot]))
    if not (every == every[0]).all():
        bad = [r for r in range(world) if not (every[r] == every[0]).all()]
        failures.append(f"{scheme}: parameters or buffers differ from rank 0's on ranks {bad} after finish()")
    if (before_fl == before_fl[0]).all():
        failures.append(f"{scheme}: the ranks' statistics were equal before finish(): the test sees no drift")
    want = before_fl.mean(axis=0).astype(np.float32).astype(np.float64)
    err = np.abs(fl - want).max() / max(1.0, np.abs(want).max())
    if err > 1e-6:
        failures.append(f"{scheme}: the floating buffers are not the ranks' mean (relative error {err:.3g})")
    if not (ot == before_ot[0]).all():
        failures.append(f"{scheme}: the batch counts are not rank 0's")
    print(f"rank {rank}: {scheme} on {device.type}: {len(fl)} floating buffer values agree, mean err {err:.2g}", flush=True)

# The control: without the model the scheme cannot see the buffers, and they differ.
model, _, _ = train("bsp", with_model=False)
_, fl, _ = state(model)
every = gathered(fl)
if (every == every[0]).all():
    failures.append("control: without model= the buffers agree anyway: the check above proves nothing")

if node.size > 1 and node_checks[0] == 0:
    failures.append("daso: no batch was node-averaged: the in-node buffer check never ran")

for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
print("buffers: ok" if not failures else f"buffers: {len(failures)} failed", flush=True)
sys.exit(1 if failures else 0)

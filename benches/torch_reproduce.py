"""One rank of a PyTorch reproduction run (benches/reproduce.sh torch-*): a real PyTorch
model trained with one scheme, writing `gradwire train`'s CSV (rank 0) so the same table
and plot code reads it.

    gradwire launch -n 4 --netns --link-gbit 1 -- python3 benches/torch_reproduce.py \\
        --scheme daso --model wide --epochs 12 --csv out.csv

Schemes: ddp (DistributedDataParallel on --backend gloo or gradwire), daso, bsp, downpour,
eamsgd, ddcgu, cyclic (gradwire.torch). Models: convnet (two 3x3 convolutions, 0.3 M
parameters), convnet-bn (the same with BatchNorm after each convolution: buffers every
scheme keeps in step, handed to it with the model) and wide (an MLP 64-4096-2560-10,
10.8 M parameters, where communication matters). Data: the UCI optical handwritten digits that scikit-learn ships (1797 8x8
images; a fixed fifth held out), nothing downloaded. Time is the wall clock of training on
rank 0; the per-epoch evaluation is not timed.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradwire.torch  # noqa: F401 (the backend, and the schemes)
from gradwire.optim import BSP, DASO, ParameterServer, resolve_comm

p = argparse.ArgumentParser()
p.add_argument("--scheme", required=True, choices=["ddp", "daso", "bsp", "downpour", "eamsgd", "ddcgu", "cyclic"])
p.add_argument("--backend", default="gradwire", choices=["gloo", "gradwire"], help="ddp's process group")
p.add_argument("--model", default="wide", choices=["convnet", "convnet-bn", "wide"])
p.add_argument("--epochs", type=int, default=10)
p.add_argument("--min-seconds", type=float, default=0.0, help="train on past --epochs until this much training time has passed (not daso, whose schedule is fixed by its epochs)")
p.add_argument("--batch", type=int, default=32, help="per rank")
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--momentum", type=float, default=0.9)
p.add_argument("--interval", type=int, default=4, help="bsp: K")
p.add_argument("--topk", type=float, default=None, help="bsp: fraction sent")
p.add_argument("--node-interval", type=int, default=0, help="bsp: K1, the average inside the node every K1 steps (0: none)")
p.add_argument("--fetch", type=int, default=1)
p.add_argument("--push", type=int, default=1)
p.add_argument("--background", action="store_true", help="downpour: fetch and push on a thread of their own (Dean et al.'s form)")
p.add_argument("--tau", type=int, default=4)
p.add_argument("--beta", type=float, default=0.9)
p.add_argument("--rule", default="sum", choices=["sum", "mean", "staleness"], help="ddcgu, cyclic: how the servers apply a push")
p.add_argument("--warmup", type=int, default=4, help="daso: warm-up epochs (Heat's default 4)")
p.add_argument("--cooldown", type=int, default=4, help="daso: cool-down epochs (Heat's default 4)")
p.add_argument("--daso-variants", action="store_true", help="daso: gradwire's own variants (cap_phases, sync_average='change') instead of Heat's schedule and arithmetic")
p.add_argument("--slow", default="", help="RANK:FACTOR: that rank's compute takes FACTOR times as long")
p.add_argument("--seed", type=int, default=0, help="the model's initial weights and the data order (recorded in the CSV)")
p.add_argument("--label", default=None)
p.add_argument("--csv", default=None)
a = p.parse_args()
if a.min_seconds and a.scheme == "daso":
    p.error("--min-seconds: DASO's schedule is fixed by --epochs (its total_epochs); give it enough epochs instead")

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
slow_rank, slow = (int(a.slow.split(":")[0]), float(a.slow.split(":")[1])) if a.slow else (-1, 1.0)


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(12345))
    test = order[: len(y) // 5]
    train = order[len(y) // 5 :]
    if a.model.startswith("convnet"):
        x = x.view(-1, 1, 8, 8)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class ConvNet(nn.Module):
    def __init__(self, batch_norm=False):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.n1, self.n2 = (nn.BatchNorm2d(32), nn.BatchNorm2d(64)) if batch_norm else (nn.Identity(), nn.Identity())
        self.f1, self.f2 = nn.Linear(64 * 4 * 4, 256), nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x)))))), 2)
        return self.f2(F.relu(self.f1(torch.flatten(x, 1))))


def make_model():
    torch.manual_seed(a.seed)
    if a.model.startswith("convnet"):
        return ConvNet(batch_norm=a.model == "convnet-bn")
    return nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 2560), nn.ReLU(), nn.Linear(2560, 10))


train_set, test_set = digits()
model = make_model()
n_params = sum(q.numel() for q in model.parameters())
per_epoch = len(train_set) // (a.batch * world)  # each rank's steps (synchronous schemes)

comm = None
if a.scheme == "ddp":
    dist.init_process_group(a.backend)
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=a.momentum)
    step_fn, scheme = opt.step, None
    label = a.label or f"ddp-{a.backend}"
else:
    comm = resolve_comm()
    net = model
    if a.scheme == "daso":
        # Heat's schedule and arithmetic, or (--daso-variants) gradwire's own: phases capped
        # at a quarter of the run, the synchronous phases averaging every rank's change.
        scheme = DASO(
            torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum),
            total_epochs=a.epochs,
            warmup_epochs=a.warmup,
            cooldown_epochs=a.cooldown,
            comm=comm,
            cap_phases=a.daso_variants,
            sync_average="change" if a.daso_variants else "heat",
            model=model,
        )
        scheme.last_batch = per_epoch - 1
    elif a.scheme == "bsp":
        scheme = BSP(torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum), interval=a.interval, topk=a.topk, node_interval=a.node_interval, comm=comm, model=model)
    else:
        options = {"downpour": dict(lr=a.lr, fetch=a.fetch, push=a.push, background=a.background), "eamsgd": dict(lr=a.lr, tau=a.tau, beta=a.beta)}.get(a.scheme, dict(lr=a.lr, rule=a.rule))
        scheme = ParameterServer(model, a.scheme, comm=comm, **options)
    step_fn = scheme.step
    label = a.label or a.scheme

pool = isinstance(scheme, ParameterServer) and scheme.shared_pool
if pool:
    loader = DataLoader(train_set, batch_sampler=scheme.sampler(len(train_set), a.batch, seed=a.seed))
else:
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=a.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=a.batch, sampler=sampler, drop_last=True)
eval_model = make_model() if isinstance(scheme, ParameterServer) or isinstance(scheme, BSP) else None


def evaluate():
    """Test loss and accuracy of the scheme's model (the servers' or the agreed one)."""
    m = net
    if eval_model is not None:
        flat = scheme.current_model()
        at = 0
        with torch.no_grad():
            for q in eval_model.parameters():
                q.copy_(flat[at : at + q.numel()].view_as(q))
                at += q.numel()
            # Buffers (BatchNorm's statistics) are no parameters: this rank's, which the
            # scheme keeps in step with the others'.
            for mine, theirs in zip(eval_model.buffers(), model.buffers()):
                mine.copy_(theirs)
        m = eval_model
    m.eval()
    x, y = test_set.tensors
    with torch.no_grad():
        out = m(x)
    m.train()
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def mean_over_ranks(v):
    if scheme is not None:
        return scheme.end_epoch(v)
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


f = open(a.csv, "w") if a.csv and rank == 0 else None
if f:
    f.write("label,strategy,ranks,epoch,wall_s,train_loss,test_loss,test_acc,mb_sent_per_rank_mean,mb_sent_per_rank_max,model,seed\n")
if rank == 0:
    print(f"{label}: {a.model} ({n_params / 1e6:.1f} M parameters), {world} ranks, {per_epoch} steps per rank per epoch", flush=True)
def go_on(epochs_done):
    """Whether to train another epoch: --epochs not done yet, or (past them) some rank's
    training time still under --min-seconds. Agreed by every rank (their clocks differ)."""
    if epochs_done < a.epochs:
        return True
    if not a.min_seconds:
        return False
    short = float(wall < a.min_seconds)
    if scheme is None:
        t = torch.tensor([short])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0
    return comm.allreduce(np.array([short]), op="max")[0] > 0


wall = 0.0
epoch = -1
while go_on(epoch + 1):
    epoch += 1
    if not pool:
        sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    total, steps = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if not pool and i == per_epoch:
            break
        c0 = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        if scheme is None:
            opt.zero_grad()
        else:
            scheme.zero_grad()
        loss.backward()
        if rank == slow_rank:
            time.sleep((time.perf_counter() - c0) * (slow - 1))
        if isinstance(scheme, BSP):
            scheme.step(i == per_epoch - 1)
        else:
            step_fn()
        total += loss.item()
        steps += 1
    if isinstance(scheme, DASO):
        scheme.epoch_loss_logic(total / max(steps, 1))
        train_loss = total / max(steps, 1)
    else:
        train_loss = mean_over_ranks(total / max(steps, 1))
    wall += time.perf_counter() - t0
    test_loss, acc = evaluate()
    sent = scheme.bytes_sent / 1e6 if scheme is not None else float("nan")
    if rank == 0:
        state = scheme.describe() if scheme is not None else ""
        print(f"epoch {epoch + 1:>3}/{max(a.epochs, epoch + 1)}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  test acc {100 * acc:5.1f} %  wall {wall:7.2f} s  {state}", flush=True)
        if f:
            f.write(f"{label},{a.scheme},{world},{epoch + 1},{wall:.3f},{train_loss:.6f},{test_loss:.6f},{acc:.6f},{sent:.3f},{sent:.3f},{a.model},{a.seed}\n")
            f.flush()
if scheme is not None:
    scheme.finish()
if f:
    f.close()
if dist.is_initialized():
    # Left to the interpreter's exit, gloo's threads once ended a rank with SIGABRT.
    dist.destroy_process_group()
if a.backend == "gloo":
    # torch's gloo can still abort in its own teardown at exit ("terminate called without
    # an active exception"), after the run is done and written: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
sys.exit(0)

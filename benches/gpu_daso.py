"""What DASO, BSP and DDP add to a CUDA model's training step (issue 52's goal: DASO's
step in its cycling phase at most 10 % over the model's step alone):

    gradwire launch -n 2 -- python3 benches/gpu_daso.py [--model resnet50|...|tiny] [--batch 64]
        [--image 224] [--steps 24] [--rounds 3] [--csv FILE] [--device cuda|cpu]

Every rank is a "node" of its own (its network namespace under `gradwire launch --netns`,
else GRADWIRE_HOST_ID=node<rank>), so several ranks can share one GPU: the node-local
steps run on one-rank NCCL communicators and every global step crosses nodes through
gradwire's pinned staging. Each rank trains its own copy of the
model (a torchvision ResNet: BatchNorm buffers included) on synthetic batches already on
the device, four ways in alternating rounds, every way its own model and optimizer:

- alone: the local SGD step, no communication (the ranks still share the GPU, as below);
- daso: gradwire.torch.DASO with Heat's defaults, timed in its cycling phase (one
  untimed warm-up epoch first; each timed epoch ends with DASO's blocking sync);
- bsp: gradwire.torch.BSP, the average every `--interval` batches;
- ddp: torch's DistributedDataParallel on the gradwire backend (an allreduce every step).

A round times `--steps` steps of each way, synchronising the device once at the end: the
mean step time, the slowest rank's. Rank 0 prints each round's figures, then per way the
median over rounds and the median of each round's ratio to `alone` in the same round, and
writes every round's figures to `--csv` (benches/gpu_report.py reads them). DASO's host copies per step (a multiple of the model's
bytes) come from `host_bytes_copied`. `--device cpu` runs the same on the CPU, to try the
script where there is no GPU.
"""

import argparse
import csv
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401 (registers the backend)

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="resnet50")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--image", type=int, default=224)
ap.add_argument("--steps", type=int, default=24)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--interval", type=int, default=4)
ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
ap.add_argument("--csv")
args = ap.parse_args()



def in_own_netns() -> bool:
    """Whether this rank runs in a network namespace other than its parent's: under
    `gradwire launch --netns` the parent is the launcher (`ip netns exec` replaces itself
    with the rank), which stays outside. Unreadable: no."""
    try:
        return os.readlink("/proc/self/ns/net") != os.readlink(f"/proc/{os.getppid()}/ns/net")
    except OSError:
        return False


# A rank in a network namespace of its own is a node by that; otherwise its host identity
# makes it one.
in_netns = in_own_netns()
nodes = "network namespaces" if in_netns else "host identities"
if not in_netns:
    os.environ["GRADWIRE_HOST_ID"] = f"node{os.environ['RANK']}"
dist.init_process_group("gradwire")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)


def sync() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


gen = torch.Generator().manual_seed(1234 + rank)
batches = [
    (torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(device), torch.randint(0, 10, (args.batch,), generator=gen).to(device))
    for _ in range(4)
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    if args.model == "tiny":  # for a try on the CPU, where torchvision may be missing
        c = torch.nn
        return c.Sequential(c.Conv2d(3, 8, 3), c.BatchNorm2d(8), c.ReLU(), c.AdaptiveAvgPool2d(1), c.Flatten(), c.Linear(8, 10)).to(device)
    import torchvision

    return getattr(torchvision.models, args.model)(num_classes=10).to(device)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class Way:
    """One way of stepping: a model, what steps it, and what an epoch's end calls."""

    def __init__(self, name: str, model: torch.nn.Module, step, epoch_end=None, zero=None) -> None:
        self.name, self.model, self.step, self.epoch_end = name, model, step, epoch_end
        self.zero = zero

    def epoch(self, steps: int) -> float:
        """Runs `steps` steps; returns the mean step time in seconds."""
        losses = []
        sync()
        start = time.perf_counter()
        for i in range(steps):
            x, y = batches[i % len(batches)]
            self.zero()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.step(i, steps)
            losses.append(loss.detach())
        sync()
        elapsed = (time.perf_counter() - start) / steps
        if self.epoch_end is not None:
            self.epoch_end(torch.stack(losses).mean().item())
        return elapsed


ways = []

m = make_model()
o = sgd(m)
ways.append(Way("alone", m, lambda i, n, o=o: o.step(), zero=o.zero_grad))

m = make_model()
daso = gradwire.torch.DASO(sgd(m), total_epochs=args.rounds + 2, warmup_epochs=1, cooldown_epochs=1, model=m)


def daso_step(i: int, n: int) -> None:
    daso.last_batch = n - 1
    daso.step()


ways.append(Way("daso", m, daso_step, epoch_end=daso.epoch_loss_logic, zero=daso.zero_grad))

m = make_model()
bsp = gradwire.torch.BSP(sgd(m), interval=args.interval, model=m)
ways.append(Way("bsp", m, lambda i, n: bsp.step(last_of_epoch=i == n - 1), zero=bsp.zero_grad))

m = make_model()
ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[device.index] if device.type == "cuda" else None)
o_ddp = sgd(ddp)
ways.append(Way("ddp", ddp, lambda i, n, o=o_ddp: o.step(), zero=o_ddp.zero_grad))

model_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
if rank == 0:
    print(f"{args.model}, batch {args.batch} of {args.image}x{args.image}, {model_bytes / 2**20:.1f} MiB of parameters, {world} ranks on {device_name}, nodes by {nodes}", flush=True)

# Warm-up: each way's first steps (cuDNN's choices, NCCL's setup) and DASO's warm-up epoch.
for way in ways:
    way.epoch(args.steps if way.name == "daso" else 2)

times = {way.name: [] for way in ways}
copied_before = daso.host_bytes_copied
for r in range(args.rounds):
    for way in ways:
        mine = torch.tensor([way.epoch(args.steps)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the step is the slowest rank's
        times[way.name].append(mine.item())
        if rank == 0:
            print(f"round {r} {way.name}: {mine.item() * 1e3:.2f} ms a step", flush=True)
daso_copies = (daso.host_bytes_copied - copied_before) / (args.rounds * args.steps) / model_bytes

if rank == 0:
    print("way    ms/step (median)  over alone (median of rounds)")
    for way in ways:
        ratios = [t / a for t, a in zip(times[way.name], times["alone"])]
        print(f"{way.name:6} {statistics.median(times[way.name]) * 1e3:16.2f}  {100 * (statistics.median(ratios) - 1):+.1f} %")
    print(f"daso host copies per step: {daso_copies:.3f} x the model's bytes")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["device", "torch", "model", "batch", "image", "steps", "ranks", "nodes", "round", "way", "ms_per_step", "daso_host_copies_per_step"])
            for r in range(args.rounds):
                for way in ways:
                    w.writerow([device_name, torch.__version__, args.model, args.batch, args.image, args.steps, world, nodes, r, way.name, f"{times[way.name][r] * 1e3:.4f}", f"{daso_copies:.3f}"])
for scheme in (daso, bsp):
    scheme.finish()
dist.destroy_process_group()

#!/usr/bin/env python3
"""ddp_overhead.py -- what DDP on the gradwire backend adds to a training step, against gloo
and against the bare allreduce of the same bytes, in one run (one process per rank).

Each round runs, one after another on the same machine and in the same processes:

    local       the model's step with no communication (forward, backward, SGD step)
    ddp_nocomm  the same step under DDP whose communication hook does nothing: DDP's own
                cost (bucket copies, hooks), the same on every backend
    ddp_gloo    the same step under DDP on a gloo group
    ddp_gradwire the same step under DDP on the gradwire default group
    ar_gradwire one allreduce of all gradient bytes through gradwire's C call (Comm, no torch)
    ar_gloo     the same allreduce on the gloo group
    *_view      the three DDP variants with gradient_as_bucket_view=True: the gradients are
                views into DDP's buckets, so DDP copies no gradient in or out of a bucket

Every figure is the slowest rank's mean over --steps steps. Each round runs every variant
once, in an order rotated from round to round (so no variant always follows another), and
a first round warms everything up and is not recorded; the machine's drift hits all alike. DDP's overhead is ddp - local; the goal (issue 53)
compares it with ar_gradwire. Before the figures count, the DDP replicas on gloo and on
gradwire must hold identical parameters. Writes one CSV line per round and variant
(benches/ddp_overhead_report.py makes the report from it):

    GRADWIRE_LIB=target/release/libgradwire.so PYTHONPATH=python OMP_NUM_THREADS=1 \\
    target/release/gradwire launch -n 2 -- python3 benches/ddp_overhead.py --csv ddp.csv
"""
import argparse
import copy
import csv
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch  # registers the backend

VARIANTS = ("local", "ddp_nocomm", "ddp_gloo", "ddp_gradwire", "ar_gradwire", "ar_gloo", "ddp_nocomm_view", "ddp_gloo_view", "ddp_gradwire_view")


def mlp(width, depth):
    """An MLP of `depth` hidden layers `width` wide on 1024 inputs and outputs."""
    layers, inputs = [], 1024
    for _ in range(depth):
        layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
        inputs = width
    layers.append(torch.nn.Linear(inputs, 1024))
    return torch.nn.Sequential(*layers)


def no_communication(state, bucket):
    """A DDP communication hook that leaves each bucket as it is."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=3, help="hidden layers (3 x 2048: 12.6 M parameters)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", help="write the figures here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gradwire")
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = mlp(args.width, args.depth)
    params = sum(p.numel() for p in model.parameters())
    on = {
        "local": model,
        "ddp_nocomm": DDP(copy.deepcopy(model), process_group=dist.group.WORLD),
        "ddp_gloo": DDP(copy.deepcopy(model), process_group=gloo),
        "ddp_gradwire": DDP(copy.deepcopy(model), process_group=dist.group.WORLD),
    }
    for kind in ("ddp_nocomm", "ddp_gloo", "ddp_gradwire"):
        on[kind + "_view"] = DDP(copy.deepcopy(model), process_group=on[kind].process_group, gradient_as_bucket_view=True)
    for kind in ("ddp_nocomm", "ddp_nocomm_view"):
        on[kind].register_comm_hook(None, no_communication)
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in on.items()}
    data = torch.randn(args.batch, 1024, generator=torch.Generator().manual_seed(args.seed + rank))
    target = torch.randn(args.batch, 1024, generator=torch.Generator().manual_seed(args.seed + 1000 + rank))
    grads = torch.randn(params)
    comm = gradwire.torch.comm_of()

    def step(kind):
        # The allreduces sum `grads` in place: it grows 2x a call, from fresh values each block.
        if kind == "ar_gradwire":
            comm.allreduce(grads)
        elif kind == "ar_gloo":
            dist.all_reduce(grads, group=gloo)
        else:
            optimizers[kind].zero_grad()
            torch.nn.functional.mse_loss(on[kind](data), target).backward()
            optimizers[kind].step()

    rows = []
    for r in range(-1, args.rounds):  # round -1 warms up (DDP's first steps build its buckets)
        shift = r % len(VARIANTS)
        for kind in VARIANTS[shift:] + VARIANTS[:shift]:
            grads.normal_()
            step(kind)
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(kind)
            mean = torch.tensor([(time.perf_counter() - t0) / args.steps * 1e3], dtype=torch.float64)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=gloo)
            if r >= 0:
                rows.append((r, kind, mean.item()))
    # The DDP replicas must agree with each other: a fast wrong step is no result. Two ranks
    # add in one order on both backends (bit-identical); more may add in other orders.
    for gloo_kind, gradwire_kind in (("ddp_gloo", "ddp_gradwire"), ("ddp_gloo_view", "ddp_gradwire_view")):
        a, b = (torch.cat([p.detach().reshape(-1) for p in on[k].parameters()]) for k in (gloo_kind, gradwire_kind))
        same = torch.equal(a, b) if world == 2 else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        if not same:
            raise SystemExit(f"rank {rank}: {gradwire_kind} and {gloo_kind} left different parameters (max diff {(a - b).abs().max().item():.3g})")
    if rank == 0:
        meta = dict(world=world, params=params, batch=args.batch, steps=args.steps, torch=torch.__version__, cores=os.cpu_count())
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["round", "variant", "ms", *meta])
                for row in rows:
                    w.writerow([*row, *meta.values()])
        ms = {k: {r: t for r, v, t in rows if v == k} for k in VARIANTS}
        med = {k: statistics.median(ms[k].values()) for k in VARIANTS}
        print(f"# ddp_overhead: W={world}, {params / 1e6:.1f} M parameters, batch {args.batch}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
        for k in VARIANTS:
            print(f"{k:>14} {med[k]:8.2f} ms (median of the rounds)")
        # As the report computes them: per round, paired, then the median over the rounds.
        for k in (v for v in VARIANTS if v.startswith("ddp_")):
            over = [ms[k][r] - ms["local"][r] for r in ms[k]]
            ratio = [(ms[k][r] - ms["local"][r]) / ms["ar_gradwire"][r] for r in ms[k]]
            print(f"{k} overhead {statistics.median(over):.2f} ms = {statistics.median(ratio):.2f}x ar_gradwire (median of the rounds' paired values)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

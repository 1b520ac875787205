"""One rank of the PyTorch-level fault matrix (python/tests/fault_matrix.py starts it as a
plain process, under torchrun or under `gradwire launch`):

    fault_rank.py SCENARIO FAULT BACKEND DIR

SCENARIO is what the ranks are doing when rank 1 faults at its STEP-th step:
    ddp        DistributedDataParallel training of a small MLP
    ddp_hook   the same with torch's own allreduce communication hook
    async      all_reduce(async_op=True) calls, four at a time, waited in reverse order
    daso, bsp  training under gradwire's DASO / BSP optimizer
    ps         training under gradwire's ParameterServer ("ddcgu")
FAULT is kill (SIGKILL) or stop (SIGSTOP); BACKEND is gradwire or gloo (the same script
on torch's own backend, for comparison). Before it faults, rank 1 writes its pid and the
time to DIR/fault. A survivor that catches an error prints one line

    FAULT-RESULT rank R caught TYPE after S s: MESSAGE

(S: seconds since the fault), waits until every survivor has caught one (at most 10 s: a
survivor that left at once would be lost in turn to a peer still waiting on it) and exits 3.
A survivor that trains on to the end prints "FAULT-RESULT rank R no error" and exits 0; a
rank that fails before rank 1 faults (a deadline passed on a loaded machine) prints
"FAULT-RESULT rank R failed before the fault: TYPE: MESSAGE" and exits 4.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import gradwire.torch  # noqa: F401  (registers the backend)
from gradwire.optim import BSP, DASO, ParameterServer

STEP = 5  # rank 1 faults at this step, after every rank has communicated
STEPS = 400  # a survivor that gets this far has missed the fault
VICTIM = 1

scenario, fault, backend, where = sys.argv[1:5]
torch.set_num_threads(1)
# gloo's deadline is torch's timeout; gradwire's is GRADWIRE_TIMEOUT_MS (the driver sets both).
deadline_s = int(os.environ.get("GRADWIRE_TIMEOUT_MS", "3000")) / 1000
# gradwire's group meets in torch's store under the group's timeout, which is not its
# deadline: a long one lets a rank that starts late on a loaded machine still join.
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(1234)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(step):
    g = torch.Generator().manual_seed(rank * 100_000 + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def fault_here(step):
    if rank == VICTIM and step == STEP:
        with open(os.path.join(where, "fault.tmp"), "w") as f:
            f.write(f"{os.getpid()} {time.time()}")
        os.rename(os.path.join(where, "fault.tmp"), os.path.join(where, "fault"))
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def loss_of(net, step):
    x, y = batch(step)
    return nn.functional.cross_entropy(net(x), y)


def train():
    if scenario in ("ddp", "ddp_hook"):
        ddp = nn.parallel.DistributedDataParallel(model)
        if scenario == "ddp_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(STEPS):
            fault_here(step)
            opt.zero_grad()
            loss_of(ddp, step).backward()
            opt.step()
    elif scenario == "async":
        for step in range(STEPS):
            fault_here(step)
            works = [dist.all_reduce(torch.full((1000 * (i + 1),), float(rank)), async_op=True) for i in range(4)]
            for w in reversed(works):
                w.wait()
    elif scenario in ("daso", "bsp"):
        local = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = DASO(local, total_epochs=STEPS // 10, warmup_epochs=1, cooldown_epochs=1) if scenario == "daso" else BSP(local, interval=2)
        for step in range(STEPS):
            fault_here(step)
            last = step % 10 == 9
            if scenario == "daso":
                opt.last_batch = 9
            opt.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            if scenario == "daso":
                opt.step()
                if last:
                    opt.epoch_loss_logic(loss.detach())
            else:
                opt.step(last_of_epoch=last)
    elif scenario == "ps":
        ps = ParameterServer(model, "ddcgu", lr=0.01)
        step = 0
        for _epoch in range(STEPS):
            while ps.claim_batch(4 * world):
                fault_here(step)
                ps.zero_grad()
                loss_of(model, step).backward()
                ps.step()
                step += 1
            ps.end_epoch(0.0)
            if step >= STEPS:
                break
    else:
        raise SystemExit(f"fault_rank.py: unknown scenario {scenario!r}")


try:
    dist.init_process_group(backend, timeout=timedelta(seconds=deadline_s))
    train()
except Exception as e:  # noqa: BLE001 (what the survivor caught is the result)
    message = str(e).splitlines()[0] if str(e) else repr(e)
    try:
        with open(os.path.join(where, "fault")) as f:
            faulted = float(f.read().split()[1])
    except FileNotFoundError:
        print(f"FAULT-RESULT rank {rank} failed before the fault: {type(e).__name__}: {message}", flush=True)
        os._exit(4)
    print(f"FAULT-RESULT rank {rank} caught {type(e).__name__} after {time.time() - faulted:.2f} s: {message}", flush=True)
    open(os.path.join(where, f"caught.{rank}"), "w").close()
    until = time.monotonic() + 10
    while sum(n.startswith("caught.") for n in os.listdir(where)) < world - 1 and time.monotonic() < until:
        time.sleep(0.01)
    os._exit(3)
print(f"FAULT-RESULT rank {rank} no error", flush=True)
os._exit(0)

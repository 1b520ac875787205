"""One training job as a cluster launcher starts it (torchrun across nodes, with restarts),
with no gradwire variable in its environment: everything comes from the launcher's own
variables (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    launcher_job.py [--die-at STEP]

Each rank checks that:
- init_process_group("gradwire") forms the group, and gradwire sees the launcher's nodes
  (its node-local group has LOCAL_WORLD_SIZE ranks);
- an allreduce of known values sums exactly;
- DDP on gradwire and DDP on a gloo group of the same job train the same model on the
  same data to the same losses (1e-5 relative) and identical replicas (--no-gloo: DDP
  on gradwire alone, replicas identical);
- DASO (gradwire.torch.DASO, nodes as the launcher placed the ranks) trains and leaves
  every rank's parameters identical after finish();
- destroy_process_group() and a new init_process_group("gradwire") in the same process
  form a working group again.

--die-at STEP: in the first attempt (TORCHELASTIC_RESTART_COUNT 0 on its node) rank 1
SIGKILLs itself at DDP step STEP, mid-training; torchrun then stops the others and starts
a new attempt, which must train to the end. (Across nodes, torch 2.15's own gloo cannot form
a group in a restarted attempt: its ranks read the dead attempt's addresses from the store
torchrun keeps; a restarted job runs with --no-gloo.) Prints "launcher job: ok (rank R,
...)" per rank.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch  # registers the backend
from gradwire.torch import DASO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_problem  # noqa: E402

STEPS = 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--no-gloo", action="store_true")
    args = ap.parse_args()
    leaked = sorted(k for k in os.environ if k.startswith("GRADWIRE_") and k != "GRADWIRE_LIB")
    if leaked:
        raise SystemExit(f"gradwire variables in the job's environment: {leaked}")
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gradwire")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    node = gradwire.torch.comm_of().node_local()
    if node.size != per_node:
        raise SystemExit(f"rank {rank}: gradwire's node has {node.size} ranks, the launcher put {per_node} on it")

    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((1000,), world * (world + 1) / 2)):
        raise SystemExit(f"rank {rank}: allreduce gave {x[:4].tolist()}")

    gloo = None if args.no_gloo else dist.new_group(backend="gloo")
    results = {}
    for name, group in ((("gloo", gloo),) if gloo else ()) + (("gradwire", None),):
        model = ddp_problem.model()
        ddp = DDP(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        die = args.die_at if (name == "gradwire" and attempt == 0 and rank == 1) else -1
        results[name] = (fit(ddp, opt, rank, world, gloo, die), torch.cat([p.detach().flatten() for p in model.parameters()]))
    gw_losses, gw_params = results["gradwire"]
    if gloo is not None:
        gloo_losses = results["gloo"][0]
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(gloo_losses, gw_losses))
        if worst > 1e-5:
            raise SystemExit(f"rank {rank}: DDP losses differ from gloo's by {worst:.2e} relative")
    same(gw_params, "DDP replica")

    model = ddp_problem.model()
    daso = DASO(torch.optim.SGD(model.parameters(), lr=0.05), total_epochs=4, warmup_epochs=1, cooldown_epochs=1, model=model)
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(4):
        daso.last_batch = 9
        total = 0.0
        for _ in range(10):
            xb = torch.randn(32, 16, generator=g)
            loss = ((model(xb) - xb.sum(1, keepdim=True).sin()) ** 2).mean()
            daso.zero_grad()
            loss.backward()
            daso.step()
            total += loss.item()
        daso.epoch_loss_logic(total / 10)
    daso.finish()
    same(torch.cat([p.detach().flatten() for p in model.parameters()]), "DASO parameters")

    dist.destroy_process_group()
    dist.init_process_group("gradwire")
    y = torch.ones(64)
    dist.all_reduce(y)
    if not torch.equal(y, torch.full((64,), float(world))):
        raise SystemExit(f"rank {rank}: allreduce after a new init_process_group gave {y[:4].tolist()}")
    print(f"launcher job: ok (rank {rank}, {world} ranks, {per_node} per node, restart count {attempt} on this node)", flush=True)
    dist.destroy_process_group()


def fit(ddp, opt, rank, world, loss_group, die_at):
    """ddp_problem.fit, with this rank killed at step `die_at` (if not negative)."""
    if die_at < 0:
        return ddp_problem.fit(ddp, opt, STEPS, rank, world, loss_group=loss_group)
    ddp_problem.fit(ddp, opt, die_at, rank, world, loss_group=loss_group)
    os.kill(os.getpid(), signal.SIGKILL)


def same(t, what):
    """Fails unless `t` is rank 0's, bit for bit."""
    ref = t.clone()
    dist.broadcast(ref, src=0)
    if not torch.equal(ref, t):
        raise SystemExit(f"rank {dist.get_rank()}: {what} differ from rank 0's by {(ref - t).abs().max().item():.2e}")


if __name__ == "__main__":
    main()

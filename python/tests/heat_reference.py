"""Reference run of Heat's OWN DASO (`heat.optim.DASO` + `heat.nn.DataParallelMultiGPU`,
imported from the installed PyPI package `heat`, not copied) on the CPU, recording Heat's
schedule per batch and the parameters at every epoch end, as JSON, for comparison with
gradwire's DASO (src/train/daso.rs, python/gradwire/optim.py).

Install (tested: heat 1.8.0, mpi4py 4.1.2, the PyPI `mpich` wheel 5.0.2, scipy 1.17.1,
torch 2.15.0 CPU threads; Heat pins torch<2.11.1 and torchvision, hence --no-deps; the
system torch is used as is, through --system-site-packages):

    python3 -m venv --system-site-packages /tmp/heat-venv
    /tmp/heat-venv/bin/pip install --no-deps heat==1.8.0
    /tmp/heat-venv/bin/pip install mpi4py mpich 'scipy~=1.14'

(Debian's `apt-get install mpich libmpich-dev` gives MPICH 4.0.2, but the mpi4py binary
wheel looks for `libmpi.so.12`, which Debian names `libmpich.so.12`; the `mpich` wheel
above ships both the library and `mpiexec`. Building mpi4py from source against Debian's
MPICH, `pip install --no-binary mpi4py mpi4py`, would work too.)

Run (2 "nodes" x 2 ranks, 4 MPI ranks on localhost; 15-21 s wall here on 2 shared cores, ~3 s of it training):

    /tmp/heat-venv/bin/mpiexec -n 4 /tmp/heat-venv/bin/python \
        python/tests/heat_reference.py --out /tmp/heat_ref.json \
        --total-epochs 12 --warmup-epochs 2 --cooldown-epochs 2 --max-global-skips 8 \
        --batches 20 --losses 1,1,1,1,1,1,1,1,1,1,1,1

Several runs in one job (one MPI start and one node group for all, each run from its own
seed and with a DASO of its own): their arguments one after the other, separated by
`--then`, each with its own `--out` (`--gpus-per-node` and `--port-base` alike in all).

`--losses` (one value per epoch) is what every rank hands to `epoch_loss_logic`; a
constant sequence makes Heat's plateau detector fire on every third cycling epoch. Without
it the epoch's mean training loss of each rank is handed over (Heat averages it over all
ranks). See --help for the other DASO arguments.

What is stubbed, and only that (the DASO code itself runs unchanged):
- "2 nodes x G ranks": Heat takes the GPUs per node from `torch.cuda.device_count()`
  (dp_optimizer.py:192, data_parallel.py:339) and puts rank r on node r // G (global
  groups {i, G+i, 2G+i, ...}). We set `torch.cuda.device_count = lambda: G`
  (--gpus-per-node, default 2) and start W = nodes*G ranks, so ranks 0..G-1 are node 0,
  G..2G-1 node 1, ... `torch.cuda.set_device` is a no-op, and DASO's `device` attribute
  (set to "cuda:<local rank>" at dp_optimizer.py:215 and used only to allocate the send
  buffer at :632) is set to "cpu" after construction.
- The node-local torch.distributed process group: Heat expects the user to create one
  per node (its test: `init_process_group("nccl", rank=local_rank, world_size=G)`,
  MASTER_ADDR=localhost). Here: gloo, `tcp://127.0.0.1:<port_base + node>`, one per
  emulated node.
- DDP: `DataParallelMultiGPU` wraps the model in `DistributedDataParallel(module,
  device_ids=[local_rank])`, which DDP refuses for a CPU module; the name
  `torch.nn.parallel.DistributedDataParallel` is replaced by a subclass that drops
  `device_ids` (still a DDP, so Heat's `isinstance(self.module, tDDP)` flag logic runs).
- torchvision: `import heat` imports torchvision (vision transforms, MNIST wrapper), which
  DASO does not use and which is not installed next to this torch; if it cannot be
  imported, a stub module with the three names Heat touches at import is put in
  `sys.modules`.
MPI itself is real (mpi4py + MPICH), including Heat's bf16/fp16 MPI sum operators.

JSON (written by rank 0):
  args              the command line's values
  heat_version, mpi_library, torch_version
  world_size, gpus_per_node, nodes
  initial_params    [rank][flat params] after DataParallelMultiGPU (every rank)
  param_names       [[name, numel], ...] in flattening order (named_parameters of the DDP)
  batches           one record per batch (rank 0's view; schedule values are the same on
                    every rank): epoch, batch, daso_epoch/current_batch before step(),
                    global_skip, local_skip, batches_to_wait in effect for this batch,
                    send_mod and send_mod_m1 before and after step(), grad_sync (the DDP
                    require_backward_grad_sync flag at this batch's forward, i.e. whether
                    its gradient was averaged in the node), loss (rank 0's batch loss),
                    and with --params-every-batch params [rank][flat params] after step()
  epochs            one record per epoch: epoch, loss_fed (value handed to
                    epoch_loss_logic on rank 0), schedule_after (gs, ls, btw for the next
                    epoch), stability {best, num_bad_epochs}, params [rank][flat params]
                    after the epoch's last step, buffers [rank][flat buffers] if any
  final_params      [rank][flat params] at the end (= last epoch's)
Floats are the float32 values converted exactly to doubles.
"""

import argparse
import json
import os
import sys
import time
import types
import warnings

import torch


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON path (written by rank 0)")
    p.add_argument("--total-epochs", type=int, default=12)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--cooldown-epochs", type=int, default=2)
    p.add_argument("--max-global-skips", type=int, default=8)
    p.add_argument("--downcast-type", choices=["bfloat16", "half", "float"], default="bfloat16")
    p.add_argument("--stability-level", type=float, default=0.05)
    p.add_argument("--sending-chunk-size", type=int, default=10_000_000)
    p.add_argument("--skip-reduction-factor", type=int, default=2)
    p.add_argument("--local-skip-factor", type=int, default=4)
    p.add_argument("--use-mpi-groups", type=int, choices=[0, 1], default=1)
    p.add_argument("--batches", type=int, default=20, help="batches per epoch per rank")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per emulated node")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batchnorm", action="store_true", help="add a BatchNorm1d layer")
    p.add_argument(
        "--losses",
        default="",
        help="comma-separated loss per epoch handed to epoch_loss_logic (default: the "
        "epoch's mean training loss of each rank)",
    )
    p.add_argument("--port-base", type=int, default=29610)
    p.add_argument("--verbose", action="store_true", help="DASO's own verbose prints")
    p.add_argument(
        "--params-every-batch",
        action="store_true",
        help="also record every rank's flat params after each step() (batches[i].params)",
    )
    return p.parse_args(argv)


def parse_runs(argv):
    """The arguments of each run: `argv` split at `--then`."""
    runs, part = [], []
    for a in argv + ["--then"]:
        if a == "--then":
            runs.append(parse_args(part))
            part = []
        else:
            part.append(a)
    for args in runs[1:]:
        if (args.gpus_per_node, args.port_base) != (runs[0].gpus_per_node, runs[0].port_base):
            raise SystemExit("--gpus-per-node and --port-base must be alike in every run of a job")
    return runs


def stub_torchvision():
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:
        pass
    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    trtr = types.ModuleType("torchvision.transforms.transforms")
    trtr.__all__ = []
    tr.transforms = trtr
    tr.Compose = type("Compose", (), {})
    ds = types.ModuleType("torchvision.datasets")
    ds.MNIST = type("MNIST", (), {})
    tv.transforms, tv.datasets = tr, ds
    sys.modules.update(
        {
            "torchvision": tv,
            "torchvision.transforms": tr,
            "torchvision.transforms.transforms": trtr,
            "torchvision.datasets": ds,
        }
    )
    return True


class Net(torch.nn.Module):
    def __init__(self, batchnorm):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16) if batchnorm else None
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.fc2(torch.tanh(h))


def flat_params(module):
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in module.parameters()])


def flat_buffers(module):
    bufs = [b.detach().reshape(-1).to(torch.float64) for b in module.buffers()]
    return torch.cat(bufs) if bufs else torch.zeros(0, dtype=torch.float64)


def main():
    runs = parse_runs(sys.argv[1:])
    args = runs[0]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit.script in Heat
    stubbed_tv = stub_torchvision()

    import heat as ht
    from heat.core.communication import MPI

    world = ht.MPI_WORLD
    rank, size = world.rank, world.size
    G = args.gpus_per_node
    if G < 2 or size % G != 0:
        raise SystemExit(f"need W % G == 0 and G >= 2 (Heat's DASO needs >1 GPU per node); W={size} G={G}")
    nodes, node, local_rank = size // G, rank // G, rank % G

    # --- CPU stubs for what Heat reads of CUDA (see the module docstring) ---
    torch.cuda.device_count = lambda: G
    torch.cuda.set_device = lambda *a, **k: None
    _RealDDP = torch.nn.parallel.DistributedDataParallel

    class CpuDDP(_RealDDP):
        def __init__(self, module, device_ids=None, **kw):
            super().__init__(module, **kw)

    torch.nn.parallel.DistributedDataParallel = CpuDDP

    torch.distributed.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{args.port_base + node}",
        rank=local_rank,
        world_size=G,
    )
    for args in runs:
        run(args, ht, MPI, world, G, nodes, stubbed_tv, _RealDDP)
    torch.distributed.destroy_process_group()


def run(args, ht, MPI, world, G, nodes, stubbed_tv, _RealDDP):
    """One run of Heat's DASO with `args`, written to args.out by rank 0."""
    rank, size = world.rank, world.size
    # --- model, local optimizer, Heat's DASO, Heat's DataParallelMultiGPU ---
    torch.manual_seed(args.seed)  # same on every rank: Heat re-inits params after DDP
    model = Net(args.batchnorm)
    local_opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dtype = {"bfloat16": torch.bfloat16, "half": torch.half, "float": torch.float}[args.downcast_type]
    daso = ht.optim.DASO(
        local_optimizer=local_opt,
        total_epochs=args.total_epochs,
        warmup_epochs=args.warmup_epochs,
        cooldown_epochs=args.cooldown_epochs,
        stability_level=float(args.stability_level),
        max_global_skips=args.max_global_skips,
        sending_chunk_size=args.sending_chunk_size,
        downcast_type=dtype,
        use_mpi_groups=bool(args.use_mpi_groups),
        skip_reduction_factor=args.skip_reduction_factor,
        local_skip_factor=args.local_skip_factor,
        verbose=args.verbose,
    )
    daso.device = "cpu"
    dp_model = ht.nn.DataParallelMultiGPU(model, daso)
    assert isinstance(dp_model.module, _RealDDP)

    # --- fixed synthetic data per rank ---
    g = torch.Generator().manual_seed(args.seed * 1000 + 7)
    w_true = torch.randn(8, 4, generator=g)
    g = torch.Generator().manual_seed(args.seed * 1000 + 100 + rank)
    X = torch.randn(args.batches, args.batch_size, 8, generator=g)
    Y = X @ w_true + 0.1 * torch.randn(args.batches, args.batch_size, 4, generator=g)
    loss_fn = torch.nn.MSELoss()
    forced = [float(v) for v in args.losses.split(",")] if args.losses else None
    if forced is not None and len(forced) < args.total_epochs:
        raise SystemExit(f"--losses needs {args.total_epochs} values, got {len(forced)}")

    def gather_flat(t):
        return world.handle.gather(t.tolist(), root=0)

    names = [[n, p.numel()] for n, p in dp_model.module.named_parameters()]
    initial = gather_flat(flat_params(model))
    batches, epochs = [], []
    t0 = time.time()
    daso.last_batch = args.batches - 1  # as Heat's test: index of the last batch
    for epoch in range(args.total_epochs):
        dp_model.train()
        losses = []
        for b in range(args.batches):
            rec = {
                "epoch": epoch,
                "batch": b,
                "daso_epoch": daso.epoch,
                "current_batch": daso.current_batch,
                "global_skip": daso.global_skip,
                "local_skip": daso.local_skip,
                "batches_to_wait": daso.batches_to_wait,
                "send_mod": daso._send_mod,
                "send_mod_m1": daso._send_mod_m1,
                "grad_sync": bool(dp_model.module.require_backward_grad_sync),
            }
            daso.zero_grad()
            out = dp_model(X[b])
            loss = loss_fn(out, Y[b])
            loss.backward()
            daso.step()
            rec["send_mod_after"] = daso._send_mod
            rec["send_mod_m1_after"] = daso._send_mod_m1
            rec["loss"] = float(loss.detach())
            if args.params_every_batch:
                rec["params"] = gather_flat(flat_params(model))
            losses.append(rec["loss"])
            batches.append(rec)
        fed = forced[epoch] if forced is not None else sum(losses) / len(losses)
        daso.epoch_loss_logic(fed)
        params = gather_flat(flat_params(model))
        bufs = gather_flat(flat_buffers(model))
        epochs.append(
            {
                "epoch": epoch,
                "loss_fed": fed,
                "schedule_after": [daso.global_skip, daso.local_skip, daso.batches_to_wait],
                "stability": {
                    "best": daso.stability.best,
                    "num_bad_epochs": daso.stability.num_bad_epochs,
                },
                "params": params,
                "buffers": bufs if any(len(x) for x in (bufs or [])) else None,
            }
        )
    elapsed = time.time() - t0
    if rank == 0:
        doc = {
            "args": vars(args),
            "heat_version": ht.__version__,
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
            "torch_version": torch.__version__,
            "torchvision_stubbed": stubbed_tv,
            "world_size": size,
            "gpus_per_node": G,
            "nodes": nodes,
            "param_names": names,
            "initial_params": initial,
            "batches": batches,
            "epochs": epochs,
            "final_params": epochs[-1]["params"] if epochs else initial,
            "train_seconds": elapsed,
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, args.out)
        same = all(p == epochs[-1]["params"][0] for p in epochs[-1]["params"])
        print(
            f"heat_reference: wrote {args.out} ({len(batches)} batches, {len(epochs)} epochs, "
            f"{elapsed:.1f}s, final params identical on all ranks: {same})"
        )


if __name__ == "__main__":
    main()

"""gradwire's DASO against Heat's own (`heat.optim.DASO`, run by heat_reference.py with real
MPI): the same model, data, starting point and arguments on 2 nodes of 2 ranks, compared
batch by batch (global skip, local skip, batches to wait) and epoch by epoch (every rank's
parameters, within a relative 1e-5).

    heat_compare.py drive CONFIG [CONFIG ...]    # both runs and the comparison
    heat_compare.py gradwire HEAT_JSON:OUT_DIR:VARIANT[,VARIANT...] ...  # one rank of gradwire's runs (under gradwire launch)

CONFIG is one of CONFIGS. `drive` needs Heat, mpi4py and an MPI next to the Python that
runs it (`.ci/run` installs them: heat without its dependencies, mpi4py, the PyPI mpich
wheel, scipy), GRADWIRE_BIN (the gradwire command), and root for the namespace nodes.
Every configuration runs twice on gradwire: with the data on gradwire's host buffers
(VARIANT "heat") and with the data moved by the Python caller (`device_resident=True`,
VARIANT "device", the path a CUDA model takes, here on CPU tensors), one after the other in
one job (each from Heat's starting point, with a DASO of its own). Heat's runs of every
configuration share one MPI job, and gradwire's one launch. Prints one line per
run and "heat compare: ok" when every one matches. A control runs the first configuration
once more with gradwire's `sync_average="change"`, which must not match: the comparison can
fail.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> heat_reference.py arguments. Constant losses make Heat's plateau detector fire on
# every third cycling epoch: 16 epochs reach the reset from gs = 1 to max_global_skips.
CONFIGS = {
    "bf16": ["--total-epochs", "8", "--warmup-epochs", "2", "--cooldown-epochs", "2", "--losses", "1,1,1,1,1,1,1,1"],
    "fp16": ["--total-epochs", "8", "--warmup-epochs", "2", "--cooldown-epochs", "2", "--downcast-type", "half", "--losses", "1,1,1,1,1,1,1,1"],
    "max3": ["--total-epochs", "16", "--warmup-epochs", "1", "--cooldown-epochs", "1", "--max-global-skips", "3", "--losses", ",".join(["1"] * 16)],
    "reset": ["--total-epochs", "16", "--warmup-epochs", "1", "--cooldown-epochs", "1", "--max-global-skips", "8", "--losses", ",".join(["1"] * 16)],
    "chunked": ["--total-epochs", "6", "--warmup-epochs", "1", "--cooldown-epochs", "1", "--sending-chunk-size", "130", "--losses", "1,0.5,0.4,0.3,0.3,0.3"],
}
RTOL = 1e-5


def gradwire_rank(plans):
    """One rank of gradwire's runs: for each HEAT_JSON:OUT_DIR:VARIANTS, Heat's configuration
    once per variant (comma-separated), each written to OUT_DIR/gradwire-VARIANT.json by
    rank 0."""
    for plan in plans:
        heat_json, out_dir, variants = plan.split(":")
        with open(heat_json) as f:
            ref = json.load(f)
        for variant in variants.split(","):
            gradwire_run(ref, os.path.join(out_dir, f"gradwire-{variant}.json"), variant)


def gradwire_run(ref, out_json, variant):
    """One run of Heat's configuration `ref` (heat_reference.py's model and data; Heat's
    starting parameters) on a model and DASO of its own."""
    import torch

    import gradwire.heat as ht

    args = ref["args"]
    torch.set_num_threads(1)
    rank = ht.MPI_WORLD.rank

    class Net(torch.nn.Module):  # heat_reference.py's
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    model = Net()
    start = torch.tensor(ref["initial_params"][rank], dtype=torch.float32)
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(start[at : at + p.numel()].view_as(p))
            at += p.numel()
    local = torch.optim.SGD(model.parameters(), lr=args["lr"])
    dtype = {"bfloat16": torch.bfloat16, "half": torch.half, "float": torch.float}[args["downcast_type"]]
    daso = ht.optim.DASO(
        local_optimizer=local,
        total_epochs=args["total_epochs"],
        warmup_epochs=args["warmup_epochs"],
        cooldown_epochs=args["cooldown_epochs"],
        stability_level=float(args["stability_level"]),
        max_global_skips=args["max_global_skips"],
        sending_chunk_size=args["sending_chunk_size"],
        downcast_type=dtype,
        skip_reduction_factor=args["skip_reduction_factor"],
        local_skip_factor=args["local_skip_factor"],
        sync_average="change" if variant == "change" else "heat",
        device_resident=variant == "device",
    )
    if (daso.plane is not None) != (variant == "device"):
        raise SystemExit(f"variant {variant}: the caller plane is {'on' if daso.plane else 'off'}")
    dp_model = ht.nn.DataParallelMultiGPU(model, daso)
    g = torch.Generator().manual_seed(args["seed"] * 1000 + 7)
    w_true = torch.randn(8, 4, generator=g)
    g = torch.Generator().manual_seed(args["seed"] * 1000 + 100 + rank)
    X = torch.randn(args["batches"], args["batch_size"], 8, generator=g)
    Y = X @ w_true + 0.1 * torch.randn(args["batches"], args["batch_size"], 4, generator=g)
    forced = [float(v) for v in args["losses"].split(",")]
    comm = ht.MPI_WORLD.comm

    def every_rank(vec):
        import numpy as np

        out = np.empty(comm.size * vec.numel(), dtype=np.float32)
        comm.allgather(vec.detach().numpy().astype(np.float32), out)
        return out.reshape(comm.size, -1).tolist()

    batches, epochs = [], []
    daso.last_batch = args["batches"] - 1
    for epoch in range(args["total_epochs"]):
        for b in range(args["batches"]):
            batches.append([daso.global_skip, daso.local_skip, daso.batches_to_wait])
            daso.zero_grad()
            torch.nn.functional.mse_loss(dp_model(X[b]), Y[b]).backward()
            daso.step()
        daso.epoch_loss_logic(forced[epoch])
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        epochs.append({"schedule_after": [daso.global_skip, daso.local_skip, daso.batches_to_wait], "params": every_rank(flat)})
    daso.finish()
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump({"batches": batches, "epochs": epochs}, f)


def compare(name, ref, ours):
    """(ok, a line): the schedule per batch and after each epoch, and the parameters."""
    theirs = [[r["global_skip"], r["local_skip"], r["batches_to_wait"]] for r in ref["batches"]]
    bad = [i for i, (a, b) in enumerate(zip(ours["batches"], theirs)) if a != b]
    problems = []
    if len(ours["batches"]) != len(theirs):
        problems.append(f"{len(ours['batches'])} batches, Heat ran {len(theirs)}")
    if bad:
        i = bad[0]
        problems.append(f"schedule differs on {len(bad)} batches, first batch {i}: ours {ours['batches'][i]}, Heat's {theirs[i]}")
    worst, where = 0.0, None
    for e, (mine, heat) in enumerate(zip(ours["epochs"], ref["epochs"])):
        if mine["schedule_after"] != heat["schedule_after"]:
            problems.append(f"after epoch {e}: ours {mine['schedule_after']}, Heat's {heat['schedule_after']}")
        for r, (a, b) in enumerate(zip(mine["params"], heat["params"])):
            scale = max(abs(v) for v in b)
            diff = max(abs(x - y) for x, y in zip(a, b)) / scale
            if diff > worst:
                worst, where = diff, (e, r)
    if worst > RTOL:
        problems.append(f"parameters differ by {worst:.3g} (relative) at epoch {where[0]} rank {where[1]}")
    schedules = sorted({tuple(s) for s in theirs})
    line = f"heat reference {name}: {len(theirs)} batches, schedules {schedules}, parameters within {worst:.2g} of Heat's"
    return not problems, line + ("" if not problems else " -- " + "; ".join(problems))


def drive(names):
    py = sys.executable
    mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gw-heat-") as d:
        ref_paths = {name: os.path.join(d, f"heat-{name}.json") for name in names}
        variants = {name: ("heat", "device", "change") if i == 0 else ("heat", "device") for i, name in enumerate(names)}
        heat_args = []
        for name in names:
            heat_args += ["--then"] * bool(heat_args) + ["--out", ref_paths[name], *CONFIGS[name]]
        subprocess.run([mpiexec, "-n", "4", py, os.path.join(HERE, "heat_reference.py"), *heat_args], env=env, check=True, timeout=600)
        plans = []
        for name in names:
            os.mkdir(os.path.join(d, name))
            plans.append(f"{ref_paths[name]}:{os.path.join(d, name)}:{','.join(variants[name])}")
        subprocess.run(
            [os.environ["GRADWIRE_BIN"], "launch", "-n", "4", "--netns", "--ranks-per-node", "2", "--"] + [py, os.path.abspath(__file__), "gradwire", *plans],
            env=env,
            check=True,
            timeout=600,
        )
        for name in names:
            with open(ref_paths[name]) as f:
                ref = json.load(f)
            for variant in variants[name]:
                with open(os.path.join(d, name, f"gradwire-{variant}.json")) as f:
                    ours = json.load(f)
                ok, line = compare(name if variant == "heat" else f"{name} ({variant})", ref, ours)
                if variant == "change":
                    # The control: gradwire's own synchronous average is not Heat's.
                    ok, line = not ok, f"control (sync_average='change' must differ): {line}"
                failed += not ok
                print(("ok   " if ok else "FAIL ") + line, flush=True)
    print("heat compare: ok" if not failed else f"heat compare: {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "drive":
        sys.exit(drive(sys.argv[2:] or list(CONFIGS)))
    gradwire_rank(sys.argv[2:])

#!/usr/bin/env python3
"""torch_percall.py -- what one small torch.distributed call costs on the gradwire backend.

Times (timeit, best of REPEAT runs of NUMBER calls) dist.all_gather_into_tensor,
dist.reduce_scatter_tensor, dist.all_reduce and dist.broadcast on COUNT floats, blocking,
then an async all_reduce waited for at once: at one rank the data movement is a copy at
most, so this is the path's own cost (torch's wrapper, the backend's entry, the C call).
Then the blocking all_reduce layer by layer: through torch's ProcessGroup.allreduce (its
dispatcher, no Python wrapper), through the gradwire Backend object alone, and
dist.all_reduce on a gloo group of the same ranks: what torch's own layers cost on any
backend, against what gradwire's adds.
Run it as:

    GRADWIRE_LIB=target/release/libgradwire.so PYTHONPATH=python OMP_NUM_THREADS=1 \\
    target/release/gradwire launch -n 1 -- python3 benches/peers/torch_percall.py [--record]

--record also keeps the figures in benches/results/torch_percall.csv and writes their
section into docs/benchmarks.md; --report CSV rewrites that section from a kept CSV.
"""
import argparse
import csv
import os
import sys
import timeit

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401 (registers the backend)

CSV = "benches/results/torch_percall.csv"


def report(path):
    """The docs/benchmarks.md section from a kept CSV."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from record_section import record  # benches/

    with open(path) as f:
        rows = list(csv.DictReader(f))
    us = {r["call"]: float(r["us"]) for r in rows}
    meta = rows[0]
    torch_own = us["all_reduce"] - us["gradwire Backend.allreduce"]
    lines = [
        "## PyTorch: one call's own cost, layer by layer",
        "",
        f"Command: `benches/peers/torch_percall.py --record` under `gradwire launch -n {meta['world']}` (CSV: `{path}`). "
        f"{meta['world']} rank, {meta['cores']} cores, torch {meta['torch']}, {meta['count']} float32 per call, CPU tensors, blocking "
        f"unless said; best of {meta['repeat']} runs of {meta['number']} calls. At one rank the data movement is a copy at most: each figure is the path's own cost.",
        "",
        "| call | µs |",
        "|---|---:|",
    ]
    lines += [f"| {r['call']} | {float(r['us']):.2f} |" for r in rows]
    lines += [
        "",
        f"`ProcessGroup.allreduce` is torch's C++ entry (its dispatcher, no Python wrapper), `gradwire Backend.allreduce` the backend alone: "
        f"of `dist.all_reduce`'s {us['all_reduce']:.1f} µs, {torch_own:.1f} µs are torch's own layers, which every backend pays "
        f"(gloo's whole call takes {us['all_reduce on gloo']:.1f} µs).",
    ]
    record("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1024, help="floats per call (per rank)")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--record", action="store_true", help=f"keep the figures in {CSV} and write the report section")
    ap.add_argument("--report", metavar="CSV", help="run nothing: write the report section from CSV")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gradwire")
    world, rank = dist.get_world_size(), dist.get_rank()
    x, gathered = torch.ones(args.count), torch.empty(args.count * world)
    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    gloo = dist.new_group(backend="gloo")
    tensors, opts = [x], dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False
    print(f"# torch_percall: W={world}, {args.count} floats, torch {torch.__version__}")
    rows = []
    for name, call in [
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, x)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x, gathered)),
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("broadcast", lambda: dist.broadcast(x, 0)),
        ("all_reduce async, waited", lambda: dist.all_reduce(x, async_op=True).wait()),
        ("ProcessGroup.allreduce", lambda: group.allreduce(tensors, opts)),
        ("gradwire Backend.allreduce", lambda: backend.allreduce(tensors, opts)),
        ("all_reduce on gloo", lambda: dist.all_reduce(x, group=gloo)),
    ]:
        best = min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number
        print(f"{name:>26} {best * 1e6:8.2f} us")
        rows.append(dict(call=name, us=f"{best * 1e6:.3f}", world=world, count=args.count, number=args.number, repeat=args.repeat, torch=torch.__version__, cores=os.cpu_count()))
    dist.destroy_process_group()
    if args.record and rank == 0:
        with open(CSV, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        report(CSV)


if __name__ == "__main__":
    main()

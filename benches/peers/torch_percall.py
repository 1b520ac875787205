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
    target/release/gradwire launch -n 1 -- python3 benches/peers/torch_percall.py
"""
import argparse
import timeit

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401 (registers the backend)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1024, help="floats per call (per rank)")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gradwire")
    world = dist.get_world_size()
    x, gathered = torch.ones(args.count), torch.empty(args.count * world)
    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    gloo = dist.new_group(backend="gloo")
    tensors, opts = [x], dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False
    print(f"# torch_percall: W={world}, {args.count} floats, torch {torch.__version__}")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""torch_overhead.py -- what torch.distributed on the gradwire backend costs over the bare C call.

One process per rank alternates, on the same tensors, the torch call
(dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce; blocking) with
the same collective through gradwire's C ABI directly (ctypes, no torch), ROUNDS times
ITERS calls each; per round the slowest rank's mean; prints the medians and torch / C (as
busbw ratios: C time / torch time). Alternating in one process takes the machine's
minute-to-minute speed out of the comparison, which separate runs (collectives.sh's torch
part) cannot:

    GRADWIRE_LIB=target/release/libgradwire.so PYTHONPATH=python OMP_NUM_THREADS=1 \\
    target/release/gradwire launch -n 2 -- python3 benches/peers/torch_overhead.py -b 1M -e 4M

--between adds, per size, the C allgather with something run before each call: spinning
S microseconds (`spin:S`) or reading and writing N KiB of other memory (`touch:N`); what
any code between calls (torch's own wrapper, a model) costs a call through the cache.
"""
import argparse
import time

import torch
import torch.distributed as dist

import gradwire
import gradwire.torch  # registers the backend
from gloo_collectives import parse_size
from gradwire import _check


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--minbytes", default="1M")
    ap.add_argument("-e", "--maxbytes", default="4M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=300)
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--between", default="", help="e.g. 'spin:3 touch:64': the C allgather after each (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gradwire")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    lib, comm = gradwire.load_library(), gradwire.torch.comm_of(group)
    if rank == 0:
        print(f"# torch_overhead: W={world}, iters={args.iters}, rounds={args.rounds}, torch {torch.__version__}")
        print(f"{'call':>20} {'size':>9} {'call us':>9} {'C us':>9} {'call/C busbw':>13}")
    size = parse_size(args.minbytes)
    while size <= parse_size(args.maxbytes):
        part = size // 4 // world  # float32 elements of one rank's block
        whole, block = torch.randn(part * world), torch.randn(part)
        h, wp, bp = comm._h, whole.data_ptr(), block.data_ptr()
        cases = [
            ("torch allgather", lambda: dist.all_gather_into_tensor(whole, block), lambda: _check(lib.gradwire_allgather(h, bp, wp, part, 0))),
            ("torch reduce_scatter", lambda: dist.reduce_scatter_tensor(block, whole), lambda: _check(lib.gradwire_reduce_scatter(h, wp, bp, part, 0, 0))),
            ("torch allreduce", lambda: dist.all_reduce(whole), lambda: _check(lib.gradwire_allreduce(h, wp, wp, part * world, 0, 0))),
        ]
        for what in args.between.split():
            kind, amount = what.split(":")
            if kind == "spin":
                seconds = float(amount) * 1e-6

                def before(seconds=seconds):
                    end = time.perf_counter() + seconds
                    while time.perf_counter() < end:
                        pass

            elif kind == "touch":
                other = bytearray(int(amount) << 10)

                def before(other=other):
                    other[:] = other  # reads and writes every byte

            else:
                raise SystemExit(f"--between: {what}: expected spin:MICROSECONDS or touch:KIB")
            cases.append((f"C after {what}", lambda before=before: (before(), _check(lib.gradwire_allgather(h, bp, wp, part, 0))), cases[0][2]))
        for name, through_torch, bare in cases:
            times = {"torch": [], "C": []}
            for _ in range(args.rounds):
                for kind, call in (("torch", through_torch), ("C", bare)):
                    for _ in range(5):
                        call()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        call()
                    mean = torch.tensor([(time.perf_counter() - t0) / args.iters * 1e6], dtype=torch.float64)
                    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
                    times[kind].append(mean.item())
            t, c = (sorted(v)[len(v) // 2] for v in (times["torch"], times["C"]))
            if rank == 0:
                print(f"{name:>20} {size:>9} {t:>9.1f} {c:>9.1f} {100 * c / t:>12.0f}%", flush=True)
        size *= args.stepfactor
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

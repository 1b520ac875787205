#!/usr/bin/env python3
"""gloo_allreduce.py -- Gloo (torch.distributed) peer for gradwire's `bench allreduce`.

Started once per rank by a torchrun-style launcher, e.g.

    gradwire launch -n 4 -- python3 benches/peers/gloo_allreduce.py \
        -b 4K -e 256M -f 4 -n 20 -w 5 --csv gloo.csv

(reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT via init_method="env://").
Rank 0 writes a CSV with exactly gradwire's columns:

    size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong

Method, kept identical to mpi_allreduce.c / gradwire:
  * dist.all_reduce(SUM) on a float32 CPU tensor.  Gloo's all_reduce is
    in-place only, so the timed loop runs in place on a buffer that starts
    at 0.0 (so repeated summing never overflows into inf/NaN; float add
    speed does not depend on the values), and correctness is checked on a
    separate, untimed call on freshly filled data.
  * WARMUP untimed calls, barrier, ITERS timed calls; per-rank mean =
    elapsed / ITERS; time_us = max over ranks of the mean (all_reduce MAX).
  * algbw = size_bytes / time (GB/s, 1e9), busbw = algbw * 2 (W-1) / W.
  * Data: per-rank pseudo-random integers in [-1000, 1000] (same hash of
    rank and index mod 1000003 as mpi_allreduce.c), exact in float32 for any
    summation order; the expected sum is recomputed independently on every
    rank; `wrong` = number of
    differing elements, summed over ranks.
"""
import argparse
import os
import sys
import time


def parse_size(s: str) -> int:
    s = s.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    if s and s[-1].lower() in mult:
        return int(float(s[:-1]) * mult[s[-1].lower()])
    return int(float(s))


PERIOD = 1000003  # prime; must match GW_PERIOD in mpi_allreduce.c


def gw_table(torch, rank: int):
    """Values of elements 0..PERIOD-1 on `rank`; element i has value
    table[i % PERIOD].  Must match gw_value() in mpi_allreduce.c."""
    m32 = 0xFFFFFFFF
    i = torch.arange(PERIOD, dtype=torch.int64)
    h = (i * 0x9E3779B1 + ((rank + 1) * 0x85EBCA77)) & m32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & m32
    h ^= h >> 12
    return (h % 2001 - 1000).to(torch.float32)


def periods(count: int):
    for lo in range(0, count, PERIOD):
        yield lo, min(count, lo + PERIOD)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--minbytes", default="4K")
    ap.add_argument("-e", "--maxbytes", default="4M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("-d", "--dtype", default="float32", choices=["float32", "float", "f32"])
    ap.add_argument("-o", "--op", default="sum", choices=["sum"])
    ap.add_argument("--csv", default=None, help="CSV output file (rank 0); default stdout")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per rank (default 1; gloo's own "
                         "reduction does not use them)")
    ap.add_argument("--selftest-corrupt", action="store_true",
                    help="perturb one element on rank 0 before checking (wrong must be 1)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, args.threads))
    minb, maxb, factor = parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor
    if factor < 2 or minb < 4 or maxb < minb or args.iters < 1 or args.warmup < 0:
        ap.error("bad size range / iteration counts")

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    maxcount = maxb // 4
    mine = gw_table(torch, rank)          # this rank's data (one period)
    expect = torch.zeros(PERIOD, dtype=torch.float32)
    for r in range(world):                # reference sum, computed independently
        expect += gw_table(torch, r)
    buf = torch.zeros(maxcount, dtype=torch.float32)  # touched: zeros() writes every page

    out = None
    if rank == 0:
        out = open(args.csv, "w") if args.csv else sys.stdout
        out.write("size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n")
        out.flush()
        print(f"# gloo_allreduce: W={world} in-place (checked separately) "
              f"iters={args.iters} warmup={args.warmup} torch={torch.__version__}",
              file=sys.stderr)

    size = minb
    while size <= maxb:
        count = size // 4
        nbytes = count * 4
        t = buf[:count]
        t.zero_()
        for _ in range(args.warmup):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t1 = time.perf_counter()
        mean = torch.tensor([(t1 - t0) / args.iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)

        # Correctness: fresh data, one untimed call, independent reference.
        for lo, hi in periods(count):
            t[lo:hi].copy_(mine[:hi - lo])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if args.selftest_corrupt and rank == 0:
            t[count // 2] += 1.0
        nwrong = 0
        for lo, hi in periods(count):
            nwrong += int((t[lo:hi] != expect[:hi - lo]).sum().item())
        wrong = torch.tensor([nwrong], dtype=torch.int64)
        dist.all_reduce(wrong, op=dist.ReduceOp.SUM)

        if rank == 0:
            sec = mean.item()
            algbw = nbytes / sec / 1e9
            busbw = algbw * 2.0 * (world - 1) / world
            out.write(f"{nbytes},{count},float32,sum,{sec * 1e6:.3f},{algbw:.4f},"
                      f"{busbw:.4f},{wrong.item()}\n")
            out.flush()
            print(f" {nbytes:12d} {sec * 1e6:12.2f} {algbw:10.3f} {busbw:10.3f} "
                  f"{wrong.item():8d}", file=sys.stderr)
        if size > maxb // factor:
            break
        size *= factor

    dist.barrier()
    if out is not None and out is not sys.stdout:
        out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

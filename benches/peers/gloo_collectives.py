#!/usr/bin/env python3
"""gloo_collectives.py -- Gloo (torch.distributed) peer for every collective of `gradwire bench`.

Started once per rank by a torchrun-style launcher, e.g.

    gradwire launch -n 4 -- python3 benches/peers/gloo_collectives.py \
        -c allgather -b 1M -e 64M -f 4 -n 20 -w 5 --csv gloo.csv

(reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT via init_method="env://").
Rank 0 writes a CSV with exactly gradwire's columns:

    size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong

-c COLL, float32 CPU tensors, sum; sizes as `gradwire bench` (nccl-tests) counts them:
  allreduce       dist.all_reduce, in place;            busbw = algbw * 2(W-1)/W
  reduce_scatter  dist.reduce_scatter_tensor; size = the whole input,
                  size/4/W elements out per rank;       busbw = algbw * (W-1)/W
  allgather       dist.all_gather_into_tensor; size = the whole output,
                  size/4/W elements in per rank;        busbw = algbw * (W-1)/W
  broadcast       dist.broadcast from rank 0, in place; busbw = algbw
  reduce          dist.reduce to rank 0, in place;      busbw = algbw
  alltoall        dist.all_to_all_single; size = one rank's whole input,
                  size/4/W elements to each peer;       busbw = algbw * (W-1)/W
--in-place: allgather and reduce_scatter in NCCL's in-place layout, as FSDP gathers
parameters and Megatron's distributed optimizer reduce-scatters gradients: the input
is the output's own block (allgather), the output the input's own block (reduce_scatter).

Method, identical to mpi_collectives.c: WARMUP untimed calls,
barrier, ITERS timed calls; per-rank mean = elapsed / ITERS; time_us = max over ranks of
the mean.  Data: integer-valued floats from the hash of (rank, global index mod 1000003)
shared with mpi_collectives.c, exact in float32 for any summation order.  The
out-of-place collectives and broadcast are checked on the last timed call's result; the
in-place reductions (allreduce, reduce, reduce_scatter --in-place) are timed on zeros and checked on one more,
untimed call on fresh data.  Every rank computes its expectation independently; `wrong`
= differing elements summed over ranks.

A collective the backend does not implement (the first, tiny call raises) writes no CSV:
rank 0 prints one line `gw-na: <backend>: <error>` and every rank exits 0;
benches/collectives.sh records the cell as "n/a (<backend>: <error>)".

benches/peers/torch_collectives.py runs this same code on gradwire's PyTorch backend.
"""
import argparse
import sys
import time

COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
BLOCKED = ("reduce_scatter", "allgather", "alltoall")
PERIOD = 1000003  # prime; must match GW_PERIOD in mpi_collectives.c
NA_MARK = "gw-na:"


def parse_size(s: str) -> int:
    s = s.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    if s and s[-1].lower() in mult:
        return int(float(s[:-1]) * mult[s[-1].lower()])
    return int(float(s))


def busbw_factor(coll: str, world: int) -> float:
    if coll == "allreduce":
        return 2.0 * (world - 1) / world
    if coll in BLOCKED:
        return (world - 1) / world
    return 1.0


def gw_table(torch, rank: int):
    """Values of elements 0..PERIOD-1 on `rank`; global element i has value
    table[i % PERIOD].  Must match gw_value() in mpi_collectives.c."""
    m32 = 0xFFFFFFFF
    i = torch.arange(PERIOD, dtype=torch.int64)
    h = (i * 0x9E3779B1 + ((rank + 1) * 0x85EBCA77)) & m32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & m32
    h ^= h >> 12
    return (h % 2001 - 1000).to(torch.float32)


def fill_range(dst, table, lo: int):
    """dst[j] = table[(lo + j) % PERIOD]: the values of global elements lo.. ."""
    n, pos = dst.numel(), 0
    while pos < n:
        p = (lo + pos) % PERIOD
        k = min(n - pos, PERIOD - p)
        dst[pos:pos + k].copy_(table[p:p + k])
        pos += k


def main(backend: str = "gloo", prog: str = "gloo_collectives") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--coll", required=True, choices=COLLS)
    ap.add_argument("-b", "--minbytes", default="1M")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("-d", "--dtype", default="float32", choices=["float32", "float", "f32"])
    ap.add_argument("-o", "--op", default="sum", choices=["sum"])
    ap.add_argument("--csv", default=None, help="CSV output file (rank 0); default stdout")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per rank (default 1)")
    ap.add_argument("--in-place", action="store_true",
                    help="allgather / reduce_scatter in NCCL's in-place layout (see above)")
    ap.add_argument("--selftest-corrupt", action="store_true",
                    help="perturb one element on rank 0 before checking (wrong must be 1)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, args.threads))
    minb, maxb, factor = parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor
    if factor < 2 or minb < 4 or maxb < minb or args.iters < 1 or args.warmup < 0:
        ap.error("bad size range / iteration counts")
    if args.in_place and args.coll not in ("allgather", "reduce_scatter"):
        ap.error("--in-place is for allgather and reduce_scatter")

    dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    coll, in_place = args.coll, args.in_place
    blocked = coll in BLOCKED
    busf = busbw_factor(coll, world)

    def once(send, recv):
        if coll == "allreduce":
            dist.all_reduce(recv, op=dist.ReduceOp.SUM)
        elif coll == "reduce_scatter":
            dist.reduce_scatter_tensor(recv, send, op=dist.ReduceOp.SUM)
        elif coll == "allgather":
            dist.all_gather_into_tensor(recv, send)
        elif coll == "broadcast":
            dist.broadcast(recv, src=0)
        elif coll == "reduce":
            dist.reduce(recv, dst=0, op=dist.ReduceOp.SUM)
        else:
            dist.all_to_all_single(recv, send)

    # Does the backend implement it?  One tiny call (1 element per rank block).
    probe_in = torch.zeros(world if coll in ("reduce_scatter", "alltoall") else 1)
    probe_out = torch.zeros(world if coll in ("allgather", "alltoall") else 1)
    if coll in ("allreduce", "broadcast", "reduce"):
        probe_in = probe_out
    elif in_place and coll == "allgather":
        probe_in = probe_out[rank:rank + 1]  # a backend without the in-place layout says so here
    elif in_place:
        probe_out = probe_in[rank:rank + 1]
    try:
        once(probe_in, probe_out)
    except (RuntimeError, NotImplementedError, AttributeError, ValueError, TypeError) as e:
        if rank == 0:
            msg = " ".join(str(e).split())[:200]
            print(f"{NA_MARK} {backend}: {type(e).__name__}: {msg}", flush=True)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 -- leaving anyway
            pass
        return 0

    tables = [gw_table(torch, r) for r in range(world)]
    mine = tables[rank]
    sums = torch.zeros(PERIOD, dtype=torch.float32)
    for t in tables:  # reference sum, computed independently of the backend
        sums += t

    maxcount = maxb // 4
    send = torch.zeros(maxcount, dtype=torch.float32)  # zeros() touches every page
    recv = torch.zeros(maxcount, dtype=torch.float32)

    out = None
    if rank == 0:
        out = open(args.csv, "w") if args.csv else sys.stdout
        out.write("size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n")
        out.flush()
        print(f"# {prog} {coll}{' in place' if in_place else ''}: backend {backend}, W={world} iters={args.iters} "
              f"warmup={args.warmup} busbw factor {busf:.3f} torch={torch.__version__}",
              file=sys.stderr)

    size = minb
    while size <= maxb:
        total = size // 4
        count = total // world if blocked else total
        if count == 0:
            if size > maxb // factor:
                break
            size *= factor
            continue
        nbytes = (count * world if blocked else count) * 4
        if coll in ("allreduce", "reduce", "broadcast"):
            s, r = None, recv[:count]
        elif coll == "reduce_scatter":
            s = send[:count * world]
            r = s[rank * count:(rank + 1) * count] if in_place else recv[:count]
        elif coll == "allgather":
            r = recv[:count * world]
            s = r[rank * count:(rank + 1) * count] if in_place else send[:count]
        else:
            s, r = send[:count * world], recv[:count * world]

        # Data for the timed calls.
        if coll in ("allreduce", "reduce"):
            r.zero_()
        elif coll == "broadcast":
            fill_range(r, mine, 0)  # non-roots start with their own data
        elif coll == "allgather":
            r.zero_()
            fill_range(s, mine, rank * count)  # after: in place, s is r's own block
        elif coll == "reduce_scatter" and in_place:
            s.zero_()  # each call reduces into the input's own block: timed on zeros
        else:
            fill_range(s, mine, 0)
            r.zero_()

        for _ in range(args.warmup):
            once(s, r)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            once(s, r)
        t1 = time.perf_counter()
        mean = torch.tensor([(t1 - t0) / args.iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)

        if coll in ("allreduce", "reduce"):  # in place: fresh data, one untimed call
            fill_range(r, mine, 0)
            once(s, r)
        elif coll == "reduce_scatter" and in_place:
            fill_range(s, mine, 0)
            once(s, r)
        if coll == "reduce" and rank != 0:
            got = r[:0]
        else:
            got = r
        expect = torch.empty_like(got)
        if coll in ("allreduce", "reduce"):
            fill_range(expect, sums, 0)
        elif coll == "reduce_scatter":
            fill_range(expect, sums, rank * count)
        elif coll == "allgather":
            for q in range(world):
                fill_range(expect[q * count:(q + 1) * count], tables[q], q * count)
        elif coll == "broadcast":
            fill_range(expect, tables[0], 0)
        else:  # alltoall: block q is rank q's block `rank`
            for q in range(world):
                fill_range(expect[q * count:(q + 1) * count], tables[q], rank * count)
        if args.selftest_corrupt and rank == 0 and got.numel() > 0:
            got[got.numel() // 2] += 1.0
        nwrong = int((got != expect).sum().item())
        del expect
        wrong = torch.tensor([float(nwrong)], dtype=torch.float64)
        dist.all_reduce(wrong, op=dist.ReduceOp.SUM)

        if rank == 0:
            sec = mean.item()
            algbw = nbytes / sec / 1e9
            busbw = algbw * busf
            nw = int(wrong.item())
            out.write(f"{nbytes},{count},float32,sum,{sec * 1e6:.3f},{algbw:.4f},"
                      f"{busbw:.4f},{nw}\n")
            out.flush()
            print(f" {nbytes:12d} {count:12d} {sec * 1e6:12.2f} {algbw:10.3f} {busbw:10.3f} "
                  f"{nw:8d}", file=sys.stderr)
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

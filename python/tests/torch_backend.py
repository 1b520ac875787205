"""Run under `gradwire launch -n N -- python3 python/tests/torch_backend.py`.

torch.distributed on the "gradwire" backend (init_process_group("gradwire")):
1. every collective the backend offers x dtype x op against a reference computed here from
   every rank's regenerated random input (fresh seed per run): in place, non-contiguous,
   async_op, on a subgroup made by new_group, and the object collectives;
2. DDP trained on the gradwire backend and on a gloo group, same model, data and initial
   weights, 60 steps: loss trajectories within 1e-5 relative and every replica's
   parameters identical to rank 0's; the same with ZeroRedundancyOptimizer, the fp16
   compression hook and PostLocalSGDOptimizer. The fp16 hook's reference is DDP on gloo
   with a hook that sums the same fp16 values in f32 and rounds once (what gradwire does
   for f16): gloo's own fp16 allreduce rounds at every step of its ring, so against it the
   bound is fp16's, 1e-3.

Why 1e-5: both average the same float32 gradients and differ only in summation order
(<= (W-1)*eps ~ 4e-7 relative per step); 60 steps of SGD with momentum on this smooth
problem stay far below 1e-5 (measured: ~1e-7). A wrong reduction (a sum instead of an
average, a bucket left out or reduced twice) moves the loss by more than 1e-2 within a few
steps.
"""

import gc
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_problem  # the shared DDP test problem, beside this file
import gradwire.torch  # noqa: F401 (registers the backend)

torch.set_num_threads(1)
dist.init_process_group("gradwire")
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "gradwire", dist.get_backend()
# torch's own group over the compiled backend, named like a built-in one's.
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
assert type(backend).__name__ == "GradwireBackend", type(backend)
assert dist.group.WORLD.group_name, "the group has no name"


seed_t = torch.randint(0, 2**62, (1,), dtype=torch.int64)
dist.broadcast(seed_t, src=0)
seed = int(seed_t.item())
failures, cases = [], 0

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "product"}


def inp(r, case, n, dt):
    g = torch.Generator().manual_seed(seed ^ (r * 1_000_003) ^ (case * 7919))
    if dt == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dt in INTS:
        info = torch.iinfo(dt)
        hi = min(info.max, 2**53)
        lo = max(info.min, -(2**53))
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dt)
    return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dt)


def wrap(v, dt):
    bits = torch.iinfo(dt).bits
    v &= (1 << bits) - 1
    return v - (1 << bits) if dt != torch.uint8 and v >= 1 << (bits - 1) else v


def reference(rows, op, dt):
    """(want as float64 or exact Python ints, tolerance) from every rank's input."""
    if dt == torch.bool:
        s = torch.stack(rows)
        return (s.any(0) if op in ("sum", "max") else s.all(0)).to(torch.float64), 0.0
    if dt in INTS:
        cols = list(zip(*(r.tolist() for r in rows)))
        f = {"sum": lambda c: wrap(sum(c), dt), "product": lambda c: wrap(math.prod(c), dt), "min": min, "max": max}[op]
        return [f(c) for c in cols], None
    x = torch.stack([r.to(torch.float64) for r in rows])
    eps = torch.finfo(dt).eps
    tiny = torch.finfo(dt).tiny
    bound = (world + 1) * (eps * x.abs().sum(0) + tiny)
    if op == "sum":
        return x.sum(0), bound
    if op == "avg":
        return x.mean(0), bound / world + (world + 1) * tiny
    if op == "product":
        p = x.prod(0)
        return p, (world + 1) * (eps * p.abs() + tiny)
    return (x.min(0).values if op == "min" else x.max(0).values), 0.0


def expect(name, got, want_tol):
    global cases
    cases += 1
    want, tol = want_tol
    if tol is None:  # exact integers
        bad = [i for i, (g, w) in enumerate(zip(got.tolist(), want)) if g != w]
        if bad:
            failures.append(f"rank {rank}: {name}: {len(bad)} wrong, e.g. [{bad[0]}] = {got.tolist()[bad[0]]} vs {want[bad[0]]}")
        return
    g = got.to(torch.float64)
    bad = torch.nonzero(~((g - want).abs() <= tol)).flatten()
    if bad.numel():
        i = int(bad[0])
        t = tol if isinstance(tol, float) else float(tol[i])
        failures.append(f"rank {rank}: {name}: {bad.numel()} wrong, e.g. [{i}] = {float(g[i])} vs {float(want[i])} +- {t}")


n = 1003
case = 0
for dt in FLOATS + INTS + [torch.bool]:
    for top, op in OPS.items():
        if op == "avg" and (dt in INTS or dt == torch.bool):
            continue
        case += 1
        rows = [inp(r, case, n, dt) for r in range(world)]
        want = reference(rows, op, dt)
        # In place, blocking.
        x = rows[rank].clone()
        dist.all_reduce(x, op=top)
        expect(f"all_reduce {dt} {op}", x, want)
        # async_op, and a non-contiguous view (every other element of a 2n buffer).
        y = torch.zeros(2 * n, dtype=dt)
        view = y[::2]
        view.copy_(rows[rank])
        work = dist.all_reduce(view, op=top, async_op=True)
        work.wait()
        expect(f"all_reduce async non-contiguous {dt} {op}", view, want)
        if y[1::2].to(torch.float64).abs().sum() != 0:
            failures.append(f"rank {rank}: all_reduce on a strided view wrote between its elements ({dt} {op})")

# Reduce-scatter, allgather, broadcast, gather, scatter, reduce: one float and one int type.
for dt in [torch.float32, torch.int64]:
    case += 1
    rows = [inp(r, case, n * world, dt) for r in range(world)]
    full_want, tol = reference(rows, "sum", dt)
    lo, hi = rank * n, (rank + 1) * n
    part_want = (full_want[lo:hi], tol if tol is None or isinstance(tol, float) else tol[lo:hi])
    out = torch.empty(n, dtype=dt)
    dist.reduce_scatter_tensor(out, rows[rank].clone())
    expect(f"reduce_scatter_tensor {dt}", out, part_want)
    out = torch.empty(n, dtype=dt)
    dist.reduce_scatter(out, list(rows[rank].clone().chunk(world)))
    expect(f"reduce_scatter (list) {dt}", out, part_want)
    mine = inp(rank, case + 100, n, dt)
    everyone = torch.cat([inp(r, case + 100, n, dt) for r in range(world)])
    gathered = torch.empty(n * world, dtype=dt)
    dist.all_gather_into_tensor(gathered, mine)
    expect(f"all_gather_into_tensor {dt}", gathered, (everyone.to(torch.float64), 0.0))
    # In place, as FSDP calls them: the input is the output's own part (allgather), the
    # output the input's own part (reduce-scatter); synchronous and async_op.
    for async_op in [False, True]:
        inplace = torch.zeros(n * world, dtype=dt)
        inplace[lo:hi].copy_(mine)
        work = dist.all_gather_into_tensor(inplace, inplace[lo:hi], async_op=async_op)
        if async_op:
            work.wait()
        expect(f"all_gather_into_tensor in place {dt} async_op={async_op}", inplace, (everyone.to(torch.float64), 0.0))
        whole = rows[rank].clone()
        work = dist.reduce_scatter_tensor(whole[lo:hi], whole, async_op=async_op)
        if async_op:
            work.wait()
        expect(f"reduce_scatter_tensor in place {dt} async_op={async_op}", whole[lo:hi], part_want)
    # The input in the output, but not as its own part: gathered as a copy, on every rank.
    stray = torch.zeros(n * world, dtype=dt)
    other = (rank + 1) % world * n
    stray[other : other + n].copy_(mine)
    dist.all_gather_into_tensor(stray, stray[other : other + n])
    expect(f"all_gather_into_tensor, input another part of the output {dt}", stray, (everyone.to(torch.float64), 0.0))
    outs = [torch.empty(n, dtype=dt) for _ in range(world)]
    dist.all_gather(outs, mine)
    expect(f"all_gather (list) {dt}", torch.cat(outs), (everyone.to(torch.float64), 0.0))
    root = case % world
    b = inp(rank, case + 200, n, dt)
    dist.broadcast(b, src=root)
    expect(f"broadcast from {root} {dt}", b, (inp(root, case + 200, n, dt).to(torch.float64), 0.0))
    g_out = [torch.empty(n, dtype=dt) for _ in range(world)] if rank == root else None
    dist.gather(mine, g_out, dst=root)
    if rank == root:
        expect(f"gather to {root} {dt}", torch.cat(g_out), (everyone.to(torch.float64), 0.0))
    s_out = torch.empty(n, dtype=dt)
    dist.scatter(s_out, list(everyone.clone().chunk(world)) if rank == root else None, src=root)
    expect(f"scatter from {root} {dt}", s_out, (everyone[lo:hi].to(torch.float64), 0.0))
    r = rows[rank][:n].clone()
    dist.reduce(r, dst=root)
    if rank == root:
        sub = reference([row[:n] for row in rows], "sum", dt)
        expect(f"reduce to {root} {dt}", r, sub)

# All-to-all (mixture-of-experts token exchange): equal splits, uneven row splits (rank r
# sends p + 1 rows of 3 to rank p), the list form, async; and send/recv around the ring.
for dt in [torch.float32, torch.int64, torch.bfloat16]:
    case += 1
    rows_of = lambda r: inp(r, case, world * 4, dt)  # noqa: E731
    out = torch.empty(world * 4, dtype=dt)
    dist.all_to_all_single(out, rows_of(rank))
    want = torch.cat([rows_of(p)[rank * 4 : (rank + 1) * 4] for p in range(world)])
    expect(f"all_to_all_single {dt}", out, (want.to(torch.float64), 0.0))
    send_rows = [p + 1 for p in range(world)]
    mine = inp(rank, case + 300, sum(send_rows) * 3, dt).reshape(-1, 3)
    out = torch.empty((rank + 1) * world, 3, dtype=dt)
    work = dist.all_to_all_single(out, mine, output_split_sizes=[rank + 1] * world, input_split_sizes=send_rows, async_op=True)
    work.wait()
    start = sum(range(1, rank + 1))  # rows rank p sends to ranks before us
    want = torch.cat([inp(p, case + 300, sum(send_rows) * 3, dt).reshape(-1, 3)[start : start + rank + 1] for p in range(world)])
    expect(f"all_to_all_single uneven {dt}", out.reshape(-1), (want.reshape(-1).to(torch.float64), 0.0))
    ins = [inp(rank, case + 400 + p, 5, dt) for p in range(world)]
    outs = [torch.empty(5, dtype=dt) for _ in range(world)]
    dist.all_to_all(outs, ins)
    want = torch.cat([inp(p, case + 400 + rank, 5, dt) for p in range(world)])
    expect(f"all_to_all (list) {dt}", torch.cat(outs), (want.to(torch.float64), 0.0))
if world > 1:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mine, got = inp(rank, 900, 333, torch.float64), torch.empty(333, dtype=torch.float64)
    if rank % 2 == 0:
        dist.send(mine, dst=nxt, tag=5)
        dist.recv(got, src=prv, tag=5)
    else:
        dist.recv(got, src=prv, tag=5)
        dist.send(mine, dst=nxt, tag=5)
    expect("send/recv around the ring", got, (inp(prv, 900, 333, torch.float64), 0.0))
    # Every rank sends first, 16 MiB (far more than a link buffers): only a batch completes.
    n = 4 << 20
    big, into = inp(rank, 901, n, torch.float32), torch.empty(n)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt, tag=6), dist.P2POp(dist.irecv, into, prv, tag=6)]):
        work.wait()
    expect("batch_isend_irecv ring (16 MiB, all send first)", into, (inp(prv, 901, n, torch.float32).to(torch.float64), 0.0))
    # Messages told apart only by tag, received in another order than sent (torch matches
    # point-to-point messages by peer and tag): in one batch, 1 MiB and 100 elements; then
    # two small isends that the peer takes with blocking recvs in reverse order.
    a, b = inp(rank, 904, 1 << 18, torch.float32), inp(rank, 905, 100, torch.float64)
    ga, gb = torch.empty(1 << 18), torch.empty(100, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, a, nxt, tag=31), dist.P2POp(dist.isend, b, nxt, tag=32)]
    for work in dist.batch_isend_irecv(ops + [dist.P2POp(dist.irecv, gb, prv, tag=32), dist.P2POp(dist.irecv, ga, prv, tag=31)]):
        work.wait()
    expect("batch receiving tag 32 before tag 31", ga, (inp(prv, 904, 1 << 18, torch.float32).to(torch.float64), 0.0))
    expect("batch receiving tag 32 before tag 31 (tag 32)", gb, (inp(prv, 905, 100, torch.float64), 0.0))
    sends = [dist.isend(b[:10].clone(), dst=nxt, tag=33), dist.isend(b[10:30].clone(), dst=nxt, tag=34)]
    g34, g33 = torch.empty(20, dtype=torch.float64), torch.empty(10, dtype=torch.float64)
    dist.recv(g34, src=prv, tag=34)
    dist.recv(g33, src=prv, tag=33)
    for work in sends:
        work.wait()
    expect("recv of tag 34 before tag 33", torch.cat([g33, g34]), (inp(prv, 905, 100, torch.float64)[:30], 0.0))
    # Plain isend then irecv into a non-contiguous view, completed by polling is_completed.
    strided = torch.zeros(2 * 333, dtype=torch.float64)[::2]
    sent, received = dist.isend(mine, dst=nxt, tag=7), dist.irecv(strided, src=prv, tag=7)
    deadline = time.monotonic() + 30
    while not (received.is_completed() and sent.is_completed()) and time.monotonic() < deadline:
        time.sleep(0.001)
    cases += 1
    if not received.is_completed():
        failures.append(f"rank {rank}: isend/irecv never completed when polled")
    sent.wait()
    received.wait()
    expect("isend/irecv, polled, non-contiguous receive", strided, (inp(prv, 900, 333, torch.float64), 0.0))
    # Sends issued but not waited for start before the next collective (program order).
    dist.isend(mine, dst=nxt, tag=8)
    pending = dist.irecv(got, src=prv, tag=8)
    ones = torch.ones(3)
    dist.all_reduce(ones)
    pending.wait()
    expect("isend/irecv started by the next collective", got, (inp(prv, 900, 333, torch.float64), 0.0))
    cases += 1
    if not torch.equal(ones, torch.full((3,), float(world))):
        failures.append(f"rank {rank}: all_reduce after pending isend/irecv gave {ones.tolist()}")
    cases += 1
    try:
        dist.recv(got)
        failures.append(f"rank {rank}: recv from any source was accepted")
    except RuntimeError as e:
        if "any source" not in str(e):
            failures.append(f"rank {rank}: recv from any source: unclear error {e}")

# Async work, waited for: completed and without an exception.
x, outp = torch.ones(64), torch.empty(64 * world)
for what, call in [
    ("all_reduce", lambda: dist.all_reduce(x, async_op=True)),
    ("broadcast", lambda: dist.broadcast(x, src=0, async_op=True)),
    ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(outp, x, async_op=True)),
    ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x, outp, async_op=True)),
]:
    work = call()
    work.wait()
    cases += 1
    # is_success(), not exception(): torch 2.11's binding cannot return the exception_ptr.
    if not work.is_completed() or not work.is_success():
        failures.append(f"rank {rank}: async {what}: waited for, completed {work.is_completed()}, success {work.is_success()}")
if world > 1:  # sends waited for, then a collective
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, tag=9), dist.P2POp(dist.irecv, torch.empty(64), prv, tag=9)]):
        work.wait()
    dist.all_reduce(x)
dist.barrier()

# An async work dropped without a wait: gradwire finishes it in the background with its
# buffers kept alive, and the next collectives are unaffected.
for _ in range(20):
    dropped = torch.full((1 << 16,), float(rank))
    dist.all_reduce(dropped, async_op=True)
    del dropped
z = torch.ones(7)
dist.all_reduce(z)
cases += 1
if not torch.equal(z, torch.full((7,), float(world))):
    failures.append(f"rank {rank}: all_reduce after dropped async works gave {z.tolist()}")

# Object collectives (pickled bytes through uint8 allgather and broadcast).
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "msg": "x" * rank})
cases += 1
if objs != [{"rank": r, "msg": "x" * r} for r in range(world)]:
    failures.append(f"rank {rank}: all_gather_object gave {objs}")
lst = [f"from {rank}", rank] if rank == 0 else [None, None]
dist.broadcast_object_list(lst, src=0)
cases += 1
if lst != ["from 0", 0]:
    failures.append(f"rank {rank}: broadcast_object_list gave {lst}")

# A subgroup made by new_group (the creator runs on members only): the even ranks.
evens = list(range(0, world, 2))
sub = dist.new_group(evens, backend="gradwire")
if rank in evens:
    v = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(v, group=sub)
    cases += 1
    if int(v) != sum(r + 1 for r in evens):
        failures.append(f"rank {rank}: all_reduce on the even subgroup gave {int(v)}")
# A subgroup whose first rank is not rank 0 (with 2x2 namespace nodes: on the other node,
# where MASTER_ADDR is not this host's address).
if world >= 4:
    last = [world - 2, world - 1]
    tail = dist.new_group(last, backend="gradwire")
    if rank in last:
        v = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(v, group=tail)
        cases += 1
        if int(v) != sum(last):
            failures.append(f"rank {rank}: all_reduce on the subgroup {last} gave {int(v)}")
dist.barrier()

# Work that completed when made (reduce runs when called) still hands out a future that
# holds the result, and the tensor it holds is the caller's.
case += 1
rows = [inp(r, case, n, torch.float64) for r in range(world)]
x = rows[rank].clone()
held = dist.reduce(x, dst=0, async_op=True).get_future().wait()
cases += 1
if not (isinstance(held, list) and len(held) == 1 and held[0].data_ptr() == x.data_ptr()):
    failures.append(f"rank {rank}: reduce's completed work: its future held {held!r}, not [x]")
if rank == 0:
    expect("reduce, through a completed work's future", x, reference(rows, "sum", torch.float64))
dist.barrier()

# work.wait(timeout): past it a "Timed out" RuntimeError and the work stays pending; a later
# wait completes it. The last rank joins the allreduce only once rank 0's bounded wait has
# ended (told through torch's store), so the order does not depend on timing.
if world > 1:
    cases += 1
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:
        store.wait(["gradwire-test/bounded-wait-done"], timedelta(seconds=60))
    t = torch.ones(8)
    w = dist.all_reduce(t, async_op=True)
    if rank == 0:
        try:
            w.wait(timeout=timedelta(milliseconds=200))
            failures.append(f"rank {rank}: wait(200 ms) returned before the last rank joined")
        except RuntimeError as e:
            if "Timed out" not in str(e) or "still pending" not in str(e):
                failures.append(f"rank {rank}: wait(200 ms): unclear error {e}")
        store.set("gradwire-test/bounded-wait-done", "1")
    w.wait()
    if not torch.equal(t, torch.full((8,), float(world))):
        failures.append(f"rank {rank}: the allreduce waited for after a timed-out wait gave {t.tolist()}")
    dist.barrier()

# Bitwise ops on integer and bool tensors (gathered and combined in Python), against every
# rank's regenerated input combined here.
def bits(seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2**31 - 1, (6,), generator=g, dtype=torch.int64)
    return (v % 2 == 0) if dtype == torch.bool else v.to(dtype)


for name, op, fn in (("BAND", dist.ReduceOp.BAND, torch.bitwise_and), ("BOR", dist.ReduceOp.BOR, torch.bitwise_or), ("BXOR", dist.ReduceOp.BXOR, torch.bitwise_xor)):
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        cases += 1
        want = bits(600, dtype)
        for r in range(1, world):
            want = fn(want, bits(600 + r, dtype))
        t = bits(600 + rank, dtype)
        dist.all_reduce(t, op=op)
        if not torch.equal(t, want):
            failures.append(f"rank {rank}: all_reduce {name} on {dtype}: {t.tolist()}, want {want.tolist()}")
    cases += 1
    inp = torch.cat([bits(700 + 10 * rank + j) for j in range(world)])
    want = bits(700 + rank)
    for r in range(1, world):
        want = fn(want, bits(700 + 10 * r + rank))
    out = torch.empty(6, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, inp, op=op)
    if not torch.equal(out, want):
        failures.append(f"rank {rank}: reduce_scatter_tensor {name}: {out.tolist()}, want {want.tolist()}")
dist.barrier()

# Errors a torch user can catch: wrong device, unsupported dtype, avg of an integer, a
# bitwise op on floats (refused on each rank before anything is sent).
for what, call in [
    ("avg of int32", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)),
    ("uint16", lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16))),
    ("BAND of float32", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)),
    ("BXOR reduce_scatter of float32", lambda: dist.reduce_scatter_tensor(torch.ones(4), torch.ones(4 * world), op=dist.ReduceOp.BXOR)),
]:
    cases += 1
    try:
        call()
        failures.append(f"rank {rank}: {what} was accepted")
    except (RuntimeError, ValueError, TypeError):
        pass
dist.barrier()

# DDP on the gradwire backend against DDP on a gloo group, plain and with what torch builds
# on process groups: ZeroRedundancyOptimizer, the fp16 compression hook, post-local SGD.
STEPS = 60
gloo = dist.new_group(backend="gloo")


def fp16_rounded_once_hook(group, bucket):
    """fp16_compress_hook with an exact reduction: the compressed buckets gathered and summed
    in f32 in rank order, rounded to fp16 once."""
    buf = bucket.buffer()
    w = dist.get_world_size(group)
    compressed = buf.to(torch.float16).div_(w)
    parts = [torch.empty_like(compressed) for _ in range(w)]
    dist.all_gather(parts, compressed, group=group)
    total = torch.zeros(compressed.shape, dtype=torch.float32)
    for part in parts:
        total += part.float()
    buf.copy_(total.half())
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def train(group, kind):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

    model = ddp_problem.model()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.005)  # several buckets per step
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, process_group=group, lr=0.05, momentum=0.9)
    elif kind == "postlocal":
        # Global averaging for 10 steps, then steps alone (subgroups of one rank) with a model
        # average over the group every 4.
        alone, _ = dist.new_subgroups(group_size=1, backend="gloo" if group is gloo else "gradwire")
        state = post_local.PostLocalSGDState(process_group=group, subgroup=alone, start_localSGD_iter=10)
        ddp.register_comm_hook(state, post_local.post_localSGD_hook)
        inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        opt = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=4, warmup_steps=10, process_group=group))
    else:
        if kind == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif kind == "fp16-rounded-once":
            ddp.register_comm_hook(group, fp16_rounded_once_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = ddp_problem.fit(ddp, opt, STEPS, rank, world, loss_group=gloo)
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def relative_difference(a, b):
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


for kind in ["ddp", "zero", "fp16", "postlocal"]:
    gloo_losses, gloo_params = train(gloo, kind)
    gw_losses, gw_params = train(None, kind)  # the default group: gradwire
    rel = relative_difference(gloo_losses, gw_losses)
    bound = 1e-3 if kind == "fp16" else 1e-5
    cases += 1
    if not rel <= bound:
        failures.append(f"rank {rank}: {kind}: loss trajectories differ by {rel:.2e} relative (gloo vs gradwire, bound {bound:g})")
    if kind == "fp16":
        exact_losses, _ = train(gloo, "fp16-rounded-once")
        exact = relative_difference(exact_losses, gw_losses)
        cases += 1
        if not exact <= 1e-5:
            failures.append(f"rank {rank}: fp16: loss trajectories differ by {exact:.2e} relative (fp16 summed in f32 and rounded once vs gradwire, bound 1e-05)")
        if rank == 0:
            print(f"fp16: against the sum rounded once: max relative difference {exact:.2e}")
    if kind == "ddp":
        ddp_losses = gw_losses
    rank0 = gw_params.clone()
    dist.broadcast(rank0, src=0)
    cases += 1
    if kind == "postlocal":
        # Replicas part between averages by design; local steps must have happened.
        if max(abs(a - b) for a, b in zip(ddp_losses, gw_losses)) < 1e-6:
            failures.append(f"rank {rank}: postlocal: the trajectory equals plain DDP's (no local steps?)")
    elif not torch.equal(rank0, gw_params):
        failures.append(f"rank {rank}: {kind}: replica differs from rank 0's by {(rank0 - gw_params).abs().max():.2e}")
    if rank == 0:
        print(f"{kind}: {world} ranks, {STEPS} steps: final loss gloo {gloo_losses[-1]:.7f}, gradwire {gw_losses[-1]:.7f}; max relative difference {rel:.2e}")

for f in failures[:20]:
    print("FAIL", f, f"(seed {seed})", file=sys.stderr)
print(f"rank {rank}: torch backend: {cases - len(failures)} passed, {len(failures)} failed (seed {seed})")
# torch 2.15: a DDP module left to the interpreter's exit, after its process group is gone,
# aborts the process about half the time ("terminate called without an active exception";
# gloo alone does it too): collect the DDP modules first.
gc.collect()
dist.destroy_process_group()
sys.exit(1 if failures else 0)

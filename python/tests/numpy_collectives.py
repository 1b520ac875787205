"""Run under `gradwire launch -n N -- python3 python/tests/numpy_collectives.py`.

Every collective of the Python binding on NumPy arrays, in place, compared with a
reference computed here in float64 from every rank's regenerated random input (fresh seed
per run, chosen by rank 0). Tolerance for sum/avg: (W+1)·eps·Σ|x| (W−1 roundings of
partial sums bounded by Σ|x|, plus the avg scaling, times 2); min/max exact.
"""

import itertools
import sys

import numpy as np

from gradwire import Comm, GradwireError

comm = Comm()
rank, world = comm.rank, comm.size
seed_arr = np.array([np.random.SeedSequence().entropy % (1 << 52)], dtype=np.float64)
comm.broadcast(seed_arr, root=0)
seed = int(seed_arr[0])
failures = []
cases = 0


def inp(r, case, n, dt):
    rng = np.random.default_rng([seed, r, case])
    return rng.uniform(-1, 1, n).astype(dt)


def expect(name, got, want, tol):
    global cases
    cases += 1
    got = np.asarray(got, dtype=np.float64)
    bad = np.flatnonzero(~(np.abs(got - want) <= tol))
    if bad.size:
        i = bad[0]
        failures.append(f"rank {rank}: {name}: {bad.size} wrong, e.g. [{i}] = {got[i]} vs {want[i]} ± {np.broadcast_to(tol, want.shape)[i]}")


n = 7919
for case, (dt, op) in enumerate(itertools.product([np.float32, np.float64, np.float16], ["sum", "avg", "min", "max"])):
    inputs = np.stack([inp(r, case, n, dt).astype(np.float64) for r in range(world)])
    eps = np.finfo(dt).eps
    tol = (world + 1) * eps * np.abs(inputs).sum(axis=0)
    ref = {"sum": inputs.sum(0), "avg": inputs.mean(0), "min": inputs.min(0), "max": inputs.max(0)}[op]
    tol = {"sum": tol, "avg": tol / world}.get(op, 0.0)
    x = inp(rank, case, n, dt)
    comm.allreduce(x, op=op)
    expect(f"allreduce {np.dtype(dt).name} {op}", x, ref, tol)
    # Out of place and non-blocking.
    src, out = inp(rank, case, n, dt), np.zeros(n, dtype=dt)
    comm.allreduce(src, op=op, out=out)
    expect(f"allreduce out-of-place {np.dtype(dt).name} {op}", out, ref, tol)
    y = inp(rank, case, n, dt)
    comm.iallreduce(y, op=op).wait()
    expect(f"iallreduce {np.dtype(dt).name} {op}", y, ref, tol)

# Arrays from gradwire's allocator: from 256 KiB the one-host allreduce works in them in place.
big = 2_500_007
for case, op in enumerate(["sum", "avg"], start=50):
    inputs = np.stack([inp(r, case, big, np.float32).astype(np.float64) for r in range(world)])
    tol = (world + 1) * np.finfo(np.float32).eps * np.abs(inputs).sum(axis=0)
    ref = inputs.sum(0) if op == "sum" else inputs.mean(0)
    x = comm.empty(big, "float32")
    x[:] = inp(rank, case, big, np.float32)
    comm.allreduce(x, op=op)
    expect(f"allreduce on comm.empty {op}", x, ref, tol if op == "sum" else tol / world)
    del x

# Ordinary arrays registered in place: the same, twice over each registration.
for case, op in enumerate(["sum", "max"], start=60):
    x = np.empty(big, dtype=np.float32)
    comm.register(x)
    for again in range(2):
        inputs = np.stack([inp(r, case + 10 * again, big, np.float32).astype(np.float64) for r in range(world)])
        tol = (world + 1) * np.finfo(np.float32).eps * np.abs(inputs).sum(axis=0)
        x[:] = inp(rank, case + 10 * again, big, np.float32)
        comm.allreduce(x, op=op)
        expect(f"allreduce on a registered array {op}", x, inputs.sum(0) if op == "sum" else inputs.max(0), tol if op == "sum" else 0.0)
    comm.deregister(x)

case = 100
root = world - 1
b = inp(rank, case, n, np.float32)
comm.broadcast(b, root=root)
expect("broadcast", b, inp(root, case, n, np.float32).astype(np.float64), 0.0)
part = 1003
out = np.zeros(part * world, dtype=np.float64)
comm.allgather(inp(rank, case + 1, part, np.float64), out)
expect("allgather", out, np.concatenate([inp(r, case + 1, part, np.float64) for r in range(world)]), 0.0)
full = np.stack([inp(r, case + 2, part * world, np.float64) for r in range(world)])
mine = np.zeros(part, dtype=np.float64)
comm.reduce_scatter(inp(rank, case + 2, part * world, np.float64), mine, op="max")
expect("reduce_scatter max", mine, full.max(0)[rank * part:(rank + 1) * part], 0.0)
comm.barrier()

# Bad input is a Python exception, never a crash.
for bad_call, exc in [
    (lambda: comm.allreduce(np.zeros((4, 4), dtype=np.float32)[:, 0]), ValueError),
    (lambda: comm.allreduce(np.zeros(4, dtype=np.int32)), TypeError),
    (lambda: comm.allreduce(np.zeros(4, dtype=np.float32), op="prod"), ValueError),
    (lambda: comm.broadcast(np.zeros(4, dtype=np.float32), root=world), ValueError),
    (lambda: comm.allreduce([1.0, 2.0]), TypeError),
    (lambda: comm.empty(4, "int32"), TypeError),
    (lambda: comm.empty(-1), ValueError),
    (lambda: comm.register(np.zeros(4, dtype=np.float32)), GradwireError),
    (lambda: comm.deregister(np.zeros(4096, dtype=np.float32)), GradwireError),
]:
    cases += 1
    try:
        bad_call()
        failures.append(f"rank {rank}: bad input was accepted")
    except exc:
        pass

if comm.split(rank % 2).size != (world + 1 - rank % 2) // 2:
    failures.append(f"rank {rank}: split sizes wrong")
kept = comm.empty(1000, "float64")
kept[:] = 0.5
comm.finalize()
cases += 1
if kept.sum() != 500.0:  # memory from empty() outlives finalize()
    failures.append(f"rank {rank}: comm.empty array changed across finalize")
del kept
for f in failures:
    print("FAIL", f, f"(seed {seed})", file=sys.stderr)
print(f"rank {rank}: numpy binding: {cases - len(failures)} passed, {len(failures)} failed (seed {seed})")
sys.exit(1 if failures else 0)

"""Run under `gradwire launch -n N -- python3 python/tests/numpy_collectives.py`.

Every collective of the Python binding on NumPy arrays, in place, compared with a
reference computed here in float64 from every rank's regenerated random input (fresh seed
per run, chosen by rank 0). Tolerance for sum/avg: (W+1)·eps·Σ|x| (W−1 roundings of
partial sums bounded by Σ|x|, plus the avg scaling, times 2); product: (W+1)·(eps·|p| +
the subnormal step); min/max and every integer result exact.
"""

import itertools
import math
import sys

import numpy as np

from gradwire import UNIQUE_ID_BYTES, Comm, GradwireError, InvalidArgumentError, unique_id

comm = Comm()
rank, world = comm.rank, comm.size
seed_arr = np.array([np.random.SeedSequence().entropy % (1 << 52)], dtype=np.float64)
comm.broadcast(seed_arr, root=0)
seed = int(seed_arr[0])
failures = []
cases = 0


def inp(r, case, n, dt):
    rng = np.random.default_rng([seed, r, case])
    if np.dtype(dt) == np.bool_:
        return rng.integers(0, 2, n).astype(dt)
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=dt)
    return rng.uniform(-1, 1, n).astype(dt)


def int_reference(rows, op, dt):
    """Wrapping integer reduction in Python's exact integers, then cast as C does."""
    bits = np.dtype(dt).itemsize * 8
    signed = np.issubdtype(dt, np.signedinteger)

    def wrap(v):
        v &= (1 << bits) - 1
        return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v

    cols = list(zip(*(r.tolist() for r in rows)))
    if op == "sum":
        return [wrap(sum(c)) for c in cols]
    if op == "product":
        return [wrap(math.prod(c)) for c in cols]
    return [min(c) if op == "min" else max(c) for c in cols]


def expect(name, got, want, tol):
    global cases
    cases += 1
    got = np.asarray(got, dtype=np.float64)
    bad = np.flatnonzero(~(np.abs(got - want) <= tol))
    if bad.size:
        i = bad[0]
        failures.append(f"rank {rank}: {name}: {bad.size} wrong, e.g. [{i}] = {got[i]} vs {want[i]} ± {np.broadcast_to(tol, want.shape)[i]}")


n = 7919
for case, (dt, op) in enumerate(itertools.product([np.float32, np.float64, np.float16], ["sum", "avg", "min", "max", "product"])):
    inputs = np.stack([inp(r, case, n, dt).astype(np.float64) for r in range(world)])
    eps = np.finfo(dt).eps
    tol = (world + 1) * eps * np.abs(inputs).sum(axis=0)
    ref = {"sum": inputs.sum(0), "avg": inputs.mean(0), "min": inputs.min(0), "max": inputs.max(0), "product": None}[op]
    tol = {"sum": tol, "avg": tol / world}.get(op, 0.0)
    ref = inputs.prod(0) if op == "product" else ref
    tol = (world + 1) * (eps * np.abs(ref) + np.finfo(dt).smallest_subnormal) if op == "product" else tol
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

# Integers wrap on overflow (inputs over the whole range); bool sum/max is or, product/min
# and. Compared exactly, as Python integers (float64 cannot tell every int64 apart).
for case, (dt, op) in enumerate(itertools.product([np.int8, np.uint8, np.int32, np.int64, np.bool_], ["sum", "min", "max", "product"]), start=100):
    rows = [inp(r, case, n, dt) for r in range(world)]
    if dt == np.bool_:
        want = [bool(v) for v in (np.logical_or.reduce(rows) if op in ("sum", "max") else np.logical_and.reduce(rows))]
    else:
        want = int_reference(rows, op, dt)
    x = inp(rank, case, n, dt)
    comm.allreduce(x, op=op)
    cases += 1
    got = [bool(v) for v in x.tolist()] if dt == np.bool_ else x.tolist()
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if wrong:
        i = wrong[0]
        failures.append(f"rank {rank}: allreduce {np.dtype(dt).name} {op}: {len(wrong)} wrong, e.g. [{i}] = {got[i]} vs {want[i]}")
    with_avg = inp(rank, case, n, dt)
    cases += 1
    try:
        comm.allreduce(with_avg, op="avg")
        failures.append(f"rank {rank}: allreduce {np.dtype(dt).name} avg was accepted")
    except GradwireError as e:
        if not isinstance(e, InvalidArgumentError) or "avg needs a floating-point dtype" not in str(e):
            failures.append(f"rank {rank}: allreduce {np.dtype(dt).name} avg: unexpected error {e}")

# A second communicator from a unique id, carried over the first one (as a framework would
# carry it through its own store): bytes as a uint8 broadcast.
uid = np.frombuffer(bytearray(unique_id() if rank == 0 else bytes(UNIQUE_ID_BYTES)), dtype=np.uint8).copy()
comm.broadcast(uid, root=0)
with Comm.from_unique_id(uid.tobytes(), world, rank) as by_id:
    v = np.array([rank + 1], dtype=np.int64)
    by_id.allreduce(v)
    cases += 1
    if (by_id.rank, by_id.size, int(v[0])) != (rank, world, world * (world + 1) // 2):
        failures.append(f"rank {rank}: communicator from a unique id: rank {by_id.rank}, size {by_id.size}, sum {v[0]}")
for bad_uid, err in [(b"x" * UNIQUE_ID_BYTES, InvalidArgumentError), (b"short", ValueError)]:
    cases += 1
    try:
        Comm.from_unique_id(bad_uid, world, rank)
        failures.append(f"rank {rank}: from_unique_id({bad_uid[:8]!r}...) was accepted")
    except err:
        pass

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
    (lambda: comm.allreduce(np.zeros(4, dtype=np.uint16)), TypeError),
    (lambda: comm.allreduce(np.zeros(4, dtype=np.float32), op="prod"), ValueError),
    (lambda: comm.broadcast(np.zeros(4, dtype=np.float32), root=world), ValueError),
    (lambda: comm.allreduce([1.0, 2.0]), TypeError),
    (lambda: comm.empty(4, "uint16"), TypeError),
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

# A p2p batch around the ring, every rank sending first (4 Mi float32: more than a link
# buffers), and bad batch entries refused before anything moves.
if world > 1:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = np.random.default_rng(seed + rank).random(4 << 20, dtype=np.float32)
    into = np.zeros(4 << 20, dtype=np.float32)
    comm.p2p_batch([("send", out, nxt, 3), ("recv", into, prv, 3)], async_op=True).wait()
    cases += 1
    if not np.array_equal(into, np.random.default_rng(seed + prv).random(4 << 20, dtype=np.float32)):
        failures.append(f"rank {rank}: p2p_batch ring received wrong data")
    # Messages told apart only by tag, received in another order than sent: a receive takes
    # the oldest message from its peer with its tag, as torch and MPI match them. In one
    # batch, 2 MiB, 1000 and 0 elements received in reverse (the first two read aside);
    # then two small sends completed before the peer takes them, in reverse, blocking.
    sizes = {21: 1 << 19, 22: 1000, 23: 0}
    mine = {t: np.random.default_rng([seed, rank, t]).random(n, dtype=np.float32) for t, n in sizes.items()}
    theirs = {t: np.random.default_rng([seed, prv, t]).random(n, dtype=np.float32) for t, n in sizes.items()}
    got = {t: np.zeros(n, dtype=np.float32) for t, n in sizes.items()}
    comm.p2p_batch([("send", mine[t], nxt, t) for t in (21, 22, 23)] + [("recv", got[t], prv, t) for t in (23, 22, 21)])
    comm.p2p_batch([("send", mine[22], nxt, 22), ("send", mine[21][:7], nxt, 21)], async_op=True).wait()
    late21, late22 = np.zeros(7, dtype=np.float32), np.zeros(1000, dtype=np.float32)
    comm.recv(late21, prv, 21)
    comm.recv(late22, prv, 22)
    # A small send started before an allreduce, received after it: across hosts (tcp) the
    # allreduce's first message from that peer is the send's, which is read aside.
    comm.p2p_batch([("send", mine[22], nxt, 24)], async_op=True).wait()
    total = np.full(1 << 12, rank + 1.0, dtype=np.float32)
    comm.allreduce(total)
    after24 = np.zeros(1000, dtype=np.float32)
    comm.recv(after24, prv, 24)
    cases += 1
    if not np.array_equal(total, np.full(1 << 12, world * (world + 1) / 2, dtype=np.float32)):
        failures.append(f"rank {rank}: the allreduce between a send and its receive gave {total[:3]}")
    for what, a, b in [("tag 24, received after an allreduce", after24, theirs[22]), ("tag 21", got[21], theirs[21]), ("tag 22", got[22], theirs[22]), ("tag 21, later", late21, theirs[21][:7]), ("tag 22, later", late22, theirs[22])]:
        cases += 1
        if not np.array_equal(a, b):
            failures.append(f"rank {rank}: messages received out of tag order: {what} received wrong data")
    overlapping = [("send", out, nxt, 0), ("recv", out[10:], prv, 0)]
    for bad in ([("put", out, nxt, 0)], [("send", out, rank, 0)], [("send", out, nxt, -1)], [("send", out)], overlapping):
        cases += 1
        try:
            comm.p2p_batch(bad)
            failures.append(f"rank {rank}: p2p_batch {bad[0][0]!r} entry with bad fields was accepted")
        except (ValueError, TypeError, GradwireError):
            pass

# Training schemes through the C ABI on a toy least-squares model (rank r's gradient at p
# is p - target_r): every rank ends with the same parameters, near the mean target.
from gradwire import Strategy  # noqa: E402

target = np.arange(16, dtype=np.float32) + rank
want = np.arange(16, dtype=np.float32) + (world - 1) / 2
for scheme, options in [("ssgd", ""), ("bsp", "interval=3,topk=0.5"), ("daso", "epochs=6,warmup_epochs=1,cooldown_epochs=1")]:
    p = np.full(16, float(rank * 10), dtype=np.float32)
    s = Strategy(comm, scheme, p, options)
    s.start(p)
    for epoch in range(6):
        for b in range(8):
            g = p - target
            s.before_update(g, b == 7)
            p -= 0.2 * g
            s.after_update(p, b == 7)
        s.end_epoch(p, float(((p - target) ** 2).sum()))
    s.finish(p)
    state = s.describe()
    s.free()
    lo, hi = comm.allreduce(p.copy(), op="min"), comm.allreduce(p.copy(), op="max")
    cases += 1
    if not (np.array_equal(lo, hi) and np.abs(p - want).max() < 0.5):
        failures.append(f"rank {rank}: {state}: ranks from {lo[:3]} to {hi[:3]}, want about {want[:3]}")
# Downpour's local step (Dean et al., Algorithm 7.1), exactly: between fetches a worker's
# parameters move by -lr * g (it once only accumulated g for the push).
s = Strategy(comm, "downpour", np.zeros(16, dtype=np.float32), "lr=0.1,fetch=1000,push=1000")
p = np.zeros(16, dtype=np.float32)
s.start(p)
before = p.copy()
g = np.random.default_rng(seed + 7 * rank).standard_normal(16).astype(np.float32)
s.step(p, g)
cases += 1
if not np.array_equal(p, before - np.float32(0.1) * g):
    failures.append(f"rank {rank}: downpour: a step moved the parameters by {(p - before)[:3]}, want {(-np.float32(0.1) * g)[:3]}")
s.finish(p)
s.free()
for bad, exc in [(lambda: Strategy(comm, "sgdx", np.zeros(4, dtype=np.float32)), InvalidArgumentError),
                 (lambda: Strategy(comm, "bsp", np.zeros(4, dtype=np.float32), "interval=0"), InvalidArgumentError),
                 (lambda: Strategy(comm, "ssgd", np.zeros(4, dtype=np.float32), "lr=0.1"), InvalidArgumentError),
                 (lambda: Strategy(comm, "bsp", np.zeros(4, dtype=np.float32), "interval=2\0topk=0.5"), ValueError),
                 (lambda: Strategy(comm, "ssgd", np.zeros(4, dtype=np.float64)), TypeError)]:
    cases += 1
    try:
        bad()
        failures.append(f"rank {rank}: a bad Strategy was accepted")
    except exc:
        pass

# The hierarchical allreduce, blocking and not, both algorithms, on fresh random data:
# every rank regenerates every rank's input from its seed for the reference.
hier = comm.hierarchy()
for algo in ["sharded", "leader"]:
    n = 70001
    inputs = [np.random.default_rng(seed + 1000 + r).standard_normal(n) for r in range(world)]
    x = inputs[rank].copy()
    hier.allreduce(x, "sum", algo)
    y = inputs[rank].astype(np.float32)
    hier.iallreduce(y, "avg", algo).wait()
    cases += 1
    want = np.sum(inputs, axis=0)
    if np.abs(x - want).max() > 1e-9 * world or np.abs(y - want / world).max() > 1e-5:
        failures.append(f"rank {rank}: hierarchical {algo}: off by {np.abs(x - want).max():.2e} (f64 sum), {np.abs(y - want / world).max():.2e} (f32 avg)")
for bad, exc in [(lambda: hier.allreduce(np.zeros(4), "sum", "ring"), ValueError), (lambda: hier.allreduce(np.zeros(4, dtype=np.int64), "avg"), InvalidArgumentError)]:
    cases += 1
    try:
        bad()
        failures.append(f"rank {rank}: a bad hierarchical allreduce was accepted")
    except exc:
        pass
hier.free()

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

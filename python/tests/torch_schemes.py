"""One rank of the checks of gradwire's training schemes as PyTorch optimizers
(gradwire.torch.DASO, BSP, ParameterServer), each against an independent reference of its
math computed here, on fresh random data (seeds agreed through rank 0):

    torch_schemes.py math      (under gradwire launch; 4 ranks, best as 2 nodes of 2)
    torch_schemes.py kill      (ranks started directly) rank 1 dies in the middle of a
                               ddcgu epoch; every survivor must raise a GradwireError that
                               names the rank, within the deadline, and exit 3
    torch_schemes.py kill_background   the same in a Downpour epoch whose fetches and
                               pushes run in the background (the error comes from
                               gradwire's transfer thread or from the worker's own calls)

Prints "torch schemes: N passed, M failed" (math) per rank.
"""

import math
import os
import sys
import time

import numpy as np
import torch

import gradwire
from gradwire.optim import BSP, DASO, ParameterServer, resolve_comm

torch.set_num_threads(1)
mode = sys.argv[1] if len(sys.argv) > 1 else "math"
comm = resolve_comm()
rank, world = comm.rank, comm.size
seed_arr = np.array([np.random.SeedSequence().entropy % (1 << 52)], dtype=np.float64)
comm.broadcast(seed_arr, root=0)
seed = int(seed_arr[0])
failures, cases = [], 0


def check(ok, what):
    global cases
    cases += 1
    if not ok:
        failures.append(f"rank {rank}: {what}")


def gather(t):
    """Every rank's copy of flat tensor `t`, as a (world, n) float64 array."""
    mine = t.detach().double().numpy().ravel().copy()
    out = np.zeros(world * mine.size)
    comm.allgather(mine, out)
    return out.reshape(world, mine.size)


def model_for(s):
    torch.manual_seed(s)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(r, step, s):
    g = torch.Generator().manual_seed(s * 1000 + r * 100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def set_flat(m, v):
    at = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(v[at : at + p.numel()].view_as(p))
            at += p.numel()


class Recording(torch.optim.SGD):
    """SGD that records the gradients it steps on and the parameters it leaves."""

    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        self.seen_grads = torch.cat([p.grad.reshape(-1) for p in ps]).clone()
        super().step(closure)
        self.after = torch.cat([p.detach().reshape(-1) for p in ps]).clone()


def close(a, b, tol):
    return np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() <= tol


def bsp_matches_reference():
    """K local SGD-with-momentum steps on every rank, then x <- anchor - mean(anchor - x_r)
    with momentum kept local: the wrapper against W replicas trained here."""
    s = seed + 1
    k, steps = 3, 7
    model = model_for(s)
    opt = BSP(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), interval=k, comm=comm)
    replicas = [model_for(s) for _ in range(world)]
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in replicas]
    anchor = flat(replicas[0]).double()
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step, s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for r, (m, o) in enumerate(zip(replicas, ref_opts)):
            o.zero_grad()
            xr, yr = batch(r, step, s)
            torch.nn.functional.mse_loss(m(xr), yr).backward()
            o.step()
        if (step + 1) % k == 0:
            xs = torch.stack([flat(m).double() for m in replicas])
            anchor = anchor - (anchor - xs).mean(0)
            for m in replicas:
                set_flat(m, anchor.float())
        check(close(flat(model), flat(replicas[rank]), 2e-6), f"bsp step {step}: off the reference by {np.abs(flat(model).numpy() - flat(replicas[rank]).numpy()).max():.2e}")
    check(close(opt.current_model(), anchor, 2e-6), "bsp current_model is not the agreed anchor")


def topk_conserves_mass():
    """Top-k with error feedback drops nothing: one interval of random changes, then
    intervals of none; once the residuals have drained, the anchor is the dense average."""
    s = seed + 2
    n, frac = 1000, 0.1
    p = torch.nn.Parameter(torch.zeros(n))
    opt = BSP(torch.optim.SGD([p], lr=1.0), interval=1, topk=frac, comm=comm)
    changes = [torch.from_numpy(np.random.default_rng(s + r).standard_normal(n).astype(np.float32)) for r in range(world)]
    for step in range(math.ceil(1 / frac) + 2):
        opt.zero_grad()
        p.grad = -changes[rank] if step == 0 else torch.zeros(n)
        opt.step()
    want = torch.stack(changes).double().mean(0)
    got = gather(p)
    check(close(got[rank], want, 1e-5), f"bsp top-k: the drained anchor is off the dense average by {np.abs(got[rank] - want.numpy()).max():.2e}")
    check((got == got[0]).all(), "bsp top-k: ranks differ")


def daso_matches_reference():
    """Heat's arithmetic. Warm-up (synchronous): gradients averaged in the node, the local
    step, then every rank takes the mean over the nodes of the parameters of the sending
    local index (batch b: local index b mod G) . The first cycling batch sends (gs = 4,
    W = 1); the next merges (2S x_local + sum over nodes) / (2S + N) at the sending local
    index and broadcasts it in the node."""
    s = seed + 3
    model = model_for(s)
    local = Recording(model.parameters(), lr=0.05, momentum=0.9)
    daso = DASO(local, total_epochs=8, warmup_epochs=1, cooldown_epochs=1, downcast_type=torch.float32, comm=comm)
    hier = comm.hierarchy()
    nodes, g = hier.nodes, world // hier.nodes
    hier.free()
    node = [rank // g * g + i for i in range(g)]  # launcher's layout: ranks of a node are consecutive
    batches = 4
    for epoch in range(2):
        daso.last_batch = batches - 1
        for b in range(batches):
            before = flat(model).double().numpy()
            daso.zero_grad()
            x, y = batch(rank, epoch * 10 + b, s)
            torch.nn.functional.mse_loss(model(x), y).backward()
            raw = gather(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            daso.step()
            after_local = gather(local.after)
            now = flat(model).double().numpy()
            if epoch == 0:
                check(close(local.seen_grads, raw[node].mean(0), 1e-6), f"daso warm-up batch {b}: the optimizer did not step on the node's average gradient")
                want = after_local[[n * g + b % g for n in range(nodes)]].sum(0) / nodes
                check(close(now, want, 1e-6), f"daso warm-up batch {b}: off the reference by {np.abs(now - want).max():.2e}")
            elif b == 0:
                sent = after_local[[n * g for n in range(nodes)]].sum(0)  # local index 0 of every node
            elif b == 1:
                want = (2 * after_local[node[0]] + sent) / (2 + nodes)
                check(close(now, want, 1e-6), f"daso merge: off (2S x + sum) / (2S + N) by {np.abs(now - want).max():.2e}")
            if epoch == 1 and b == batches - 1:
                # The epoch's last batch ends in a blocking sync: every replica identical.
                every = gather(flat(model))
                check((every == every[0]).all(), f"daso: replicas differ after the end-of-epoch sync by {np.abs(every - every[0]).max():.2e}")
        daso.epoch_loss_logic(1.0 / (epoch + 1))
        if epoch == 0:
            check((daso.global_skip, daso.local_skip, daso.batches_to_wait) == (4, 1, 1), f"daso: cycling starts at gs=4 ls=1 W=1, not {daso.describe()}")
    check(daso.epoch == 2 and daso.current_batch == 0, f"daso: epoch {daso.epoch}, batch {daso.current_batch} after two epochs")
    # A last_batch past the epoch's end (Heat's docs once said len(loader)) is an error at
    # the epoch's end, not a silent drift of the schedule.
    daso.last_batch = batches
    for b in range(batches):
        daso.zero_grad()
        x, y = batch(rank, 90 + b, s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        daso.step()
    try:
        daso.epoch_loss_logic(0.5)
        check(False, "daso: an epoch that never reached last_batch was accepted")
    except ValueError as e:
        check("last_batch" in str(e), f"daso: wrong last_batch: {e}")


def plateau_follows_heat(losses):
    """The schedule through epoch_loss_logic against Heat's epoch_loss_logic and
    DetectMetricPlateau(patience=2, threshold=stability_level), transcribed here."""
    total, warm, cool, max_gs = len(losses), 2, 2, 8
    p = torch.nn.Parameter(torch.zeros(4))
    daso = DASO(torch.optim.SGD([p], lr=0.1), total_epochs=total, warmup_epochs=warm, cooldown_epochs=cool, max_global_skips=max_gs, comm=comm)
    daso.last_batch = 0  # one batch per epoch: Heat counts an epoch at its last batch
    gs = ls = w = 0
    resets = 0
    best, bad = math.inf, 0
    for epoch, loss in enumerate(losses, start=1):
        if epoch < warm:
            gs = ls = w = 0
        else:
            if epoch == warm:
                gs, ls, w = 4, 1, 1
            if epoch >= total - cool:
                gs = ls = w = 0
            else:
                if loss < best * (1 - 0.05):
                    best, bad = loss, 0
                else:
                    bad += 1
                stable = bad > 2
                if stable:
                    bad = 0
                if stable and gs > 1:
                    gs, ls, w = gs // 2, max(ls // 2, 1), max(w - 1, 1)
                elif stable and gs == 1:
                    gs, ls, w = max_gs, max_gs // 4, max_gs // 4
                    resets += 1
        daso.zero_grad()
        p.sum().backward()
        daso.step()
        daso.epoch_loss_logic(float(loss))
        got = (daso.global_skip, daso.local_skip, daso.batches_to_wait)
        check(got == (gs, ls, w), f"daso controller after epoch {epoch} (loss {loss:.4f}): {got}, Heat's {(gs, ls, w)}")
    return resets


def servers_conserve(scheme, options, straggler):
    """Nothing lost: with the sum rule every pushed gradient reaches the servers exactly
    once, so the final model is theta0 - lr * (every gradient of every rank); the shared pool
    hands out every minibatch once, a straggler taking fewer (cyclic: equal shares)."""
    s = seed + 5 + len(scheme)
    n, lr, epochs, total = 300, 0.125, 3, 12 * world
    p = torch.nn.Parameter(torch.from_numpy(np.random.default_rng(s).integers(-64, 64, n).astype(np.float32) / 64))
    theta0 = p.detach().clone().double()
    ps = ParameterServer([p], scheme, comm=comm, lr=lr, **options)
    rng = np.random.default_rng(s * 7 + rank)
    mine, taken = np.zeros(n), 0
    for _ in range(epochs):
        share = iter(range(total // world))  # cyclic: every rank its fixed share
        while ps.claim_batch(total) if ps.shared_pool else next(share, None) is not None:
            if straggler and rank == world - 1:
                time.sleep(0.01)
            g = rng.integers(-64, 64, n).astype(np.float32) / 64  # sums exact in float32
            ps.zero_grad()
            p.grad = torch.from_numpy(g)
            ps.step()
            mine += g
            taken += 1
        ps.end_epoch(0.0)
    ps.finish()
    counts = np.zeros(world)
    comm.allgather(np.array([float(taken)]), counts)
    if ps.shared_pool:  # (cyclic: the loop above fixes the shares)
        check(counts.sum() == epochs * total, f"{scheme}: {counts.sum():.0f} minibatches taken over {epochs} epochs of {total}")
    if straggler and ps.shared_pool:
        # (Not against every other rank: on an oversubscribed host a rank may get no CPU
        # before the pool is empty.)
        check(counts[-1] < counts[:-1].max(), f"{scheme}: the straggler took {counts[-1]:.0f} minibatches, the others {counts[:-1]}")
    everything = gather(torch.from_numpy(mine)).sum(0)
    want = theta0.numpy() - lr * everything
    check(close(p.detach().double(), want, 1e-4), f"{scheme}: final model off theta0 - lr * sum of all gradients by {np.abs(p.detach().double().numpy() - want).max():.2e}")
    check((gather(p) == gather(p)[0]).all(), f"{scheme}: ranks end with different models")


def pool_sampler_covers_the_epoch():
    """PoolSampler: minibatches of the right size from the whole dataset; over the ranks
    exactly the epoch's dataset_size // batch_size of them."""
    p = torch.nn.Parameter(torch.zeros(8))
    ps = ParameterServer([p], "downpour", comm=comm, lr=0.1)
    sampler = ps.sampler(dataset_size=103, batch_size=5, seed=seed)
    for epoch in range(2):
        got = list(sampler)
        if epoch == 0:
            try:
                list(sampler)
                check(False, "pool sampler: a second pass in one epoch was accepted (it finds the pool empty)")
            except RuntimeError:
                pass
        ps.end_epoch(0.0)
        counts = np.zeros(world)
        comm.allgather(np.array([float(len(got))]), counts)
        check(counts.sum() == 103 // 5, f"pool sampler epoch {epoch}: {counts.sum():.0f} minibatches over the ranks, want {103 // 5}")
        check(all(len(b) == 5 and all(0 <= i < 103 for i in b) for b in got), "pool sampler: a minibatch of the wrong size or index")
    ps.finish()


def frozen_and_unused_parameters():
    """A frozen parameter keeps no gradient, so weight decay leaves it alone (as without
    gradwire); a trainable one unused in backward gets a zero gradient (as DDP gives)."""
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = BSP(torch.optim.SGD([frozen, used, unused], lr=0.1, weight_decay=0.5), interval=1, comm=comm)
    opt.zero_grad(set_to_none=True)
    for q in (used, unused):
        q.grad = None
    (used * 2).sum().backward()
    opt.step()
    check(torch.equal(frozen.detach(), torch.ones(3)) and frozen.grad is None, f"frozen parameter moved to {frozen.detach().tolist()}")
    check(torch.allclose(used.detach(), torch.full((3,), 1 - 0.1 * (2 + 0.5))), f"used parameter: {used.detach().tolist()}")
    check(unused.grad is not None and torch.equal(unused.grad, torch.zeros(3)), "unused parameter: no zero gradient")


def bad_arguments_are_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    for make, exc in [
        (lambda: DASO(torch.optim.SGD([p], lr=0.1), total_epochs=0, comm=comm), ValueError),
        (lambda: DASO(torch.optim.SGD([p], lr=0.1), total_epochs=4, downcast_type=torch.int8, comm=comm), ValueError),
        (lambda: DASO([p], total_epochs=4, comm=comm), TypeError),
        (lambda: BSP(torch.optim.SGD([p], lr=0.1), interval=0, comm=comm), ValueError),
        (lambda: BSP(torch.optim.SGD([p], lr=0.1), topk=1.5, comm=comm), ValueError),
        (lambda: ParameterServer([p], "sgdx", comm=comm), ValueError),
        (lambda: ParameterServer([p], "ddcgu", comm=comm, tau=3), ValueError),
        (lambda: ParameterServer([p], "downpour", comm=comm, background="yes"), TypeError),
        (lambda: ParameterServer([p], "ddcgu", comm=comm, background=True), ValueError),
        (lambda: ParameterServer([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))], "ddcgu", comm=comm), TypeError),
    ]:
        try:
            make()
            check(False, "a bad scheme was accepted")
        except exc:
            check(True, "")
    daso = DASO(torch.optim.SGD([p], lr=0.1), total_epochs=4, comm=comm)
    try:
        daso.step()
        check(False, "DASO.step without last_batch was accepted")
    except ValueError as e:
        check("last_batch" in str(e), f"DASO.step without last_batch: {e}")


if mode in ("kill", "kill_background"):
    p = torch.nn.Parameter(torch.zeros(1000))
    if mode == "kill":
        ps = ParameterServer([p], "ddcgu", comm=comm, lr=0.01)
    else:
        ps = ParameterServer([p], "downpour", comm=comm, lr=0.01, fetch=2, push=2, background=True)
    start = time.monotonic()
    try:
        for epoch in range(1000):
            steps = 0
            while ps.claim_batch(40 * world):
                # Mid-epoch: at its first minibatch from the second epoch on (under load a
                # rank may get none of an epoch's pool).
                if rank == 1 and epoch >= 1:
                    os._exit(1)
                p.grad = torch.ones(1000)
                ps.step()
                steps += 1
            ps.end_epoch(0.0)
        print(f"rank {rank}: no error after 1000 epochs")
        sys.exit(1)
    except gradwire.GradwireError as e:
        print(f"rank {rank}: caught {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
        # Stay until every survivor has caught it too (or 10 s): a survivor that left at
        # once would be lost in turn to a peer still waiting on it, which would then
        # rightly name this rank instead of the killed one.
        here = f"/tmp/gradwire-ps-kill-{os.environ['MASTER_PORT']}"
        os.makedirs(here, exist_ok=True)
        open(f"{here}/{rank}", "w").close()
        until = time.monotonic() + 10
        while len(os.listdir(here)) < world - 1 and time.monotonic() < until:
            time.sleep(0.01)
        os._exit(3)

bsp_matches_reference()
topk_conserves_mass()
daso_matches_reference()
rng = np.random.default_rng(seed + 4)
plateau_follows_heat(np.cumprod(rng.uniform(0.9, 1.02, 24)))  # the same on every rank
check(plateau_follows_heat(np.full(24, 0.7)) > 0, "daso controller: a flat loss never reached the reset to max_global_skips")
for scheme, options in [
    ("ddcgu", {"rule": "sum"}),
    ("cyclic", {"rule": "sum"}),
    ("downpour", {"fetch": 2, "push": 3}),
    ("downpour", {"fetch": 2, "push": 3, "background": True}),
]:
    servers_conserve(scheme, options, straggler=False)
    servers_conserve(scheme, options, straggler=True)
pool_sampler_covers_the_epoch()
frozen_and_unused_parameters()
bad_arguments_are_refused()
for f in failures:
    print("FAIL", f)
print(f"rank {rank}: torch schemes: {cases - len(failures)} passed, {len(failures)} failed", flush=True)
sys.exit(1 if failures else 0)

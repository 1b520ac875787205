"""Run under `gradwire launch -n N -- python3 python/tests/torch_cuda.py` (for several
"nodes" sharing one GPU, each rank with its own GRADWIRE_HOST_ID).

torch.distributed on the "gradwire" backend with CUDA tensors: allreduce (sum, avg, max,
in place, non-contiguous, coalesced), broadcast, all_gather (list and tensor forms, in
place as FSDP calls it), reduce_scatter (list and tensor forms, in place), all_to_all
(single with equal and uneven splits, async, and the list form), reduce and scatter, each against a
reference computed here from every rank's regenerated input (small integers: exact sums),
on a stream of the test's own, so ordering on torch's current stream is what is checked;
then DDP on a CUDA model against the same model trained on one process with the whole
batch; then DASO and BSP (gradwire.torch's optimizers; device-resident, and through host
copies) on a CUDA model against the same scheme on the same model on the CPU, same data:
the same parameters within float rounding of the GPU's kernels; device-resident DASO
copies at most what crosses nodes per step between host and device (nothing on one node),
and BSP nothing. Without CUDA it prints SKIP with the reason and exits 0.
"""

import os
import sys

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401 (registers the backend)

if not torch.cuda.is_available():
    print("SKIP torch_cuda: torch sees no CUDA device")
    sys.exit(0)

if os.environ.get("GRADWIRE_TEST_NODE_PER_RANK") == "1":  # each rank its own "node"
    os.environ["GRADWIRE_HOST_ID"] = f"node{os.environ['RANK']}"
dist.init_process_group("gradwire")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(device)

seed_t = torch.randint(0, 2**62, (1,), dtype=torch.int64)
dist.broadcast(seed_t, src=0)
seed = int(seed_t.item())
failures = []


def inputs(r, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 7919 * r + n)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def check(name, got, want):
    got = got.cpu()
    if not torch.equal(got, want.to(got.dtype)):
        bad = (got != want.to(got.dtype)).sum().item()
        failures.append(f"{name}: {bad} of {got.numel()} wrong")


side = torch.cuda.Stream(device)
with torch.cuda.stream(side):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        n = 100_003
        x = inputs(rank, n, dtype).to(device)
        dist.all_reduce(x)
        check(f"all_reduce sum {dtype}", x, sum(inputs(r, n, dtype).double() for r in range(world)))
    n = 1 << 20
    x = inputs(rank, n).to(device) * world
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    check("all_reduce avg", x, sum(inputs(r, n).double() * world for r in range(world)) / world)
    x = inputs(rank, n).to(device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    check("all_reduce max", x, torch.stack([inputs(r, n) for r in range(world)]).max(0).values)
    # Non-contiguous: every other element of a matrix's column.
    m = inputs(rank, 2 * 4096).to(device).view(4096, 2)
    dist.all_reduce(m[:, 1])
    want = sum(inputs(r, 2 * 4096).view(4096, 2)[:, 1].double() for r in range(world))
    check("all_reduce non-contiguous", m[:, 1], want)
    check("all_reduce non-contiguous leaves the rest", m[:, 0], inputs(rank, 2 * 4096).view(4096, 2)[:, 0])
    # Coalesced (DDP's and FSDP's bucket form).
    if hasattr(dist, "all_reduce_coalesced"):
        ts = [inputs(rank, k).to(device) for k in (10, 1000, 33)]
        dist.all_reduce_coalesced(ts)
        for t, k in zip(ts, (10, 1000, 33)):
            check(f"all_reduce_coalesced {k}", t, sum(inputs(r, k).double() for r in range(world)))

    root = world - 1
    x = inputs(rank, n).to(device)
    dist.broadcast(x, src=root)
    check("broadcast", x, inputs(root, n))

    k = 4099
    out = torch.empty(world * k, device=device)
    dist.all_gather_into_tensor(out, inputs(rank, k).to(device))
    check("all_gather_into_tensor", out, torch.cat([inputs(r, k) for r in range(world)]))
    whole = torch.zeros(world * k, device=device)
    whole[rank * k : (rank + 1) * k] = inputs(rank, k).to(device)
    dist.all_gather_into_tensor(whole, whole[rank * k : (rank + 1) * k])
    check("all_gather_into_tensor in place", whole, torch.cat([inputs(r, k) for r in range(world)]))
    outs = [torch.empty(k, device=device) for _ in range(world)]
    dist.all_gather(outs, inputs(rank, k).to(device))
    for r in range(world):
        check(f"all_gather list [{r}]", outs[r], inputs(r, k))

    big = [inputs(r, world * k) for r in range(world)]
    part = torch.empty(k, device=device)
    dist.reduce_scatter_tensor(part, big[rank].to(device))
    check("reduce_scatter_tensor", part, sum(b.double() for b in big)[rank * k : (rank + 1) * k])
    src = big[rank].to(device)
    dist.reduce_scatter_tensor(src[rank * k : (rank + 1) * k], src)
    check("reduce_scatter_tensor in place", src[rank * k : (rank + 1) * k], sum(b.double() for b in big)[rank * k : (rank + 1) * k])
    dist.reduce_scatter(part, list(big[rank].to(device).chunk(world)))
    check("reduce_scatter list", part, sum(b.double() for b in big)[rank * k : (rank + 1) * k])

    # All-to-all, as mixture-of-experts layers exchange tokens: equal blocks of rows (more
    # than one piece of the cross-node path), uneven splits with empty ones, the list form.
    rows, width = (1 << 18) + 3, 4
    mine = inputs(rank, world * rows * width).view(world * rows, width)
    out = torch.empty_like(mine, device=device)
    dist.all_to_all_single(out, mine.to(device))
    want = torch.cat([inputs(r, world * rows * width).view(world * rows, width)[rank * rows : (rank + 1) * rows] for r in range(world)])
    check("all_to_all_single", out, want)

    def split(src, dst):  # rows rank src sends to rank dst; some none
        return 0 if (src + dst) % 3 == 1 else 50 * (src + 1) + 7 * dst

    def sent(r):  # rank r's rows, in blocks for ranks 0..world-1
        return inputs(r + 1000, sum(split(r, b) for b in range(world)) * width).view(-1, width)

    def block(r, b):  # rows of rank r's block for rank b
        at = sum(split(r, k) for k in range(b))
        return sent(r)[at : at + split(r, b)]

    out = torch.empty(sum(split(b, rank) for b in range(world)), width, device=device)
    splits_in, splits_out = [split(rank, b) for b in range(world)], [split(b, rank) for b in range(world)]
    work = dist.all_to_all_single(out, sent(rank).to(device), output_split_sizes=splits_out, input_split_sizes=splits_in, async_op=True)
    work.wait()
    check("all_to_all_single uneven, async", out, torch.cat([block(b, rank) for b in range(world)]))
    outs = [torch.empty(split(b, rank), width, device=device) for b in range(world)]
    dist.all_to_all(outs, list(sent(rank).to(device).split(splits_in)))
    for b in range(world):
        check(f"all_to_all list [{b}]", outs[b], block(b, rank))
    dist.barrier()
side.synchronize()

# async_op on CUDA: queued on a side stream, waited for from the default stream (as
# ProcessGroupNCCL's work: wait() orders the caller's stream, not the host), and through
# the future DDP hooks take.
n = 1 << 20
x = inputs(rank, n).to(device)
with torch.cuda.stream(side):
    side.wait_stream(torch.cuda.current_stream(device))
    work = dist.all_reduce(x, async_op=True)
work.wait()
check("async all_reduce waited for from another stream", x * 2, 2 * sum(inputs(r, n).double() for r in range(world)))
torch.cuda.synchronize(device)
if not work.is_completed():
    failures.append("async work not completed after the device synchronised")
y = inputs(rank, n).to(device)
fut = dist.all_reduce(y, async_op=True).get_future()
check("async all_reduce future", fut.wait()[0], sum(inputs(r, n).double() for r in range(world)))
dist.barrier()

# Reduce to the last rank (the others' tensors untouched, as NCCL's) and scatter.
n = 100_003
x = inputs(rank, n).to(device)
dist.reduce(x, dst=world - 1)
check("reduce to the last rank", x, sum(inputs(r, n).double() for r in range(world)) if rank == world - 1 else inputs(rank, n))
k = 4099
part = torch.empty(k, device=device)
dist.scatter(part, [inputs(1000 + r, k).to(device) for r in range(world)] if rank == 0 else None, src=0)
check("scatter from rank 0", part, inputs(1000 + rank, k))

# Sends and receives, which the backend does not offer on CUDA, are a clear error on every
# rank that calls them, not a crash or a hang.
if world > 1 and (rank % 2 == 1 or rank + 1 < world):
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    try:
        (dist.send if rank % 2 == 0 else dist.recv)(torch.ones(4, device=device), peer)
        failures.append("send/recv on CUDA was not refused")
    except (ValueError, RuntimeError) as e:
        if "CUDA" not in str(e):
            failures.append(f"send/recv on CUDA: unclear error {e}")

# DDP on a CUDA model: W ranks with a batch each against one model stepped on the whole
# batch (the average of the ranks' gradients is the whole batch's gradient).
torch.manual_seed(seed % 2**31)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
ref.load_state_dict(model.state_dict())
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
g = torch.Generator().manual_seed(seed % 2**31)
for step in range(20):
    xb, yb = torch.randn(world * 16, 32, generator=g).to(device), torch.randn(world * 16, 1, generator=g).to(device)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(xb[rank * 16 : (rank + 1) * 16]), yb[rank * 16 : (rank + 1) * 16]).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(xb), yb).backward()
    ref_opt.step()
gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
if gap > 1e-4:
    failures.append(f"DDP on CUDA drifted from the whole-batch reference by {gap}")

# DASO and BSP on a CUDA model against the same run on the CPU.
def scheme_run(make, dev):
    torch.manual_seed(seed % 2**31 + 1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(dev)
    opt = make(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    gen = torch.Generator().manual_seed(seed % 2**31 + 2 + rank)
    epochs, batches = 4, 6
    copied_before = opt.host_bytes_copied
    for epoch in range(epochs):
        if hasattr(opt, "last_batch"):
            opt.last_batch = batches - 1
        total = 0.0
        for _ in range(batches):
            xb, yb = torch.randn(8, 16, generator=gen).to(dev), torch.randn(8, 1, generator=gen).to(dev)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
        if hasattr(opt, "epoch_loss_logic"):
            opt.epoch_loss_logic(total / batches)
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    per_step = (opt.host_bytes_copied - copied_before) / (epochs * batches)
    return torch.cat([p.detach().reshape(-1).cpu() for p in net.parameters()]), total / batches, per_step / model_bytes


copied = {}
for name, make in (
    ("DASO", lambda o: gradwire.torch.DASO(o, total_epochs=4, warmup_epochs=1, cooldown_epochs=1, downcast_type=torch.float32)),
    ("DASO through host copies", lambda o: gradwire.torch.DASO(o, total_epochs=4, warmup_epochs=1, cooldown_epochs=1, downcast_type=torch.float32, device_resident=False)),
    ("BSP", lambda o: gradwire.torch.BSP(o, interval=3)),
    ("BSP through host copies", lambda o: gradwire.torch.BSP(o, interval=3, device_resident=False)),
):
    on_cpu, _, _ = scheme_run(make, torch.device("cpu"))
    on_gpu, last_loss, copies = scheme_run(make, device)
    copied[name] = copies
    gap = (on_cpu - on_gpu).abs().max().item()
    if gap > 1e-4:
        failures.append(f"{name} on CUDA is off the same run on the CPU by {gap}")
    if rank == 0:
        print(f"{name} on {device}: final epoch loss {last_loss:.4f}, max gap to the CPU run {gap:.2e}, host copies per step {copies:.2f} x the model's bytes")

# Device-resident DASO stages only what crosses nodes: nothing on one node; with every rank
# its own node, at most the sender's parameters out and the sum back (2x the model) a step.
crossing = 0.0 if world == 1 else 2.0
if copied["DASO"] > crossing:
    failures.append(f"DASO copied {copied['DASO']:.2f} x the model's bytes per step between host and device (at most {crossing} cross nodes)")
if copied["DASO"] >= copied["DASO through host copies"]:
    failures.append(f"device-resident DASO copied as much as the host path ({copied['DASO']:.2f} x the model per step)")
# BSP's averages run on the GPU communicator (its own 1/G staging): no model copies here.
if copied["BSP"] != 0:
    failures.append(f"device-resident BSP copied {copied['BSP']:.2f} x the model's bytes per step between host and device")

dist.destroy_process_group()
print(f"rank {rank}: torch_cuda on {device}, world {world}: {'ok' if not failures else 'FAILED: ' + '; '.join(failures)}")
sys.exit(1 if failures else 0)

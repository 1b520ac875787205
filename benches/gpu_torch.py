"""gradwire's NCCL calls against torch's own NCCL backend on the same CUDA buffers
(issue 32's overhead goal: <= 3 % at >= 1 MiB), one process per GPU:

    gradwire launch -n 1 -- python3 benches/gpu_torch.py [--iters 50] [--rounds 3]

Both groups live in one process (the default group is gradwire's, a second is NCCL's) and
run the same call on the same tensors, float32, in alternating rounds; each figure is the
best round's mean time per call with the stream synchronised once per round. With one
rank an in-place allreduce moves nothing (its time is the call's cost alone), while
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single copy their input into
their output, so their time grows with the size. Also the pinned
copy bandwidth torch gets (device to a pinned host tensor and back), for the staging goal
beside `gradwire gpu-bench`.
"""

import argparse
import time

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401 (registers the backend)

ap = argparse.ArgumentParser()
ap.add_argument("--iters", type=int, default=50)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--max-mib", type=int, default=256)
args = ap.parse_args()

dist.init_process_group("gradwire")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(device)
nccl = dist.new_group(backend="nccl")


def per_call(call):
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / args.iters


world = dist.get_world_size()
if rank == 0:
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, world {world}")
    print(f"{'call':<24} {'bytes':>12} {'nccl_us':>10} {'gradwire_us':>12} {'overhead_%':>10}")
mib = 1
while mib <= args.max_mib:
    n = mib * 2**18
    x, whole, spread = torch.zeros(n, device=device), torch.zeros(n * world, device=device), torch.zeros(n, device=device)
    calls = {
        "all_reduce": lambda g: dist.all_reduce(x, group=g),
        "all_gather_into_tensor": lambda g: dist.all_gather_into_tensor(whole, x, group=g),
        "reduce_scatter_tensor": lambda g: dist.reduce_scatter_tensor(x, whole, group=g),
        "all_to_all_single": lambda g: dist.all_to_all_single(spread, x, group=g),
    }
    for name, call in calls.items():
        best = {"nccl": float("inf"), "gradwire": float("inf")}
        for _ in range(args.rounds):
            for label, group in (("nccl", nccl), ("gradwire", None)):
                best[label] = min(best[label], per_call(lambda: call(group)))
        if rank == 0:
            print(f"{name:<24} {mib * 2**20:>12} {best['nccl'] * 1e6:>10.1f} {best['gradwire'] * 1e6:>12.1f} {100 * (best['gradwire'] / best['nccl'] - 1):>10.2f}")
    mib *= 4

if rank == 0:
    print("# torch pinned copies, GB/s (best of 5)")
    print(f"{'bytes':>12} {'d2h':>8} {'h2d':>8}")
    for mib in (1, 16, 256):
        d = torch.zeros(mib * 2**18, device=device)
        h = torch.empty(mib * 2**18, pin_memory=True)
        rates = []
        for src, dst in ((d, h), (h, d)):
            t_best = float("inf")
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                t_best = min(t_best, time.perf_counter() - t)
            rates.append(mib * 2**20 / t_best / 1e9)
        print(f"{mib * 2**20:>12} {rates[0]:>8.2f} {rates[1]:>8.2f}")
dist.destroy_process_group()

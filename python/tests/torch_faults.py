"""One rank of a fault test of the "gradwire" torch backend (tests/python.rs starts the
ranks directly, so nothing but the fault stops them):

    torch_faults.py kill       rank 1 SIGKILLs itself before an all_reduce the others start
    torch_faults.py kill_blocking  the same before blocking all_gather_into_tensor calls
                               (the C++ hot path's; the others' errors are raised from it)
    torch_faults.py mismatch   rank 1 all_reduces 11 elements where the others give 10
    torch_faults.py tag        (2 ranks) rank 0 sends with tag 1, rank 1 receives with tag 2:
                               messages are matched by peer and tag, so rank 1's receive
                               waits for a message nobody sends and times out naming its tag;
                               rank 0's next allreduce, which waits for rank 1 as long, raises
                               rank 1's reason or, when its own deadline comes first, names rank 1
    torch_faults.py tag_count  (2 ranks) both use tag 1, rank 1 receives 101 elements of 100

Survivors print "caught RuntimeError: ..." with the error torch raised and exit 3.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import gradwire
import gradwire.torch  # noqa: F401

mode = sys.argv[1]
dist.init_process_group("gradwire")
rank = dist.get_rank()
x = torch.ones(10 + (mode == "mismatch" and rank == 1), dtype=torch.float32)
dist.all_reduce(torch.ones(10))  # every rank is up and connected
if mode in ("kill", "kill_blocking") and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    if mode in ("tag", "tag_count"):
        if rank == 0:
            dist.send(torch.ones(100), dst=1, tag=1)
        else:
            dist.recv(torch.ones(100 + (mode == "tag_count")), src=0, tag=1 if mode == "tag_count" else 2)
    for _ in range(1000):
        if mode == "kill_blocking":
            dist.all_gather_into_tensor(torch.empty((1 << 14) * dist.get_world_size()), torch.ones(1 << 14))
            continue
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        work.wait()
        if mode == "mismatch":
            dist.all_reduce(x)
except RuntimeError as e:
    # A small send completes into the peer's ring before the peer fails its receive, so the
    # sender learns of it from its next call, as the peer's reason for leaving.
    want = {
        "kill": (gradwire.PeerLostError,),
        "kill_blocking": (gradwire.PeerLostError,),
        "mismatch": (gradwire.MismatchError,),
        "tag": (gradwire.DeadlineError, gradwire.PeerLostError),
        "tag_count": (gradwire.MismatchError, gradwire.PeerLostError),
    }[mode]
    if not isinstance(e, want):
        print(f"rank {rank}: caught {type(e).__name__}, not {want}: {e}", flush=True)
        os._exit(4)
    print(f"rank {rank}: caught RuntimeError ({type(e).__name__}) after {time.monotonic() - start:.2f} s: {e}", flush=True)
    os._exit(3)
print(f"rank {rank}: no error", flush=True)
os._exit(0)

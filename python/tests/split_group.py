"""Under torchrun with 4 ranks (BACKEND is "gradwire" or "gloo"): `dist.split_group`, as the
caller compares with gloo's run of the same script. Two splits of the world, [[0, 2], [1, 3]]
(every rank in a group) and [[3, 0]] (ranks 1 and 2 in none, and an order other than the
parent's: rank 3 is the new group's rank 0); each rank prints its new rank, size, group name
and an allreduce over the new group, as "split: ..." lines, then "split group: ok".

    split_group.py BACKEND [device_id]

With `device_id`: the group made with `init_process_group(device_id=cpu:0)`, and a
`new_group([0, 1])` that reduces on its members ("device_id new_group: ok").
"""

import os
import sys

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401  (registers the backend)

backend = sys.argv[1]
torch.set_num_threads(1)
if sys.argv[2:] == ["device_id"]:
    # init_process_group(device_id=...) makes torch treat the group as one that splits:
    # it connects eagerly and new_group asks ranks outside the new group for a no-color
    # split (torch 2.15's gloo lacks that call; gradwire answers it).
    dist.init_process_group(backend, device_id=torch.device("cpu", 0))
    rank = dist.get_rank()
    g = dist.new_group([0, 1])
    t = torch.full((2,), float(rank + 1))
    if rank in (0, 1):
        dist.all_reduce(t, group=g)
    ok = t.tolist() == ([3.0, 3.0] if rank in (0, 1) else [float(rank + 1)] * 2)
    dist.destroy_process_group()
    print(f"rank {rank}: device_id new_group: {'ok' if ok else t.tolist()}", flush=True)
    sys.exit(0 if ok else 1)
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, "run with 4 ranks"
pairs = dist.split_group(split_ranks=[[0, 2], [1, 3]])
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t, group=pairs)
print(f"split: rank {rank} pairs: rank {dist.get_rank(pairs)} of {dist.get_world_size(pairs)}, name {pairs.group_name}, sum {t.tolist()}", flush=True)
ends = dist.split_group(split_ranks=[[3, 0]])
if rank in (0, 3):
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.broadcast(t, group=ends, group_src=0)
    print(f"split: rank {rank} ends: rank {dist.get_rank(ends)} of {dist.get_world_size(ends)}, broadcast from group rank 0 {t.tolist()}", flush=True)
else:
    print(f"split: rank {rank} ends: not a member ({ends == dist.GroupMember.NON_GROUP_MEMBER})", flush=True)
dist.destroy_process_group(pairs)
dist.destroy_process_group()
print(f"rank {rank}: split group: ok", flush=True)
if backend == "gloo":
    # The reference's data is out. torch's gloo can abort in its own teardown at interpreter
    # exit ("terminate called without an active exception"), which is not the run under test.
    sys.stderr.flush()
    os._exit(0)

"""A PyTorch DDP communication hook that allreduces each gradient bucket through gradwire,
in place in the bucket's own flat tensor (no copy).

    from gradwire import Comm
    from gradwire.ddp import allreduce_hook
    ddp.register_comm_hook(None, allreduce_hook(Comm()))

It averages, as DDP's default (gloo/NCCL) hook does.
"""

import torch


def allreduce_hook(comm, op="avg"):
    """Returns a DDP comm hook that reduces each bucket with `op` through `comm`."""

    def hook(state, bucket):
        buf = bucket.buffer()
        comm.allreduce(buf, op=op)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook

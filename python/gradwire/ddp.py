"""A PyTorch DDP communication hook that allreduces each gradient bucket through gradwire,
in place in the bucket's own flat tensor (no copy), without blocking: the hook starts
gradwire's non-blocking allreduce and returns a future that completes when it does, so
the buckets reduce while backward goes on.

    from gradwire import Comm
    from gradwire.ddp import allreduce_hook
    ddp.register_comm_hook(None, allreduce_hook(Comm()))

It averages, as DDP's default (gloo/NCCL) hook does. With `init_process_group("gradwire")`
no hook is needed: DDP's own allreduce already runs on gradwire.
"""

from typing import Any, Callable

from . import Comm
from .torch import completed_future_of


def allreduce_hook(comm: "Comm", op: str = "avg") -> Callable[[Any, Any], Any]:
    """Returns a DDP comm hook that reduces each bucket with `op` through `comm`."""

    def hook(state, bucket):
        return completed_future_of(comm, bucket.buffer(), op=op)

    return hook

"""gradwire as a torch.distributed backend for CPU and CUDA tensors.

    import gradwire.torch  # registers the backend (an installed package also does so by entry point)
    torch.distributed.init_process_group("gradwire")

Everything torch builds on process groups then runs on gradwire: DDP, FSDP2 and DeviceMesh,
DTensor and tensor parallelism, ZeroRedundancyOptimizer, the DDP communication hooks,
post-local SGD, object collectives, subgroups (`new_group`, `split_group`).

The backend is a C++ `c10d::Backend` (_torch_backend.cpp, built against the torch in use at
the first group: see _torch_native) that torch registers for CPU and CUDA tensors and names
like any built-in backend; this module registers it and does nothing else. Each group is a
gradwire communicator made from a unique id that the group's rank 0 creates and hands to
the members through torch's own store (as ProcessGroupNCCL does with NCCL's id), so
MASTER_PORT stays torch's and no job secret is needed. A group's `timeout` is its deadline
(torch's 30-minute default means gradwire's own, `GRADWIRE_TIMEOUT_MS`, default 60 s): a
dead or mismatched peer is an error naming the rank and the call, never a hang.

- Blocking calls (`async_op=False`) run gradwire's blocking call on the caller's thread;
  async ones start its non-blocking call, and one C++ thread per group completes them in
  order, without the GIL. `Work.wait(timeout)` raises "Timed out" past its timeout and
  leaves the call pending. A failed call raises gradwire's error itself (PeerLostError,
  MismatchError, DeadlineError), from `wait()` and from the work's future (DDP: from
  backward).
- allreduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and all-to-all are
  non-blocking; the list and coalesced forms, gather, scatter and reduce run when called and
  return completed work.
- Reductions: SUM, AVG, MIN, MAX, PRODUCT on gradwire's dtypes; BAND, BOR, BXOR on integer
  and bool tensors; complex tensors as pairs of reals for SUM and AVG. Any dtype moves
  (broadcast, gathers, scatter, all-to-all, sends).
- isend, irecv and batch_isend_irecv gather into one gradwire batch, started when one of
  them is waited for or polled, or before the group's next other call: a ring of sends and
  receives completes, as on NCCL. Messages are matched by (peer, tag). A receive from any
  source (`recv` without `src`) is refused: gradwire matches every message to its sender.
- CUDA tensors run on the group's GPU communicator of their device (made at the first CUDA
  call there): NCCL inside a node, gradwire's hierarchical path through pinned host memory
  across nodes, enqueued on torch's current stream as ProcessGroupNCCL's calls are; an
  async call's work waits as NCCL's does (`wait()` makes the caller's current stream wait,
  `is_completed()` asks the GPU, the future is CUDA-aware). Sends and receives take CPU
  tensors.

Checked against torch 2.15 and 2.11.
"""

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import Comm, _torch_native

__all__ = ["register", "comm_of", "completed_future_of"]


def _create(store: dist.Store, rank: int, size: int, timeout: Optional[timedelta] = None):
    """torch's creator of a "gradwire" group: torch's ProcessGroup over the backend."""
    group = _torch_native.backend_module().GradwireGroup
    return group(store, rank, size, timeout if timeout is not None else timedelta(minutes=30))


def comm_of(group=None) -> Optional[Comm]:
    """The gradwire communicator under a "gradwire" process group (the default group where
    `group` is None), as a gradwire.Comm the schemes run on; None for a group of another
    backend. The group owns it: it is finalized with the group."""
    import torch.distributed as dist

    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    address = getattr(backend, "comm_address", None)
    if address is None:
        return None
    return Comm._view(address)


def completed_future_of(comm: Comm, tensor: torch.Tensor, op: str = "sum") -> torch.futures.Future:
    """Starts gradwire's non-blocking in-place allreduce of a contiguous CPU `tensor` and
    returns a torch Future that completes with it (what a DDP communication hook returns)."""
    future = _torch_native.backend_module().allreduce_future(comm._live().value, tensor, op)
    # DDP takes a Python hook's result only as a Python object, as torch's own hooks make it.
    return future.then(lambda done: done.value()[0])


def register() -> None:
    """Registers the "gradwire" backend for CPU and CUDA tensors (idempotent)."""
    if "gradwire" in getattr(dist.Backend, "backend_list", []):
        return
    dist.Backend.register_backend("gradwire", _create, devices=["cpu", "cuda"])


register()

# The schemes as optimizers, beside the backend they may run on.
from gradwire.optim import BSP, DASO, ParameterServer, PoolSampler  # noqa: E402,F401

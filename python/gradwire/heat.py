"""Heat's DASO interface on gradwire: a training script written for Heat's DASO runs with
`import heat as ht` changed to `import gradwire.heat as ht`. It provides what such scripts
use: `ht.optim.DASO`, `ht.nn.DataParallelMultiGPU` and `ht.MPI_WORLD` (`rank`, `size`).
The ranks come from `gradwire launch` (or torchrun), not from mpirun. As in Heat,
`last_batch` is the index of the epoch's last batch (`len(loader) - 1`); a wrong one is an
error at `epoch_loss_logic`, not a silent drift."""

import types
from typing import Any

import torch

from gradwire.optim import DASO, resolve_comm

__all__ = ["MPI_WORLD", "optim", "nn", "DataParallelMultiGPU"]


class _World:
    """The whole job, as Heat's `MPI_WORLD` (its communicator made on first use)."""

    @property
    def comm(self):
        return resolve_comm()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size


MPI_WORLD = _World()


class DataParallelMultiGPU(torch.nn.Module):
    """The model wrapper of Heat's DASO: forwards to `module` and hands it to `optimizer`
    (`set_model`). Unlike Heat it does not re-initialise the parameters: DASO made them
    equal on every rank (rank 0's) when it was created."""

    def __init__(self, module: torch.nn.Module, optimizer: DASO, comm: Any = None) -> None:
        super().__init__()
        if not isinstance(optimizer, DASO):
            raise TypeError(f"DataParallelMultiGPU: optimizer must be a gradwire DASO, got {type(optimizer).__name__}")
        self.module = module
        self.comm = optimizer.comm if comm is None else resolve_comm(comm)
        optimizer.set_model(module)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


optim = types.SimpleNamespace(DASO=DASO)
nn = types.SimpleNamespace(DataParallelMultiGPU=DataParallelMultiGPU)

"""`ht.nn`: Heat's DASO model wrapper `DataParallelMultiGPU`; every other name is torch.nn's
(`ht.nn.Module`, `ht.nn.Conv2d`, ...), as in Heat."""

from typing import Any

import torch

from gradwire.heat.nn import functional
from gradwire.optim import DASO, resolve_comm

__all__ = ["DataParallelMultiGPU", "functional"]


class DataParallelMultiGPU(torch.nn.Module):
    """The model wrapper of Heat's DASO: forwards to `module` and hands it to `optimizer`
    (`set_model`: its buffers become rank 0's and DASO keeps them in agreement). Unlike
    Heat it does not re-initialise the parameters: DASO made them equal on every rank
    (rank 0's) when it was created."""

    def __init__(self, module: torch.nn.Module, optimizer: DASO, comm: Any = None) -> None:
        super().__init__()
        if not isinstance(optimizer, DASO):
            raise TypeError(f"DataParallelMultiGPU: optimizer must be a gradwire DASO, got {type(optimizer).__name__}")
        self.module = module
        self.comm = optimizer.comm if comm is None else resolve_comm(comm)
        optimizer.set_model(module)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


def __getattr__(name: str) -> Any:
    return getattr(torch.nn, name)

"""A model's registered buffers (BatchNorm's running mean and variance, its batch count)
kept in agreement across ranks by the schemes of `gradwire.optim`.

The schemes merge parameters; buffers are not parameters, so without this each rank keeps
the statistics of its own data and evaluating on any rank sees that rank's alone. Floating
buffers are averaged over the ranks (as timm's `distribute_bn` does; the mean of the
ranks' running variances leaves out the spread between their means, which a running
estimate already blurs). Other buffers (integer counts) are rank 0's. Every rank computes
the same sum and the same division, so the result is bit-identical everywhere.
"""

from typing import List, Optional

import torch

from gradwire import Comm


class ModelBuffers:
    """The buffers of `module`, synchronised over `comm`: `broadcast()` makes every rank's
    rank 0's (at construction), `average()` averages the floating ones (at the scheme's
    agreement points), `agree()` does both (at epoch ends and `finish()`). A model without
    buffers costs nothing."""

    def __init__(self, module: torch.nn.Module, comm: Comm) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        self.comm = comm
        seen, self.floating, self.other = set(), [], []
        for b in module.buffers():
            if id(b) in seen:
                continue
            seen.add(id(b))
            (self.floating if b.is_floating_point() else self.other).append(b)

    def __len__(self) -> int:
        return len(self.floating) + len(self.other)

    @staticmethod
    def _flat(buffers: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).to("cpu", dtype) for b in buffers])

    @staticmethod
    def _unflatten(flat: torch.Tensor, buffers: List[torch.Tensor]) -> None:
        at = 0
        with torch.no_grad():
            for b in buffers:
                k = b.numel()
                b.copy_(flat[at : at + k].view_as(b))
                at += k

    def broadcast(self, comm: Optional[Comm] = None) -> None:
        """Every buffer becomes rank 0's of `comm` (default: the scheme's; DASO hands its
        node's, as Heat's DDP broadcasts them in the node). Collective over it."""
        comm = comm if comm is not None else self.comm
        for buffers, dtype in ((self.floating, torch.float64), (self.other, torch.int64)):
            if buffers and comm.size > 1:
                flat = self._flat(buffers, dtype)
                comm.broadcast(flat, 0)
                self._unflatten(flat, buffers)

    def average(self) -> None:
        """Every floating buffer becomes the ranks' mean (summed in float64). Collective."""
        if self.floating and self.comm.size > 1:
            flat = self._flat(self.floating, torch.float64)
            self.comm.allreduce(flat)
            flat /= self.comm.size
            self._unflatten(flat, self.floating)

    def agree(self) -> None:
        """The floating buffers averaged, the others rank 0's. Collective."""
        self.average()
        if self.other and self.comm.size > 1:
            flat = self._flat(self.other, torch.int64)
            self.comm.broadcast(flat, 0)
            self._unflatten(flat, self.other)

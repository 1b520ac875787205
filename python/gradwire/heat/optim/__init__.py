"""`ht.optim`: gradwire's DASO; every other name is torch.optim's (`ht.optim.SGD`, ...), as
in Heat."""

from typing import Any

import torch

from gradwire.optim import DASO

__all__ = ["DASO"]


def __getattr__(name: str) -> Any:
    return getattr(torch.optim, name)

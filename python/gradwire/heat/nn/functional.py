"""`ht.nn.functional`: torch.nn.functional's names, as in Heat."""

from typing import Any

import torch.nn.functional as _functional


def __getattr__(name: str) -> Any:
    return getattr(_functional, name)

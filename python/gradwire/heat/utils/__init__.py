"""`ht.utils`: its `data` module."""

from gradwire.heat.utils import data

__all__ = ["data"]

"""`ht.MPI_WORLD`, `ht.MPI` and Heat's device selection, over gradwire's communicator for
the whole job (the launcher's ranks)."""

import os
from typing import Any

import numpy as np
import torch

from gradwire.optim import resolve_comm


class _Op:
    def __init__(self, mpi_name: str, name: str) -> None:
        self.mpi_name, self.name = mpi_name, name  # name: gradwire's

    def __repr__(self) -> str:
        return f"MPI.{self.mpi_name}"


class MPI:
    """The few names of mpi4py's `MPI` that DASO scripts use."""

    SUM, MAX, MIN, PROD = _Op("SUM", "sum"), _Op("MAX", "max"), _Op("MIN", "min"), _Op("PROD", "product")
    IN_PLACE = object()

    @staticmethod
    def Finalize() -> None:  # noqa: N802 (mpi4py's name)
        """Nothing to do: the communicator ends with the process (as mpi4py's atexit)."""


def _array(buf: Any, what: str) -> Any:
    """A NumPy array or CPU tensor, from `buf` or mpi4py's `[buf, datatype]` form."""
    if isinstance(buf, (list, tuple)) and buf:
        buf = buf[0]
    if isinstance(buf, torch.Tensor):
        if not buf.is_cpu or not buf.is_contiguous():
            raise ValueError(f"MPI_WORLD.{what}: takes contiguous CPU tensors or NumPy arrays, got one on {buf.device}")
        return buf
    if isinstance(buf, np.ndarray):
        return buf
    raise TypeError(f"MPI_WORLD.{what}: takes a tensor or a NumPy array, got {type(buf).__name__}")


class _World:
    """The whole job, as Heat's `MPI_WORLD`: its communicator (made on first use), rank,
    size and the blocking collectives of mpi4py's upper-case (buffer) interface."""

    @property
    def comm(self):
        return resolve_comm()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.size

    def Barrier(self) -> None:  # noqa: N802 (mpi4py's name)
        self.comm.barrier()

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: _Op = MPI.SUM) -> None:  # noqa: N802 (mpi4py's name)
        """`recvbuf` = the reduction of every rank's `sendbuf` (`MPI.IN_PLACE`: of `recvbuf`)."""
        if not isinstance(op, _Op):
            raise TypeError(f"MPI_WORLD.Allreduce: op must be MPI.SUM, MAX, MIN or PROD, got {op!r}")
        out = _array(recvbuf, "Allreduce")
        if sendbuf is MPI.IN_PLACE:
            self.comm.allreduce(out, op.name)
        else:
            self.comm.allreduce(_array(sendbuf, "Allreduce"), op.name, out=out)

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802 (mpi4py's name)
        self.comm.broadcast(_array(buf, "Bcast"), root)


MPI_WORLD = _World()


class _Device:
    """A device as Heat names it: `torch_device` is the string torch takes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    @property
    def torch_device(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return f"cuda:{local % max(1, torch.cuda.device_count())}"

    def __repr__(self) -> str:
        return f"device({self.kind})"


cpu, gpu = _Device("cpu"), _Device("gpu")
_default = cpu


def use_device(device: Any = None) -> None:
    """Heat's default device from here on: "cpu", "gpu" (this rank's CUDA device) or None."""
    global _default
    if device is None or device in ("cpu", cpu):
        _default = cpu
    elif device in ("gpu", gpu):
        if not torch.cuda.is_available():
            raise RuntimeError("use_device('gpu'): torch sees no CUDA device")
        _default = gpu
    else:
        raise ValueError(f"use_device: 'cpu' or 'gpu', got {device!r}")


def get_device() -> _Device:
    """The default device: `ht.cpu` unless `use_device("gpu")` (as in Heat)."""
    return _default

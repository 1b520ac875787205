"""gradwire from Python: ctypes over the gradwire shared library (no compiled extension).

Buffers are NumPy arrays or CPU PyTorch tensors, used in place through their data pointer:
nothing is copied between your array and gradwire.

    from gradwire import Comm
    comm = Comm()                      # RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher
    comm.allreduce(grads, op="avg")    # in place

The library is found through $GRADWIRE_LIB, then inside this package (where `pip install .`
puts it), then in the repository's target/release or target/debug, then on the system
library path. `import gradwire.torch` (or, once installed, just `init_process_group("gradwire")`)
makes gradwire a torch.distributed backend.
"""

import collections
import ctypes
import ctypes.util
import glob
import numbers
import os
import sys
import threading
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

__all__ = [
    "Comm",
    "Hierarchy",
    "GpuComm",
    "Strategy",
    "Work",
    "GradwireError",
    "ConfigError",
    "InvalidArgumentError",
    "DeadlineError",
    "InProgressError",
    "PeerLostError",
    "MismatchError",
    "AbortedError",
    "AuthError",
    "UnsupportedError",
    "load_library",
    "unique_id",
    "UNIQUE_ID_BYTES",
]

# Element types by NumPy's and torch's names (ffi/gradwire.h's gradwire_dtype_t).
# A NumPy array or a CPU torch tensor (used in place through its data pointer).
Buffer = Any

# The C ABI's codes and signatures below are checked against ffi/gradwire.h by
# tests/ffi_header.rs (python_tables_match_the_header).
_DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int8": 4, "uint8": 5, "int32": 6, "int64": 7, "bool": 8}
_OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3, "product": 4}
# gradwire_buffer_layout's collective codes and answers.
_CALLS = {"allreduce": 0, "broadcast": 1, "reduce": 2, "allgather": 3, "reduce_scatter": 4, "alltoall": 5}
_LAYOUTS = {"apart": 0, "in_place": 1, "block": 2, "overlapping": 3}
# Ranges of the C types integers cross ctypes as (ffi/gradwire.h).
_INT = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_SIZE_MAX = 2**64 - 1
UNIQUE_ID_BYTES = 128


class _P2pOp(ctypes.Structure):
    """gradwire_p2p_op_t."""

    _fields_ = [
        ("kind", ctypes.c_uint),
        ("peer", ctypes.c_int),
        ("tag", ctypes.c_uint),
        ("dtype", ctypes.c_uint),
        ("count", ctypes.c_size_t),
        ("buf", ctypes.c_void_p),
    ]


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class GradwireError(RuntimeError):
    """A gradwire call failed; `code` is the C result code, the message its error text.
    Each kind has its own subclass (below), so a caller can catch one kind."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (gradwire code {code})")
        self.code = code


class ConfigError(GradwireError):
    """Environment or settings missing or malformed (GRADWIRE_ERR_CONFIG)."""


class InvalidArgumentError(GradwireError, ValueError):
    """A bad argument: NULL, dead handle, unknown enum, overflow, bad rank."""


class DeadlineError(GradwireError, TimeoutError):
    """A deadline passed (GRADWIRE_TIMEOUT_MS); for Work.wait with a timeout: still running."""


class PeerLostError(GradwireError, ConnectionError):
    """A peer process died or its connection closed; the message names the rank."""


class MismatchError(GradwireError):
    """Ranks issued different collective calls; the message names both."""


class AbortedError(GradwireError):
    """The communicator was aborted, here or by a peer."""


class AuthError(GradwireError, PermissionError):
    """A peer failed the job-secret check."""


class UnsupportedError(GradwireError):
    """Not available in this build or on this host."""


class InProgressError(GradwireError, TimeoutError):
    """A bounded `Work.wait(timeout_ms)` ended before the operation did; the work stays
    valid and can be waited for again."""


_ERRORS = {
    -2: ConfigError,
    -3: InvalidArgumentError,
    -4: DeadlineError,
    -5: PeerLostError,
    -6: MismatchError,
    -7: AbortedError,
    -8: AuthError,
    -11: UnsupportedError,
    -12: InProgressError,
}


def _candidates():
    env = os.environ.get("GRADWIRE_LIB")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    # Bundled by `pip install .` (named with the interpreter's extension suffix).
    yield from sorted(glob.glob(os.path.join(here, "libgradwire*.so")))
    repo = os.path.dirname(os.path.dirname(here))
    for profile in ("release", "debug"):
        yield os.path.join(repo, "target", profile, "libgradwire.so")
    found = ctypes.util.find_library("gradwire")
    if found:
        yield found


_lib = None


def _signatures():
    """The C calls' parameter types (every one returns int), and those of the calls a
    library built with the cargo feature `cuda` (the default) adds."""
    p, i, sz, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint
    pp = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "gradwire_init": [pp],
        "gradwire_get_unique_id": [ctypes.POINTER(_UniqueId)],
        "gradwire_comm_init_rank": [pp, ctypes.POINTER(_UniqueId), i, i],
        "gradwire_comm_init_rank_timeout": [pp, ctypes.POINTER(_UniqueId), i, i, ctypes.c_int64],
        "gradwire_comm_rank": [p, ctypes.POINTER(i)],
        "gradwire_comm_size": [p, ctypes.POINTER(i)],
        "gradwire_comm_split": [p, i, i, pp],
        "gradwire_comm_split_type": [p, i, pp],
        "gradwire_allreduce": [p, p, p, sz, u, u],
        "gradwire_iallreduce": [p, p, p, sz, u, u, pp],
        "gradwire_wait": [p, ctypes.c_int64],
        "gradwire_broadcast": [p, p, sz, u, i],
        "gradwire_ibroadcast": [p, p, sz, u, i, pp],
        "gradwire_iallgather": [p, p, p, sz, u, pp],
        "gradwire_ireduce_scatter": [p, p, p, sz, u, u, pp],
        "gradwire_reduce": [p, p, p, sz, u, u, i],
        "gradwire_buffer_layout": [p, u, p, sz, p, sz, ctypes.POINTER(i)],
        "gradwire_allgather": [p, p, p, sz, u],
        "gradwire_reduce_scatter": [p, p, p, sz, u, u],
        "gradwire_barrier": [p],
        "gradwire_alltoall": [p, p, ctypes.POINTER(sz), p, ctypes.POINTER(sz), sz, u],
        "gradwire_ialltoall": [p, p, ctypes.POINTER(sz), p, ctypes.POINTER(sz), sz, u, pp],
        "gradwire_send": [p, p, sz, u, i, u],
        "gradwire_recv": [p, p, sz, u, i, u],
        "gradwire_test": [p, ctypes.POINTER(ctypes.c_int)],
        "gradwire_strategy_create": [p, ctypes.c_char_p, ctypes.c_char_p, p, sz, pp],
        "gradwire_strategy_free": [p],
        "gradwire_strategy_framework_update": [p, ctypes.POINTER(ctypes.c_int)],
        "gradwire_strategy_start": [p, p, sz],
        "gradwire_strategy_before_update": [p, p, sz, ctypes.c_int],
        "gradwire_strategy_after_update": [p, p, sz, ctypes.c_int],
        "gradwire_strategy_step": [p, p, p, sz, ctypes.c_int],
        "gradwire_strategy_end_epoch": [p, p, sz, ctypes.c_double, ctypes.POINTER(ctypes.c_double)],
        "gradwire_strategy_current_model": [p, p, sz],
        "gradwire_strategy_finish": [p, p, sz],
        "gradwire_strategy_bytes_sent": [p, ctypes.POINTER(ctypes.c_uint64)],
        "gradwire_strategy_describe": [p, ctypes.c_char_p, sz],
        "gradwire_strategy_set_last_batch": [p, sz],
        "gradwire_strategy_shared_pool": [p, ctypes.POINTER(ctypes.c_int)],
        "gradwire_strategy_claim_batch": [p, sz, ctypes.POINTER(ctypes.c_int)],
        "gradwire_strategy_take_actions": [p, ctypes.POINTER(ctypes.c_int64), sz, ctypes.POINTER(sz)],
        "gradwire_strategy_node_average_next": [p, ctypes.POINTER(ctypes.c_int)],
        "gradwire_hierarchy_create": [p, pp],
        "gradwire_hierarchy_free": [p],
        "gradwire_hierarchy_nodes": [p, ctypes.POINTER(i)],
        "gradwire_hierarchical_allreduce": [p, p, p, sz, u, u, u],
        "gradwire_hierarchical_iallreduce": [p, p, p, sz, u, u, u, pp],
        "gradwire_p2p_batch": [p, ctypes.POINTER(_P2pOp), sz],
        "gradwire_ip2p_batch": [p, ctypes.POINTER(_P2pOp), sz, pp],
        "gradwire_alloc": [p, sz, pp],
        "gradwire_free": [p, p],
        "gradwire_register": [p, p, sz],
        "gradwire_deregister": [p, p],
        "gradwire_finalize": [p],
    }
    # Present when the library was built with the cargo feature `cuda` (the default).
    gpu_sigs = {
        "gradwire_gpu_comm_create": [p, i, pp],
        "gradwire_gpu_comm_free": [p],
        "gradwire_gpu_allreduce": [p, p, p, sz, u, u, p],
        "gradwire_gpu_broadcast": [p, p, sz, u, i, p],
        "gradwire_gpu_reduce": [p, p, p, sz, u, u, i, p],
        "gradwire_gpu_reduce_scatter": [p, p, p, sz, u, u, p],
        "gradwire_gpu_allgather": [p, p, p, sz, u, p],
        "gradwire_gpu_alltoall": [p, p, ctypes.POINTER(sz), p, ctypes.POINTER(sz), sz, u, p],
    }
    return sigs, gpu_sigs


def load_library() -> ctypes.CDLL:
    """Loads libgradwire once and declares the C signatures."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            tried.append(f"{path} ({e})")
    else:
        raise ImportError("libgradwire.so not found; `pip install .` in the repository bundles it (or build it with cargo build --release, or set GRADWIRE_LIB). Tried: " + ", ".join(tried))
    sigs, gpu_sigs = _signatures()
    if hasattr(lib, "gradwire_gpu_comm_create"):
        sigs.update(gpu_sigs)
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = ctypes.c_int
    lib.gradwire_last_error.argtypes = []
    lib.gradwire_last_error.restype = ctypes.c_char_p
    _lib = lib
    return lib


def _check(code):
    if code != 0:
        raise _ERRORS.get(code, GradwireError)(code, load_library().gradwire_last_error().decode(errors="replace"))


# torch dtype -> gradwire dtype code, learned on first use: a call costs a dictionary
# lookup instead of formatting the dtype's name (this path runs once per collective).
_TORCH_DTYPES = {}


def _tensor(x, what):
    """(pointer, element count, dtype code) of a contiguous torch tensor."""
    if not x.is_contiguous():
        raise ValueError(f"{what}: tensor is not contiguous")
    code = _TORCH_DTYPES.get(x.dtype)
    if code is None:
        code = _TORCH_DTYPES[x.dtype] = _dtype(str(x.dtype).replace("torch.", ""), what)
    return x.data_ptr(), x.numel(), code


def _buffer(x, what):
    """(pointer, element count, dtype code) of a contiguous NumPy array or CPU tensor."""
    if hasattr(x, "data_ptr"):  # torch.Tensor
        if not x.is_cpu:
            raise ValueError(f"{what}: tensor is on {x.device}; this call takes CPU tensors (CUDA tensors go through Comm.gpu(device))")
        return _tensor(x, what)
    if hasattr(x, "__array_interface__"):
        if not x.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{what}: array is not C-contiguous")
        if not x.flags["WRITEABLE"]:
            raise ValueError(f"{what}: array is read-only")
        return x.ctypes.data, x.size, _dtype(x.dtype.name, what)
    raise TypeError(f"{what}: expected a NumPy array or a torch tensor, got {type(x).__name__}")


def _int_arg(value, name, lo, hi, why=None):
    """`value` as an int in lo..hi, else TypeError/ValueError naming `name`. Checked here
    because ctypes wraps an integer that does not fit the C type (2**40 as a C int is 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)  # NumPy integers too
    if not lo <= value <= hi:
        raise ValueError(f"{name} {value} is {why or f'out of range {lo}..{hi}'}")
    return value


def _dtype(name, what):
    if name not in _DTYPES:
        raise TypeError(f"{what}: dtype {name} is not supported ({', '.join(_DTYPES)})")
    return _DTYPES[name]


def _op(op):
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r} ({', '.join(_OPS)})")
    return _OPS[op]


class Work:
    """A non-blocking operation; keeps its buffers alive until waited for. Dropped without a
    wait, it is waited for in the background (with its buffers) rather than freed early."""

    def __init__(self, handle, keep):
        self._h, self._keep = handle, keep

    def __del__(self):
        if getattr(self, "_h", None) is not None and not sys.is_finalizing():
            h, keep = self._h, self._keep
            _background.run(lambda: _wait_dropped(h, keep))
            self._h = None

    def test(self) -> bool:
        """Whether the operation has finished, without waiting; wait() then returns (or
        raises its failure) at once."""
        if self._h is None:
            return True
        done = ctypes.c_int(0)
        _check(load_library().gradwire_test(self._h, ctypes.byref(done)))
        return bool(done.value)

    def wait(self, timeout_ms: int = -1) -> Any:
        """Waits (timeout_ms < 0: until done). Raises GradwireError on failure
        (DeadlineError: the operation failed at its deadline), InProgressError when it is
        still running after timeout_ms (wait again)."""
        if self._h is None:
            raise RuntimeError("work already waited for")
        # Any negative int64 means "until done" in C; a bad value leaves the work valid.
        timeout_ms = _int_arg(timeout_ms, "wait: timeout_ms", *_INT64, f"out of range for an int64 ({_INT64[0]}..{_INT64[1]}; < 0 waits until done)")
        code = load_library().gradwire_wait(self._h, timeout_ms)
        if code != -12:  # else still running: the work stays valid
            self._h = None
        _check(code)
        return self._keep[-1] if self._keep else None


class _CommPart:
    """An object made on a communicator (`_h`, `_comm`) and freed with it: by `free()`, when
    dropped, or by the communicator's finalize (after which freeing it again does nothing)."""

    _h = None

    def __del__(self):
        if getattr(self, "_h", None) is not None and not sys.is_finalizing():
            try:
                self.free()
            except GradwireError:
                pass

    def free(self) -> None:
        raise NotImplementedError

    def _free(self, c_function):
        if self._h is not None:
            h, self._h = self._h, None
            if self._comm._h is not None:
                _check(getattr(load_library(), c_function)(h))


class Hierarchy(_CommPart):
    """The node-local and cross-node groups of a communicator (`Comm.hierarchy()`), made
    once, for hierarchical allreduces over every rank of that communicator. algo
    "sharded": reduce-scatter in the node, one cross-node allreduce per shard, allgather in
    the node; "leader": reduce to local rank 0, allreduce among those, broadcast."""

    _ALGOS = {"sharded": 0, "leader": 1}

    def __init__(self, comm: "Comm") -> None:
        h = ctypes.c_void_p()
        _check(load_library().gradwire_hierarchy_create(comm._live(), ctypes.byref(h)))
        self._h, self._comm = h, comm
        nodes = ctypes.c_int(0)
        _check(load_library().gradwire_hierarchy_nodes(h, ctypes.byref(nodes)))
        self.nodes = nodes.value

    def _args(self, x, op, algo, what):
        if algo not in self._ALGOS:
            raise ValueError(f"{what}: unknown algo {algo!r} (sharded or leader)")
        if self._h is None:
            raise RuntimeError(f"{what}: hierarchy is freed")
        p, n, dt = _buffer(x, what)
        return p, n, dt, _op(op), self._ALGOS[algo]

    def allreduce(self, x: Buffer, op: str = "sum", algo: str = "sharded") -> Buffer:
        """Reduces `x` in place over every rank through the hierarchy; returns `x`."""
        p, n, dt, o, a = self._args(x, op, algo, "hierarchical allreduce")
        _check(load_library().gradwire_hierarchical_allreduce(self._h, p, p, n, dt, o, a))
        return x

    def iallreduce(self, x: Buffer, op: str = "sum", algo: str = "sharded") -> "Work":
        """Starts an in-place hierarchical allreduce of `x`; a Work whose wait() returns `x`."""
        p, n, dt, o, a = self._args(x, op, algo, "hierarchical iallreduce")
        w = ctypes.c_void_p()
        _check(load_library().gradwire_hierarchical_iallreduce(self._h, p, p, n, dt, o, a, ctypes.byref(w)))
        return Work(w, [self, x])

    def free(self) -> None:
        """Frees the groups (also done by the communicator's finalize)."""
        self._free("gradwire_hierarchy_free")


def _device_buffer(x, what, device):
    """(pointer, element count, dtype code, stream) of a contiguous CUDA tensor on `device`;
    the stream is torch's current one there, so the call is ordered with the caller's work."""
    if not hasattr(x, "data_ptr") or not getattr(x, "is_cuda", False):
        raise ValueError(f"{what}: expected a CUDA tensor, got {getattr(x, 'device', type(x).__name__)} (host buffers go through the Comm's own calls)")
    if x.device.index != device:
        raise ValueError(f"{what}: tensor is on {x.device}, but this GPU communicator is on cuda:{device}")
    return (*_tensor(x, what), _current_stream(device))


def _current_stream(device):
    """torch's current stream on `device` as its raw cudaStream_t. torch's private raw
    lookup skips building a Stream object per call (a few microseconds of a small call);
    the public one stands in where it is missing."""
    global _raw_stream
    if _raw_stream is None:
        import torch  # noqa: PLC0415 (CUDA tensors imply torch)

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)


_raw_stream = None


def _alltoall_counts(size, n, m, send_counts, recv_counts, what):
    """(sendcounts, recvcounts, count) of an all-to-all of n elements into m: both counts
    None (equal blocks of count elements) or C arrays of one entry per rank (count 0)."""
    if (send_counts is None) != (recv_counts is None):
        raise ValueError(f"{what}: give both send_counts and recv_counts, or neither")
    if send_counts is None:
        if n % size or m != n:
            raise ValueError(f"{what}: x and out must hold the same number of elements, a multiple of {size}")
        return None, None, n // size
    counts = []
    for name, v, have in (("send_counts", send_counts, n), ("recv_counts", recv_counts, m)):
        v = [_int_arg(c, f"{what}: {name}", 0, _SIZE_MAX) for c in v]
        if len(v) != size or sum(v) != have:
            raise ValueError(f"{what}: {name} must have {size} entries summing to {have}")
        counts.append((ctypes.c_size_t * size)(*v))
    return counts[0], counts[1], 0


class GpuComm(_CommPart):
    """Collectives on CUDA tensors of one device over every rank of a communicator
    (`Comm.gpu(device)`, collective): NCCL inside a node, gradwire's hierarchical path
    through pinned host memory across nodes. Each call is enqueued on torch's current
    stream of the device, as NCCL's calls are, and returns its output tensor."""

    def __init__(self, comm: "Comm", device: int) -> None:
        lib = load_library()
        if not hasattr(lib, "gradwire_gpu_comm_create"):
            raise UnsupportedError(-11, "this libgradwire was built without the cargo feature `cuda`")
        device = _int_arg(device, "gpu: device", 0, _INT[1])
        h = ctypes.c_void_p()
        _check(lib.gradwire_gpu_comm_create(comm._live(), device, ctypes.byref(h)))
        self._h, self._comm, self.device = h, comm, device

    def _live(self):
        if self._h is None or self._comm._h is None:
            raise RuntimeError("GPU communicator is freed (or its communicator finalized)")
        return self._h

    def allreduce(self, x, op: str = "sum", out=None):
        """Reduces `x` over all ranks into `out` (default: in place); returns the result."""
        sp, n, dt, stream = _device_buffer(x, "gpu allreduce", self.device)
        rp = sp
        if out is not None:
            rp, m, dt2, _ = _device_buffer(out, "gpu allreduce out", self.device)
            if (m, dt2) != (n, dt):
                raise ValueError("gpu allreduce: out must match x in size and dtype")
        _check(load_library().gradwire_gpu_allreduce(self._live(), sp, rp, n, dt, _op(op), stream))
        return x if out is None else out

    def broadcast(self, x, root: int = 0):
        """Sends `x` of rank `root` to every rank's `x`; returns `x`."""
        p, n, dt, stream = _device_buffer(x, "gpu broadcast", self.device)
        root = _int_arg(root, "gpu broadcast: root", 0, self._comm.size - 1, f"not a rank (size {self._comm.size})")
        _check(load_library().gradwire_gpu_broadcast(self._live(), p, n, dt, root, stream))
        return x

    def reduce(self, x, root: int = 0, op: str = "sum", out=None):
        """Reduces `x` over all ranks into rank `root`'s `out` (default: its `x`, in place);
        the other ranks' `out` is not written. Returns `out` (or `x`)."""
        sp, n, dt, stream = _device_buffer(x, "gpu reduce", self.device)
        root = _int_arg(root, "gpu reduce: root", 0, self._comm.size - 1, f"not a rank (size {self._comm.size})")
        rp = sp
        if out is not None:
            rp, m, dt2, _ = _device_buffer(out, "gpu reduce out", self.device)
            if (m, dt2) != (n, dt):
                raise ValueError("gpu reduce: out must match x in size and dtype")
        _check(load_library().gradwire_gpu_reduce(self._live(), sp, rp, n, dt, _op(op), root, stream))
        return x if out is None else out

    def allgather(self, x, out):
        """Gathers every rank's `x` into `out` (size x len(x), rank order); returns `out`."""
        sp, n, dt, stream = _device_buffer(x, "gpu allgather", self.device)
        rp, m, dt2, _ = _device_buffer(out, "gpu allgather out", self.device)
        if m != n * self._comm.size or dt2 != dt:
            raise ValueError(f"gpu allgather: out must hold {self._comm.size} x {n} elements of x's dtype")
        _check(load_library().gradwire_gpu_allgather(self._live(), sp, rp, n, dt, stream))
        return out

    def reduce_scatter(self, x, out, op: str = "sum"):
        """Reduces `x` (size x len(out)) over all ranks; this rank's block lands in `out`."""
        sp, n, dt, stream = _device_buffer(x, "gpu reduce_scatter", self.device)
        rp, m, dt2, _ = _device_buffer(out, "gpu reduce_scatter out", self.device)
        if n != m * self._comm.size or dt2 != dt:
            raise ValueError(f"gpu reduce_scatter: x must hold {self._comm.size} x {m} elements of out's dtype")
        _check(load_library().gradwire_gpu_reduce_scatter(self._live(), sp, rp, m, dt, _op(op), stream))
        return out

    def alltoall(self, x, out, send_counts=None, recv_counts=None):
        """Block b of `x` goes to rank b; block b of `out` receives rank b's block for this
        rank (not overlapping `x`); returns `out`. Without counts every block is
        len(x) / size elements (every rank must then call it without counts); with them
        (element counts per rank, both given) blocks lie back to back."""
        sp, n, dt, stream = _device_buffer(x, "gpu alltoall", self.device)
        rp, m, dt2, _ = _device_buffer(out, "gpu alltoall out", self.device)
        if dt2 != dt:
            raise ValueError("gpu alltoall: out must have x's dtype")
        sc, rc, count = _alltoall_counts(self._comm.size, n, m, send_counts, recv_counts, "gpu alltoall")
        _check(load_library().gradwire_gpu_alltoall(self._live(), sp, sc, rp, rc, count, dt, stream))
        return out

    def free(self) -> None:
        """Frees the NCCL communicator (also done by the communicator's finalize)."""
        self._free("gradwire_gpu_comm_free")


class Strategy:
    """A training scheme of docs/algorithms.md on a communicator, over a flat float32 parameter
    vector (a contiguous NumPy array or CPU tensor of `len(init)` values). For ssgd, daso
    and bsp (`framework_update` True) a step is before_update(grads), your optimizer's
    step, after_update(params); for the parameter-server schemes it is step(params, grads).
    `options`: "key=value,..." (see ffi/gradwire.h). Collective: every rank makes one."""

    def __init__(self, comm: "Comm", scheme: str, init: Optional[Buffer], options: str = "", count: Optional[int] = None) -> None:
        if "\0" in scheme or "\0" in options:
            raise ValueError("Strategy: scheme and options must not contain NUL characters")
        if init is None:
            # data=caller: the caller keeps the model; only its size comes here.
            p, n = None, _int_arg(count, "Strategy count", 1, _SIZE_MAX)
        else:
            p, n, dt = _buffer(init, "Strategy init")
            if dt != _dtype("float32", "Strategy init"):
                raise TypeError("Strategy: parameters must be float32")
        self.caller_moves_data = init is None
        h = ctypes.c_void_p()
        _check(load_library().gradwire_strategy_create(comm._live(), scheme.encode(), options.encode(), p, n, ctypes.byref(h)))
        self._h, self._n, self._comm = h, n, comm
        yes = ctypes.c_int(0)
        _check(load_library().gradwire_strategy_framework_update(h, ctypes.byref(yes)))
        self.framework_update = bool(yes.value)

    def _args(self, x: Optional[Buffer], what: str):
        if self._h is None:
            raise RuntimeError("strategy is freed")
        if self.caller_moves_data:
            if x is not None:
                raise ValueError(f"{what}: the scheme was made with data=caller: pass None and run take_actions()")
            return None, 0
        p, n, dt = _buffer(x, what)
        if dt != _dtype("float32", what) or n != self._n:
            raise ValueError(f"{what}: expected {self._n} float32 values")
        return p, n

    def start(self, params: Buffer) -> None:
        """Makes `params` the same on every rank (or the servers'). Collective."""
        _check(load_library().gradwire_strategy_start(self._h, *self._args(params, "start")))

    def before_update(self, grads: Buffer, last_of_epoch: bool = False) -> None:
        _check(load_library().gradwire_strategy_before_update(self._h, *self._args(grads, "before_update"), int(last_of_epoch)))

    def after_update(self, params: Buffer, last_of_epoch: bool = False) -> None:
        _check(load_library().gradwire_strategy_after_update(self._h, *self._args(params, "after_update"), int(last_of_epoch)))

    def step(self, params: Buffer, grads: Buffer, last_of_epoch: bool = False) -> None:
        p, n = self._args(params, "step params")
        g, _ = self._args(grads, "step grads")
        _check(load_library().gradwire_strategy_step(self._h, p, g, n, int(last_of_epoch)))

    def end_epoch(self, params: Buffer, loss: float) -> float:
        """Returns the loss averaged over ranks (DASO adapts its schedule to it)."""
        mean = ctypes.c_double()
        _check(load_library().gradwire_strategy_end_epoch(self._h, *self._args(params, "end_epoch"), float(loss), ctypes.byref(mean)))
        return mean.value

    def current_model(self, out: Buffer) -> Buffer:
        _check(load_library().gradwire_strategy_current_model(self._h, *self._args(out, "current_model")))
        return out

    def finish(self, params: Buffer) -> None:
        """Leaves the final model in `params` on every rank. Collective."""
        _check(load_library().gradwire_strategy_finish(self._h, *self._args(params, "finish")))

    def _live(self):
        if self._h is None:
            raise RuntimeError("strategy is freed")
        return self._h

    @property
    def bytes_sent(self) -> int:
        b = ctypes.c_uint64()
        _check(load_library().gradwire_strategy_bytes_sent(self._live(), ctypes.byref(b)))
        return b.value

    @property
    def shared_pool(self) -> bool:
        """Whether the ranks draw minibatches from one pool per epoch (claim_batch)."""
        yes = ctypes.c_int(0)
        _check(load_library().gradwire_strategy_shared_pool(self._live(), ctypes.byref(yes)))
        return bool(yes.value)

    @property
    def node_average_next(self) -> bool:
        """Whether the next backward's gradients are averaged in the node (DASO)."""
        yes = ctypes.c_int(0)
        _check(load_library().gradwire_strategy_node_average_next(self._live(), ctypes.byref(yes)))
        return bool(yes.value)

    def claim_batch(self, total: int) -> bool:
        """With a shared pool: whether this rank may take one more of the epoch's `total`
        minibatches (False: the epoch's pool is empty)."""
        total = _int_arg(total, "claim_batch: total", 0, _SIZE_MAX)
        yes = ctypes.c_int(0)
        _check(load_library().gradwire_strategy_claim_batch(self._live(), total, ctypes.byref(yes)))
        return bool(yes.value)

    def set_last_batch(self, last_batch: int) -> None:
        """The index of the epoch's last batch, before it runs (DASO looks one batch ahead)."""
        last_batch = _int_arg(last_batch, "set_last_batch: last_batch", 0, 2**63 - 1, "negative")
        _check(load_library().gradwire_strategy_set_last_batch(self._live(), last_batch))

    def take_actions(self) -> List[Tuple[int, int, int]]:
        """With data=caller: the steps recorded since the last take, in order, as (code, a,
        b) (ffi/gradwire.h lists the codes)."""
        out = (ctypes.c_int64 * (3 * 64))()
        count, actions = ctypes.c_size_t(), []
        while True:
            _check(load_library().gradwire_strategy_take_actions(self._live(), out, 64, ctypes.byref(count)))
            actions += [(out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i in range(count.value)]
            if count.value < 64:
                return actions

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        _check(load_library().gradwire_strategy_describe(self._live(), buf, 256))
        return buf.value.decode(errors="replace")

    def free(self) -> None:
        if self._h is not None:
            _check(load_library().gradwire_strategy_free(self._h))
            self._h = None


def unique_id() -> bytes:
    """A fresh communicator id (bytes), as NCCL's ncclGetUniqueId: this process starts the
    rendezvous store it leads to. Hand the bytes to every member (e.g. through
    torch.distributed's store), which then calls Comm.from_unique_id."""
    uid = _UniqueId()
    _check(load_library().gradwire_get_unique_id(ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


class _Background:
    """One thread per process that runs the jobs handed to it, in order: waits for work
    dropped without a wait (keeping its buffers alive until gradwire no longer writes them)
    and, for gradwire.torch, completes the futures of non-blocking work. ctypes drops the
    GIL while a job waits in gradwire."""

    def __init__(self):
        self._jobs = collections.deque()
        self._cv = threading.Condition()
        self._thread = None

    def run(self, job):
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gradwire-background", daemon=True)
                self._thread.start()
            self._cv.notify()

    def is_current(self):
        """Whether the caller is this thread (a job must not wait for a later job)."""
        return threading.current_thread() is self._thread

    def _loop(self):
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # noqa: BLE001, S110 (a failing job has no one to report to; the next must run)
                pass


_background = _Background()


def _wait_dropped(handle, keep):
    load_library().gradwire_wait(handle, -1)  # its error, if any, has no one to go to
    del keep


class Comm:
    """A gradwire communicator (see the README for the environment it reads)."""

    @classmethod
    def from_unique_id(cls, uid: bytes, size: int, rank: int, timeout_ms: Optional[int] = None) -> "Comm":
        """Joins the group `uid` (from unique_id(), carried by the framework) leads to, as
        `rank` of `size`; no MASTER_PORT or job secret is read. `timeout_ms`: the deadline
        of every wait on it (default GRADWIRE_TIMEOUT_MS)."""
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"from_unique_id: uid must be the {UNIQUE_ID_BYTES} bytes unique_id() returned")
        size = _int_arg(size, "from_unique_id: size", 1, _INT[1])
        rank = _int_arg(rank, "from_unique_id: rank", 0, size - 1, f"not a rank of a group of {size}")
        raw = _UniqueId()
        ctypes.memmove(ctypes.addressof(raw), bytes(uid), UNIQUE_ID_BYTES)
        h = ctypes.c_void_p()
        if timeout_ms is None:
            _check(load_library().gradwire_comm_init_rank(ctypes.byref(h), ctypes.byref(raw), size, rank))
        else:
            timeout_ms = _int_arg(timeout_ms, "from_unique_id: timeout_ms", 1, 7 * 24 * 3600 * 1000, "out of range 1 ms .. 7 days")
            _check(load_library().gradwire_comm_init_rank_timeout(ctypes.byref(h), ctypes.byref(raw), size, rank, timeout_ms))
        return cls(h)

    @classmethod
    def _view(cls, address: int) -> "Comm":
        """The communicator at `address`, owned elsewhere (a torch group's, finalized with the
        group): finalize() on the view lets go of it without finalizing it."""
        view = cls(ctypes.c_void_p(address))
        view._borrowed = True
        return view

    _borrowed = False

    def __init__(self, _handle=None):
        lib = load_library()
        if _handle is None:
            _beside_torch()
            h = ctypes.c_void_p()
            _check(lib.gradwire_init(ctypes.byref(h)))
            _handle = h
        self._h = _handle
        # Arrays from empty() still alive, and the handle finalize() left to the last of them.
        self._arrays, self._closing = 0, None
        r, s = ctypes.c_int(), ctypes.c_int()
        _check(lib.gradwire_comm_rank(self._h, ctypes.byref(r)))
        _check(lib.gradwire_comm_size(self._h, ctypes.byref(s)))
        self.rank, self.size = r.value, s.value

    def _live(self):
        if self._h is None:
            raise RuntimeError("communicator is finalized")
        return self._h

    # The calls as the C ABI takes them: pointers, element count and dtype/op codes that
    # the caller has checked (`_buffer`), the buffers to keep alive (the last is what the
    # call returns) and whether to return a Work instead of waiting. The public methods
    # below check their arguments and call these; so does the torch backend, which checks
    # its tensors once on its own (a microsecond less per call).

    def _call(self, blocking, nonblocking, args, keep, async_op):
        """`blocking(handle, *args)`, returning keep[-1], or `nonblocking(handle, *args,
        &work)`, returning a Work that keeps `keep` alive."""
        if async_op:
            w = ctypes.c_void_p()
            _check(nonblocking(self._live(), *args, ctypes.byref(w)))
            return Work(w, keep)
        _check(blocking(self._live(), *args))
        return keep[-1]

    def _overlapping(self, call, sp, sbytes, rp, rbytes):
        """Whether `sbytes` at `sp` and `rbytes` at `rp` overlap other than as `call` takes
        them in place: gradwire's own rule, asked of it (the torch backend then copies)."""
        layout = ctypes.c_int()
        _check(load_library().gradwire_buffer_layout(self._live(), _CALLS[call], sp, sbytes, rp, rbytes, ctypes.byref(layout)))
        return layout.value == _LAYOUTS["overlapping"]

    def _allreduce(self, sp, rp, n, dt, op, keep, async_op):
        lib = load_library()
        return self._call(lib.gradwire_allreduce, lib.gradwire_iallreduce, (sp, rp, n, dt, op), keep, async_op)

    def _broadcast(self, p, n, dt, root, keep, async_op):
        lib = load_library()
        return self._call(lib.gradwire_broadcast, lib.gradwire_ibroadcast, (p, n, dt, root), keep, async_op)

    def _allgather(self, sp, rp, n, dt, keep, async_op):
        lib = load_library()
        return self._call(lib.gradwire_allgather, lib.gradwire_iallgather, (sp, rp, n, dt), keep, async_op)

    def _reduce_scatter(self, sp, rp, m, dt, op, keep, async_op):
        """`m`: the elements of the output (the input holds size x m)."""
        lib = load_library()
        return self._call(lib.gradwire_reduce_scatter, lib.gradwire_ireduce_scatter, (sp, rp, m, dt, op), keep, async_op)

    def allreduce(self, x: Buffer, op: str = "sum", out: Optional[Buffer] = None) -> Buffer:
        """Reduces `x` over all ranks into `out` (default: in place); returns the result."""
        sp, n, dt = _buffer(x, "allreduce")
        rp = sp
        if out is not None:
            rp, m, dt2 = _buffer(out, "allreduce out")
            if (m, dt2) != (n, dt):
                raise ValueError("allreduce: out must match x in size and dtype")
        return self._allreduce(sp, rp, n, dt, _op(op), [x] if out is None else [x, out], False)

    def iallreduce(self, x: Buffer, op: str = "sum") -> "Work":
        """Starts an in-place allreduce of `x`; returns a Work whose wait() returns `x`."""
        p, n, dt = _buffer(x, "iallreduce")
        return self._allreduce(p, p, n, dt, _op(op), [x], True)

    def broadcast(self, x: Buffer, root: int = 0, async_op: bool = False) -> Union[Buffer, "Work"]:
        """Sends `x` of rank `root` to every rank's `x`; returns `x` (async_op: a Work whose
        wait() returns it)."""
        root = _int_arg(root, "broadcast: root", 0, self.size - 1, f"not a rank of this communicator (size {self.size})")
        p, n, dt = _buffer(x, "broadcast")
        return self._broadcast(p, n, dt, root, [x], async_op)

    def reduce(self, x: Buffer, root: int = 0, op: str = "sum") -> Buffer:
        """Reduces every rank's `x` into rank `root`'s `x` (other ranks' `x` is left as is)."""
        root = _int_arg(root, "reduce: root", 0, self.size - 1, f"not a rank of this communicator (size {self.size})")
        p, n, dt = _buffer(x, "reduce")
        if self.rank == root:
            _check(load_library().gradwire_reduce(self._live(), p, p, n, dt, _op(op), root))
        else:
            scratch = x.copy() if hasattr(x, "__array_interface__") and not hasattr(x, "data_ptr") else x.clone()
            sp, _, _ = _buffer(scratch, "reduce")
            _check(load_library().gradwire_reduce(self._live(), p, sp, n, dt, _op(op), root))
        return x

    def allgather(self, x: Buffer, out: Buffer, async_op: bool = False) -> Union[Buffer, "Work"]:
        """Gathers every rank's `x` into `out` (size * len(x) elements, rank order)."""
        sp, n, dt = _buffer(x, "allgather")
        rp, m, dt2 = _buffer(out, "allgather out")
        if m != n * self.size or dt2 != dt:
            raise ValueError(f"allgather: out must hold {n} x {self.size} elements of the same dtype")
        return self._allgather(sp, rp, n, dt, [x, out], async_op)

    def reduce_scatter(self, x: Buffer, out: Buffer, op: str = "sum", async_op: bool = False) -> Union[Buffer, "Work"]:
        """Reduces `x` (size * len(out) elements) and leaves part `rank` in `out`."""
        sp, n, dt = _buffer(x, "reduce_scatter")
        rp, m, dt2 = _buffer(out, "reduce_scatter out")
        if n != m * self.size or dt2 != dt:
            raise ValueError(f"reduce_scatter: x must hold {m} x {self.size} elements of out's dtype")
        return self._reduce_scatter(sp, rp, m, dt, _op(op), [x, out], async_op)

    def barrier(self) -> None:
        _check(load_library().gradwire_barrier(self._live()))

    def alltoall(
        self,
        x: Buffer,
        out: Buffer,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Union[Buffer, "Work"]:
        """Block p of `x` goes to rank p; block p of `out` receives rank p's block for us.
        Without counts every block is len(x) / size elements (the equal-block collective,
        through shared memory on one host: every rank must then call it without counts);
        with them (element counts per rank, both given) blocks lie back to back. async_op: returns a Work whose wait()
        returns `out`."""
        sp, n, dt = _buffer(x, "alltoall")
        rp, m, dt2 = _buffer(out, "alltoall out")
        if dt2 != dt:
            raise ValueError("alltoall: out must have x's dtype")
        sc, rc, count = _alltoall_counts(self.size, n, m, send_counts, recv_counts, "alltoall")
        lib = load_library()
        return self._call(lib.gradwire_alltoall, lib.gradwire_ialltoall, (sp, sc, rp, rc, count, dt), [x, sc, rc, out], async_op)

    def send(self, x: Buffer, peer: int, tag: int = 0) -> None:
        """Sends `x` to rank `peer`; matched by that rank's recv with the same tag, in order within the tag."""
        peer = _int_arg(peer, "send: peer", 0, self.size - 1, f"not a rank of this communicator (size {self.size})")
        tag = _int_arg(tag, "send: tag", 0, 2**32 - 1)
        p, n, dt = _buffer(x, "send")
        _check(load_library().gradwire_send(self._live(), p, n, dt, peer, tag))

    def recv(self, x: Buffer, peer: int, tag: int = 0) -> Buffer:
        """Receives the oldest message from rank `peer` with `tag` into `x` (same count and dtype)."""
        peer = _int_arg(peer, "recv: peer", 0, self.size - 1, f"not a rank of this communicator (size {self.size})")
        tag = _int_arg(tag, "recv: tag", 0, 2**32 - 1)
        p, n, dt = _buffer(x, "recv")
        _check(load_library().gradwire_recv(self._live(), p, n, dt, peer, tag))
        return x

    def p2p_batch(self, ops: Sequence[Tuple[str, Buffer, int, int]], async_op: bool = False) -> Optional["Work"]:
        """Runs sends and receives together as one operation: `ops` holds ("send" or
        "recv", buffer, peer, tag) tuples. A ring in which every rank sends before it
        receives completes (blocking send/recv would each wait for room at a peer that is
        itself sending). Messages are matched with the peers' as send/recv are. async_op:
        returns a Work at once (buffers kept until waited). A receive buffer must overlap no
        other buffer of the batch."""
        arr = (_P2pOp * max(len(ops), 1))()
        keep = []
        for i, op in enumerate(ops):
            if not isinstance(op, tuple) or len(op) != 4:
                raise TypeError(f"p2p_batch: ops[{i}] must be a (kind, buffer, peer, tag) tuple, got {op!r}")
            kind, x, peer, tag = op
            if kind not in ("send", "recv"):
                raise ValueError(f"p2p_batch: ops[{i}] kind must be 'send' or 'recv', got {kind!r}")
            peer = _int_arg(peer, f"p2p_batch: ops[{i}] peer", 0, self.size - 1, f"not a rank of this communicator (size {self.size})")
            tag = _int_arg(tag, f"p2p_batch: ops[{i}] tag", 0, 2**32 - 1)
            p, n, dt = _buffer(x, f"p2p_batch: ops[{i}]")
            arr[i] = _P2pOp(0 if kind == "send" else 1, peer, tag, dt, n, p)
            keep.append(x)
        if async_op:
            w = ctypes.c_void_p()
            _check(load_library().gradwire_ip2p_batch(self._live(), arr, len(ops), ctypes.byref(w)))
            return Work(w, keep)
        _check(load_library().gradwire_p2p_batch(self._live(), arr, len(ops)))
        return None

    def empty(self, count: int, dtype: str = "float32") -> Any:
        """A NumPy array of `count` elements (float32, float64 or float16) in memory from
        gradwire_alloc, which the ranks of a host map: an allreduce of at least 256 KiB (4 MiB where
        the kernel refuses cross-memory attach) on such arrays works in the peers' arrays in
        place, with no copies. Freed
        when the array and every view of it are gone; finalize() waits for that (the
        communicator is closed at once, its memory outlives it)."""
        import numpy as np  # noqa: PLC0415 (NumPy is needed only here)

        dt = np.dtype(dtype)
        _dtype(dt.name, "empty")
        # The byte count crosses as a size_t, so the bound is in bytes.
        most = _SIZE_MAX // dt.itemsize
        count = _int_arg(count, "empty: count", 0, most, f"out of range 0..{most} ({dt.name} elements whose bytes fit a size_t)")
        nbytes = max(count * dt.itemsize, 1)
        ptr = ctypes.c_void_p()
        _check(load_library().gradwire_alloc(self._live(), nbytes, ctypes.byref(ptr)))
        raw = (ctypes.c_char * nbytes).from_address(ptr.value)
        self._arrays += 1
        weakref.finalize(raw, self._release, ptr.value)
        return np.frombuffer(raw, dtype=dt, count=count)

    def register(self, x: Buffer) -> Buffer:
        """Registers `x` (a NumPy array or CPU tensor, at least a page) for many collectives, as
        ncclCommRegister does: its whole pages become memory the ranks of a host map (same
        address, same contents), so an allreduce of registered or empty() arrays works in
        the peers' arrays with no copies. `x` must be ordinary (heap) memory and stay alive
        until deregister(x); a process forked meanwhile shares its pages instead of copying
        them."""
        p, _, _ = _buffer(x, "register")
        _check(load_library().gradwire_register(self._live(), p, x.nbytes))
        return x

    def deregister(self, x: Buffer) -> None:
        """Gives `x`'s pages back as private memory, contents kept."""
        p, _, _ = _buffer(x, "deregister")
        _check(load_library().gradwire_deregister(self._live(), p))

    def _release(self, ptr):
        lib = load_library()
        lib.gradwire_free(self._h if self._h is not None else self._closing, ptr)
        self._arrays -= 1
        if self._closing is not None and self._arrays == 0:
            h, self._closing = self._closing, None
            lib.gradwire_finalize(h)

    def hierarchy(self) -> Hierarchy:
        """The node-local and cross-node groups of this communicator (collective; every
        node must hold the same number of ranks)."""
        return Hierarchy(self)

    def gpu(self, device: int) -> GpuComm:
        """Collectives on CUDA tensors of `device` over this communicator's ranks (collective:
        every rank calls it; each rank its own device, every node the same number of ranks)."""
        return GpuComm(self, device)

    def split(self, color: int, key: int = 0) -> Optional["Comm"]:
        """Sub-communicator of the ranks with the same color (None for a negative color)."""
        color = _int_arg(color, "split: color", *_INT, f"out of range for a C int ({_INT[0]}..{_INT[1]}; negative joins no group)")
        key = _int_arg(key, "split: key", *_INT, f"out of range for a C int ({_INT[0]}..{_INT[1]})")
        h = ctypes.c_void_p()
        _check(load_library().gradwire_comm_split(self._live(), color, key, ctypes.byref(h)))
        return Comm(h) if h.value else None

    def node_local(self) -> "Comm":
        """The ranks of this rank's node, ordered by rank (the rank in it is the local
        index). Collective."""
        return self._split_type(0)

    def cross_node(self) -> "Comm":
        """The ranks of every node with this rank's local index, one per node. Collective."""
        return self._split_type(1)

    def _split_type(self, kind):
        h = ctypes.c_void_p()
        _check(load_library().gradwire_comm_split_type(self._live(), kind, ctypes.byref(h)))
        return Comm(h)

    def finalize(self) -> None:
        if self._borrowed:
            self._h = None
            return
        if self._h is not None:
            h, self._h = self._h, None
            if self._arrays:
                self._closing = h  # finalized when the last array from empty() is gone
            else:
                _check(load_library().gradwire_finalize(h))

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()


def _beside_torch():
    """torch.distributed's store owns MASTER_PORT; unless told otherwise, gradwire's store
    takes the next port."""
    if "GRADWIRE_MASTER_PORT" in os.environ or "MASTER_PORT" not in os.environ:
        return
    try:
        import torch.distributed as dist  # noqa: PLC0415 (optional dependency)

        if dist.is_available() and dist.is_initialized():
            os.environ["GRADWIRE_MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    except ImportError:
        pass

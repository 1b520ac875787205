"""gradwire as a torch.distributed backend for CPU and CUDA tensors.

    import gradwire.torch  # registers the backend (an installed package also does so by entry point)
    torch.distributed.init_process_group("gradwire")

Everything torch builds on process groups then runs on gradwire: DDP, ZeroRedundancyOptimizer,
the DDP communication hooks, post-local SGD, object collectives, subgroups (`new_group`).

Each group is a gradwire communicator made from a unique id that the group's rank 0 creates
and hands to the members through torch's own store (as ProcessGroupNCCL does with NCCL's
id), so MASTER_PORT stays torch's and no job secret is needed. Deadlines are gradwire's
(`GRADWIRE_TIMEOUT_MS`, default 60 s): a dead or mismatched peer is a RuntimeError naming
the rank and the call, never a hang.

A call torch waits for at once (`async_op=False`, told by the options' `asyncOp`) runs as
gradwire's blocking call on the caller's thread: no handle, no hand-off. allreduce,
broadcast, all_gather_into_tensor and reduce_scatter_tensor made so on contiguous CPU
tensors go from torch's C++ entry point straight to gradwire's C call, without the GIL
(_torch_group.cpp, built against the torch in use at the first group: see _torch_native);
every other call, and every call where that cannot be built, runs the Python methods here.
`async_op=True` calls are gradwire's non-blocking calls. The ones torch's C++ makes itself
on such tensors (DDP's buckets and broadcasts) start in C++ too, and a C++ thread per group
completes them in order, without the GIL, so the buckets reduce while backward goes on.
Of the async calls made from Python, work that someone waits on is completed by that
caller, and work whose future is asked for by one completion thread per process, in order
(no thread per operation). A failed call fails its future with gradwire's error itself (not
as a value, which torch's C++ would read as the result): DDP raises it from backward.
Broadcast, all_gather_into_tensor, reduce_scatter_tensor (what FSDP-style sharding
overlaps) and all-to-all are non-blocking too; the list forms, gather, scatter and reduce
run when called and return completed work. isend, irecv and
batch_isend_irecv gather into one gradwire batch, started when one of them is waited for or
polled, or before the group's next other call: a ring of sends and receives completes, as
on NCCL. A receive from any source (`recv` without `src`) is refused: gradwire matches
every message to its sender.

CUDA tensors (`devices=["cpu", "cuda"]`): allreduce, broadcast, reduce, allgather,
reduce-scatter and all-to-all (list and tensor forms, all-to-all with uneven splits too),
scatter (a broadcast of the root's inputs) and barrier run on the group's GPU communicator
(made at the first CUDA call, on that tensor's device): NCCL inside a node, gradwire's
hierarchical path through pinned host memory across nodes, enqueued on torch's current
stream as ProcessGroupNCCL's calls are: later work on that stream sees the result, and an
async call's work waits as NCCL's does (`wait()` makes the caller's current stream wait
for the call, `is_completed()` asks the GPU, the future is CUDA-aware). Across nodes a
call returns only after its host step, so an async call there does not overlap the
calling thread's work. gather runs through allgather. Sends and receives refuse CUDA
tensors with a clear error.

Checked against torch 2.15, and on a GPU against torch 2.11 (whose older method names are aliases here). One private torch name, in one place: `_get_backend`, the
per-device backend lookup batch_isend_irecv makes, answered by the group itself.
`dist.ProcessGroup` and `dist.Work` are subclassed and `dist.Backend.register_backend`
registers.
"""

import ctypes
import inspect
import os
import threading
import time
import warnings
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import _OPS, Comm, InProgressError, Work, _background, _tensor, _torch_native, load_library, unique_id

__all__ = ["ProcessGroupGradwire", "register", "completed_future_of"]

def _meet(store, rank, size, timeout):
    """The unique id of the gradwire communicator this group's members form, handed from
    its rank 0 to the others through torch's store, for at most `timeout`.

    The store may hold keys of an earlier meeting whose ranks are gone: torchrun's agents
    keep one store across a job's restarts (with a c10d rendezvous, one per job), and a
    store is used again after destroy_process_group. Nothing in the environment tells
    attempts apart across nodes (an agent that restarts because another node failed keeps
    its TORCHELASTIC_RESTART_COUNT), so each meeting proves itself fresh: rank 0 posts a new
    nonce, and the meeting's keys live under it, where no earlier meeting wrote. Each member
    answers there with a nonce of its own, and rank 0 posts the id there beside every
    answer; a member takes the id only beside its own nonce, and answers again whenever
    rank 0's nonce changes. A key left by a dead rank is never read as this meeting's."""
    deadline = time.monotonic() + timeout.total_seconds()
    mine = os.urandom(16).hex()
    if rank == 0:
        store.set("gradwire/meet/leader", mine)
        keys = [f"gradwire/meet/{mine}/answer/{r}" for r in range(1, size)]
        if keys:
            try:
                store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:
                missing = [r for r, k in zip(range(1, size), keys) if not store.check([k])]
                if not missing:
                    raise
                raise RuntimeError(f"gradwire: forming a group timed out: rank(s) {missing} of {size} did not join the group") from None
        answers = [store.get(k).decode() for k in keys]
        uid = unique_id()
        store.set(f"gradwire/meet/{mine}/id", ",".join(answers).encode() + b":" + uid)
        return uid
    answered = rejected = None
    while True:
        leader = _store_get(store, "gradwire/meet/leader")
        if leader is not None and leader != answered:
            store.set(f"gradwire/meet/{leader}/answer/{rank}", mine)
            answered = leader
        if answered is not None and answered != rejected:
            key = f"gradwire/meet/{answered}/id"
            if store.check([key]):
                nonces, uid = store.get(key).split(b":", 1)
                nonces = nonces.decode().split(",")
                if len(nonces) == size - 1 and nonces[rank - 1] == mine:
                    return uid
                rejected = answered  # another meeting's id (a leader of an earlier one)
        _pause_until(deadline, lambda: "rank 0 of the group did not hand out its id")


def _store_get(store, key):
    """The value of `key` as text, or None where it is not set (without waiting)."""
    return store.get(key).decode() if store.check([key]) else None


def _pause_until(deadline, why):
    if time.monotonic() > deadline:
        raise RuntimeError(f"gradwire: forming a group timed out: {why()}")
    time.sleep(0.01)


# torch's reduce ops by their hash (their kind; equality then tells a PREMUL_SUM with the
# same hash apart): a call costs one lookup instead of a comparison per op.
_REDUCE_OPS = {
    hash(torch_op): (torch_op, name)
    for torch_op, name in (
        (dist.ReduceOp.SUM, "sum"),
        (dist.ReduceOp.AVG, "avg"),
        (dist.ReduceOp.MIN, "min"),
        (dist.ReduceOp.MAX, "max"),
        (dist.ReduceOp.PRODUCT, "product"),
        (dist.ReduceOp.BAND, "band"),
        (dist.ReduceOp.BOR, "bor"),
        (dist.ReduceOp.BXOR, "bxor"),
    )
}

# The bitwise ops, on integer and bool tensors: gathered from every rank and combined here
# (gradwire's kernels and NCCL have no bitwise reduction; these ops carry flags and masks,
# small tensors, where the W-fold traffic of a gather costs nothing that matters).
_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def _deadline_ms(timeout):
    """A group's timeout as gradwire's deadline (ms), or None for GRADWIRE_TIMEOUT_MS
    (default 60 s): where the group was given none, or torch's default (30 minutes, which
    would leave a stalled peer unreported for half an hour)."""
    if timeout is None or timeout == _TORCH_DEFAULT_TIMEOUT:
        return None
    # At most gradwire's longest deadline (a year's timeout means "never", 7 days is close).
    return min(max(1, int(timeout.total_seconds() * 1000)), 7 * 24 * 3600 * 1000)


try:
    from torch.distributed.constants import default_pg_timeout as _TORCH_DEFAULT_TIMEOUT
except ImportError:  # older torch
    _TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)


def _op_name(op):
    hit = _REDUCE_OPS.get(hash(op))
    if hit is None or not op == hit[0]:
        raise ValueError(f"gradwire: reduce op {getattr(op, 'op', op)} is not supported (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)")
    return hit[1]


def _op_of(opts):
    """gradwire's name of the call's reduce op (SUM without options)."""
    return _op_name(opts.reduceOp) if opts is not None else "sum"


def _plain(t):
    """Whether `t` is a contiguous CPU tensor: what gradwire takes as it is, on the shortest
    path (every microsecond counts against a 1 MiB call's 30)."""
    return t.is_cpu and t.is_contiguous()


_CUDA_CALLS = "allreduce, broadcast, reduce, all_gather(_into_tensor), gather, scatter, reduce_scatter(_tensor), all_to_all(_single), barrier"


def _cpu(t, what):
    if not t.is_cpu:
        raise ValueError(f"gradwire: {what}: tensor on {t.device}; gradwire takes CPU tensors here (on CUDA: {_CUDA_CALLS})")
    return t


def _on_cuda(tensors, what):
    """Whether a call's tensors are CUDA tensors (all on one device), or CPU ones."""
    kinds = {t.device for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"gradwire: {what}: tensors on several devices ({', '.join(sorted(map(str, kinds)))})")
    return bool(tensors) and tensors[0].is_cuda


def _dense(t, what):
    """(a contiguous tensor on t's device, a function that puts its result back in `t`)."""
    if t.is_contiguous():
        return t, lambda: None
    c = t.contiguous()
    return c, lambda: t.copy_(c)


def _contiguous(t, what):
    """(a contiguous tensor to hand gradwire, a function that puts its result back in `t`)."""
    _cpu(t, what)
    if t.is_contiguous():
        return t, lambda: None
    c = t.contiguous()
    return c, lambda: t.copy_(c)


def _pair(output_tensor, input_tensor, what):
    """(input, output, a function that puts the result back in `output_tensor` or None,
    whether on CUDA): a call's two tensors as gradwire takes them, contiguous CPU ones as
    they are."""
    if _plain(output_tensor) and _plain(input_tensor):
        return input_tensor, output_tensor, None, False
    cuda = _on_cuda([output_tensor, input_tensor], what)
    dense = _dense if cuda else _contiguous
    src, _ = dense(input_tensor, what)
    out, back = dense(output_tensor, what)
    return src, out, back, cuda


def _blocks_of(whole, part, size, what, name):
    """Checks that `whole` holds `size` blocks of `part`'s size and dtype (`name` says
    which tensor of the call is the whole one)."""
    if whole.numel() != part.numel() * size or whole.dtype != part.dtype:
        raise ValueError(f"gradwire: {what} {name} must hold {size} x {part.numel()} elements of {part.dtype}")


def _then(first, second):
    """A function that runs `first` (if any), then `second`."""
    if first is None:
        return second

    def both():
        first()
        second()

    return both


def _blocking(opts):
    """Whether torch will wait for this call at once (`async_op=False`): it then runs as
    gradwire's blocking call, on this thread, with no work handle to complete."""
    return opts is not None and not getattr(opts, "asyncOp", True)


def _new_future():
    """(a torch future, the hidden one behind it or None) that `_settle` can fail so that
    torch's C++ sees the failure.

    torch.futures.Future.set_exception completes a future with the exception as its value:
    Python's wait() raises it, but torch's C++ (DDP's reducer) reads it as the result, and
    DDP crashed on it. The C++ part fails the future itself (_torch_group.cpp, fail_future),
    and torch raises that exception as it is wherever it waits. Without the C++ part, the
    future handed out is the continuation of a hidden one whose callback raises the
    exception: a real failure too, which torch raises as a RuntimeError quoting it."""
    if _fail_future() is not None:
        return torch.futures.Future(), None
    hidden = torch.futures.Future()
    return hidden.then(_raise_failure), hidden


def _raise_failure(hidden):
    # A result is the call's tensors, never an exception: an exception is the failure.
    outcome = hidden.value()
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _fail_future():
    """The C++ part's fail_future, where it is built."""
    return getattr(_native_group_class, "_fail_future", None)


def _settle(future, hidden, result, error):
    """Completes a future made by _new_future with `result`, or fails it with `error`."""
    if hidden is not None:
        hidden.set_result(result if error is None else error)
    elif error is None:
        future.set_result(result)
    else:
        _fail_future()(future, error)


class _Work(dist.Work):
    """A collective's work: done at once (`pending` None) or when gradwire's non-blocking
    call finishes. `wait()` raises the failure as RuntimeError (GradwireError is one).
    Completed work costs no future and no lock until someone asks for them."""

    # Completed work sets only its result (class defaults for the rest: most calls wait).
    _pending = _finish = _future = _hidden = _error = _lock = None
    _done = True

    def __init__(self, result, pending=None, finish=None):
        super().__init__()
        self._result = result
        if pending is not None:
            self._pending, self._finish = pending, finish
            self._done = False
            self._lock = threading.Lock()

    def _complete(self, timeout_ms=-1):
        """Waits (up to `timeout_ms`, if not negative: past it the work stays pending and a
        RuntimeError says it timed out) and settles the work."""
        still = f"gradwire: Timed out after {timeout_ms} ms in Work.wait (the operation is still pending)"
        if not self._lock.acquire(timeout=timeout_ms / 1000 if timeout_ms >= 0 else -1):
            raise RuntimeError(still)  # another thread is waiting for it right now
        try:
            if self._done:
                return
            try:
                self._pending.wait(timeout_ms)
                if self._finish is not None:
                    self._finish()
            except InProgressError:
                raise RuntimeError(still) from None
            except BaseException as e:  # noqa: BLE001 (handed to whoever waits)
                self._error = e if isinstance(e, Exception) else RuntimeError(f"gradwire: interrupted: {e!r}")
            self._done = True
            self._pending = None
            future = self._future
        finally:
            self._lock.release()
        if future is not None:  # else get_future settles it, seeing _done under the lock
            self._settle()

    def _settle(self):
        _settle(self._future, self._hidden, self._result, self._error)

    def wait(self, timeout=timedelta(0)):
        # timedelta(0), torch's default, waits until done (within the group's deadline).
        if not self._done:
            ms = int(timeout.total_seconds() * 1000) if timeout else 0
            self._complete(max(ms, 1) if timeout and timeout.total_seconds() > 0 else -1)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        # Polled without blocking: a waiter holding the lock has it in hand.
        if not self._done and self._lock.acquire(blocking=False):
            try:
                ready = self._pending is not None and self._pending.test()
            except Exception:  # noqa: BLE001 (its wait raises it)
                ready = True
            finally:
                self._lock.release()
            if ready:
                self._complete()
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def get_future(self):
        # Someone will wait on the future rather than on the work (DDP does): from now on the
        # completion thread completes it. A caller that waits on the work itself completes
        # it on its own thread, with no hand-over between threads.
        if self._lock is None:  # completed when made
            if self._future is None:
                self._future, self._hidden = _new_future()
                self._settle()
            return self._future
        with self._lock:
            first = self._future is None
            if first:
                self._future, self._hidden = _new_future()
            done = self._done
        if first and done:
            self._settle()
        elif first and _background.is_current():
            # Asked from a callback of another work's future (PowerSGD waits inside one):
            # queued behind the running callback it would never complete.
            self._complete()
        elif first:
            _background.run(self._complete)
        return self._future


class _CudaWork(dist.Work):
    """An async call's work on CUDA tensors, queued on `device`'s current stream: as
    ProcessGroupNCCL's, `wait()` makes the caller's current stream wait for it (the host
    does not), `is_completed()` asks the GPU, and the future completes on the stream."""

    def __init__(self, result, device):
        super().__init__()
        self._result, self._device = result, device
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def wait(self, timeout=timedelta(0)):
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self):
        return self._event.query()

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self):
        future = torch.futures.Future(devices=[self._device])
        with torch.cuda.device(self._device):
            torch.cuda.current_stream(self._device).wait_event(self._event)
            future.set_result(self._result)
        return future


def _cuda_work(result, opts, device):
    """The work of a call queued on CUDA tensors: nothing left to do for a blocking call
    (torch waits on the same stream), a _CudaWork for an async one."""
    return _Work(result) if _blocking(opts) else _CudaWork(result, device)


class _P2PBatch:
    """Sends and receives torch has issued (isend, irecv, batch_isend_irecv) and nobody has
    waited for: started as one gradwire batch when one of them is waited for or polled, or
    before the group's next other call (so the engine runs them in program order). A ring
    in which every rank sends before it receives then completes, as it does on NCCL; a
    send nobody waits for or follows with another call does not start."""

    def __init__(self, comm, on_start=None):
        self._comm = comm
        self._on_start = on_start  # called (with this batch) once it has started
        self._ops = []
        self._backs = []
        self._lock = threading.Lock()
        self._work = None
        self._started = False
        self._done = False
        self._error = None

    @property
    def started(self):
        return self._started

    def add(self, ops):
        """Adds (kind, tensor, peer, tag, back) ops; False (nothing added) once started,
        since another thread (a poll, the completion thread) may start it at any time."""
        with self._lock:
            if self._started:
                return False
            for kind, tensor, peer, tag, back in ops:
                self._ops.append((kind, tensor, peer, tag))
                self._backs.append(back)
            return True

    def start(self):
        with self._lock:
            if self._started:
                return
            self._started = True
            try:
                self._work = self._comm.p2p_batch(self._ops, async_op=True)
            except Exception as e:  # noqa: BLE001 (raised to whoever waits)
                self._error, self._done = e, True
        if self._on_start is not None:
            self._on_start(self)

    def _finish(self, timeout_ms=-1):
        # Under the lock. Past `timeout_ms` (if not negative) the batch stays pending and
        # the InProgressError goes to the caller.
        try:
            self._work.wait(timeout_ms)
            for back in self._backs:
                back()
        except InProgressError:
            raise
        except Exception as e:  # noqa: BLE001 (raised to whoever waits)
            self._error = e
        self._done, self._work = True, None

    def wait(self, timeout_ms=-1):
        self.start()
        with self._lock:
            if not self._done:
                self._finish(timeout_ms)
        if self._error is not None:
            raise self._error

    def test(self):
        self.start()
        if not self._lock.acquire(blocking=False):
            return False  # someone is waiting for it right now
        try:
            if not self._done and self._work.test():
                self._finish()
            return self._done
        finally:
            self._lock.release()


def _done_or_pending(result, pending, finish=None):
    """The work of a call made blocking (`pending` is the call's result, not a Work: finish
    now, if there is anything to finish) or non-blocking."""
    if isinstance(pending, Work):
        return _Work(result, pending, finish)
    if finish is not None:
        finish()
    return _Work(result)


def completed_future_of(comm: Comm, tensor: torch.Tensor, op: str = "sum") -> torch.futures.Future:
    """Starts gradwire's non-blocking in-place allreduce of a contiguous CPU `tensor` and
    returns a torch Future that completes with it (what a DDP communication hook returns)."""
    pending = comm.iallreduce(_cpu(tensor, "allreduce"), op=op)
    return _Work(tensor, pending).get_future()


class ProcessGroupGradwire(dist.ProcessGroup):
    """A torch process group over one gradwire communicator (see the module text)."""

    # Asked of a group's backend by batch_isend_irecv: no NCCL-style coalescing manager
    # (the sends and receives gather into a batch here; see _P2PBatch).
    supports_coalescing = False
    # Asked by split_group (which then calls splitGroup below) and by
    # init_process_group(device_id=...).
    supports_splitting = True

    # Whether this class runs over the C++ group (_native_class).
    _native = False

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """What torch's `dist.split_group` asks of the parent group (its Python binding's
        name, found here before torch's C++ one, whose call back into Python cannot pass the
        timeout): every rank of this group calls it, each with the parent ranks of its own
        new group in their new order (a rank in none passes another's). The members meet in
        this group's store under the new group's name and form a new gradwire group; others
        get None."""
        del opts, device_types  # gradwire's groups take no options and serve CPU and CUDA
        ranks = [int(r) for r in ranks]
        if self.rank() not in ranks:
            return None
        store = dist.PrefixStore(f"gradwire/split/{group_name}/", self._store)
        group = _create(store, ranks.index(self.rank()), len(ranks), timeout)
        if group_name is not None:
            group._set_group_name(group_name)
        if group_desc is not None:
            group._set_group_desc(group_desc)
        return group

    def eager_connect_single_device(self, device):
        """init_process_group(device_id=...) asks a splitting group to connect now: a
        gradwire group is connected when made."""
        del device

    def perform_nocolor_split(self, device):
        """torch's new_group asks this of a splitting parent on ranks outside the new group
        (NCCL's split needs them); gradwire's new groups meet among their members alone."""
        del device

    def _get_backend(self, device):
        # torch's private per-device backend lookup (batch_isend_irecv asks it; checked on
        # torch 2.15). This group is its own CPU backend: its methods have the backend
        # signatures. A ProcessGroup subclass, not a Backend, because torch wraps a
        # Backend's work in its own, whose is_completed() never turns true.
        if torch.device(device).type not in ("cpu", "cuda"):
            raise RuntimeError(f"gradwire: no backend for device {device}; the gradwire backend takes CPU and CUDA tensors")
        return self

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Optional[timedelta] = None) -> None:
        super().__init__(rank, size)
        # Every rank is here (past the C++ part's first build, which may take a minute on
        # one node and none on another) before any joins the communicator, whose connect
        # deadline is gradwire's; this wait is the group's timeout, at least a minute: on a
        # loaded machine ranks start seconds apart, and a short group timeout is meant for
        # the operations (gradwire's deadline below).
        uid = _meet(store, rank, size, max(timeout or timedelta(minutes=30), timedelta(minutes=1)))
        self._store, self._monitored_calls = store, 0
        self._comm = Comm.from_unique_id(bytes(uid), size, rank, timeout_ms=_deadline_ms(timeout))
        if self._native:
            lib = load_library()
            calls = {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _NATIVE_CALLS}
            self._attach(self._comm._h.value, calls)
        self._batch = None  # sends and receives not started yet (see _P2PBatch)
        self._p2p_lock = threading.Lock()  # the open batch, and the C++ group's flag for it
        self._gpus = {}  # device index -> GpuComm, made at the first call on that device
        self._gpus_lock = threading.Lock()

    def _gpu(self, t):
        """The GPU communicator of t's device, made (collectively) at its first call."""
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        gpu = self._gpus.get(index)
        if gpu is None:
            with self._gpus_lock:  # made once, though two threads' first calls race
                gpu = self._gpus.get(index)
                if gpu is None:
                    gpu = self._gpus[index] = self._comm.gpu(index)
        return gpu

    def getBackendName(self):  # noqa: N802 (torch's name)
        return "gradwire"

    @property
    def comm(self):
        """The gradwire communicator under this group."""
        return self._comm

    def _each_on_gpu(self, tensors, opts, what, call):
        """`call(gpu, t)` for each CUDA tensor (a contiguous copy where it is not), on the
        GPU communicator of its device; the work of the whole call."""
        for t in tensors:
            c, back = _dense(t, what)
            call(self._gpu(c), c)
            back()
        return _cuda_work(tensors, opts, tensors[0].device)

    # --- collectives -------------------------------------------------------------------

    def _bitwise(self, tensors, op, what, root=None, opts=None):
        """A bitwise reduction of each tensor over the ranks (into every rank's, or only
        `root`'s): every rank's tensor gathered, then combined in rank order."""
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                raise ValueError(f"gradwire: {what}: bitwise {op.upper()} needs integer or bool tensors, got {t.dtype}")
        cuda = _on_cuda(tensors, what)
        for t in tensors:
            c, back = _dense(t, what)
            every = torch.empty((self.size(), *c.shape), dtype=c.dtype, device=c.device)
            if cuda:
                self._gpu(c).allgather(c, every)
            else:
                self._comm.allgather(c, every)
            if root is None or root == self.rank():
                acc = every[0].clone()
                for other in every[1:]:
                    _BITWISE[op](acc, other, out=acc)
                c.copy_(acc)
                back()
        return _cuda_work(tensors, opts, tensors[0].device) if cuda else _Work(tensors)

    def _py_allreduce(self, tensors, opts=None):
        self._start_p2p()
        op = _op_of(opts)
        if op in _BITWISE:
            return self._bitwise(tensors, op, "allreduce", opts=opts)
        if len(tensors) == 1 and _plain(tensors[0]):
            t = tensors[0]
            p, n, dt = _tensor(t, "allreduce")
            return _done_or_pending(tensors, self._comm._allreduce(p, p, n, dt, _OPS[op], [t], not _blocking(opts)))
        if _on_cuda(tensors, "allreduce"):
            return self._each_on_gpu(tensors, opts, "allreduce", lambda gpu, t: gpu.allreduce(t, op=op))
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        self._start_p2p()
        op = _op_of(opts)
        if op in _BITWISE:
            return self._bitwise(tensors, op, "allreduce_coalesced", opts=opts)
        cuda = _on_cuda(tensors, "allreduce_coalesced")
        for t in tensors:
            if not cuda:
                _cpu(t, "allreduce")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("gradwire: allreduce_coalesced needs tensors of one dtype")
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)

        def scatter_back():
            at = 0
            for t in tensors:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()

        if cuda:
            self._gpu(flat).allreduce(flat, op=op)
            scatter_back()
            return _cuda_work(tensors, opts, flat.device)
        if _blocking(opts):
            self._comm.allreduce(flat, op=op)
            scatter_back()
            return _Work(tensors)
        return _Work(tensors, self._comm.iallreduce(flat, op=op), scatter_back)

    def _py_broadcast(self, tensors, opts=None):
        self._start_p2p()
        root = opts.rootRank if opts is not None else 0
        if _on_cuda(tensors, "broadcast"):
            return self._each_on_gpu(tensors, opts, "broadcast", lambda gpu, t: gpu.broadcast(t, root=root))
        if len(tensors) == 1:
            c, back = _contiguous(tensors[0], "broadcast")
            if _blocking(opts):
                self._comm.broadcast(c, root=root)
                back()
                return _Work(tensors)
            return _Work(tensors, self._comm.broadcast(c, root=root, async_op=True), back)
        for t in tensors:
            c, back = _contiguous(t, "broadcast")
            self._comm.broadcast(c, root=root)
            back()
        return _Work(tensors)

    def reduce(self, tensors, opts=None):
        self._start_p2p()
        op = _op_of(opts)
        root = opts.rootRank if opts is not None else 0
        if op in _BITWISE:
            return self._bitwise(tensors, op, "reduce", root, opts)
        if _on_cuda(tensors, "reduce"):
            return self._each_on_gpu(tensors, opts, "reduce", lambda gpu, t: gpu.reduce(t, root=root, op=op))
        for t in tensors:
            c, back = _contiguous(t, "reduce")
            self._comm.reduce(c, root=root, op=op)
            back()
        return _Work(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._start_p2p()
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.size():
                raise ValueError(f"gradwire: allgather needs {self.size()} output tensors, got {len(outs)}")
            if any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
                raise ValueError("gradwire: allgather outputs must match the input in size and dtype")
            if _on_cuda([inp, *outs], "allgather"):
                src, _ = _dense(inp, "allgather")
                flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device=inp.device)
                self._gpu(src).allgather(src, flat)
            else:
                src, _ = _contiguous(inp, "allgather")
                flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype)
                self._comm.allgather(src, flat)
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel() : (r + 1) * inp.numel()].view_as(o))
        if input_tensors and input_tensors[0].is_cuda:
            return _cuda_work(output_tensors, opts, input_tensors[0].device)
        return _Work(output_tensors)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """all_gather_coalesced: output_lists[r][i] receives rank r's input i."""
        if len(output_lists) != self.size() or any(len(outs) != len(input_tensors) for outs in output_lists):
            raise ValueError(f"gradwire: allgather_coalesced needs {self.size()} output lists of {len(input_tensors)} tensors")
        per_input = [[output_lists[r][i] for r in range(self.size())] for i in range(len(input_tensors))]
        self.allgather(per_input, input_tensors, opts).wait()
        return _cuda_work(output_lists, opts, input_tensors[0].device) if input_tensors and input_tensors[0].is_cuda else _Work(output_lists)

    def _each_pair(self, single, outputs, inputs, opts, what):
        """`single(out, inp, opts)` per pair, in order: the tensor-coalesced forms (DTensor
        and FSDP call them) as one call per tensor."""
        if len(outputs) != len(inputs):
            raise ValueError(f"gradwire: {what}: {len(outputs)} outputs for {len(inputs)} inputs")
        for out, inp in zip(outputs, inputs):
            single(out, inp, opts).wait()
        return _cuda_work(outputs, opts, outputs[0].device) if outputs and outputs[0].is_cuda else _Work(outputs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._each_pair(self._py_all_gather_single, outputs, inputs, opts, "allgather_into_tensor_coalesced")

    def _py_all_gather_single(self, output_tensor, input_tensor, opts=None):
        # Every microsecond here counts against a 1 MiB call's 30 (no reshape: gradwire
        # takes any contiguous tensor as its elements in order).
        self._start_p2p()
        what = "all_gather_into_tensor"
        src, out, back, cuda = _pair(output_tensor, input_tensor, what)
        _blocks_of(out, src, self._comm.size, what, "output")
        # FSDP gathers in place (the input is the output's own part). Any other overlap
        # goes in as a copy, on every rank alike.
        if self._comm._overlapping("allgather", src.data_ptr(), src.nbytes, out.data_ptr(), out.nbytes):
            src = src.clone()
        if cuda:
            self._gpu(out).allgather(src, out)
            back()
            return _cuda_work([output_tensor], opts, out.device)
        sp, n, dt = _tensor(src, what)
        pending = self._comm._allgather(sp, out.data_ptr(), n, dt, [src, out], not _blocking(opts))
        return _done_or_pending([output_tensor], pending, back)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._start_p2p()
        op = _op_of(opts)
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size():
                raise ValueError(f"gradwire: reduce_scatter needs {self.size()} input tensors, got {len(ins)}")
            if op in _BITWISE:
                parts = [i.clone() for i in ins]
                self._bitwise(parts, op, "reduce_scatter")
                mine = parts[self.rank()]
                out.copy_(mine.view_as(out))
                continue
            if _on_cuda([out, *ins], "reduce_scatter"):
                flat = torch.cat([i.reshape(-1) for i in ins])
                dst, back = _dense(out, "reduce_scatter")
                self._gpu(dst).reduce_scatter(flat, dst, op=op)
            else:
                flat = torch.cat([_cpu(i, "reduce_scatter").reshape(-1) for i in ins])
                dst, back = _contiguous(out, "reduce_scatter")
                self._comm.reduce_scatter(flat, dst.reshape(-1), op=op)
            back()
        if output_tensors and output_tensors[0].is_cuda:
            return _cuda_work(output_tensors, opts, output_tensors[0].device)
        return _Work(output_tensors)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._each_pair(self._py_reduce_scatter_single, outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    def _py_reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        self._start_p2p()
        op = _op_of(opts)
        what = "reduce_scatter_tensor"
        src, out, back, cuda = _pair(output_tensor, input_tensor, what)
        _blocks_of(src, out, self._comm.size, what, "input")
        if op in _BITWISE:
            # The whole input reduced (a copy), then this rank's block of it.
            whole = src.clone()
            self._bitwise([whole], op, what)
            n = out.numel()
            out.copy_(whole.reshape(-1)[self.rank() * n : (self.rank() + 1) * n].view_as(out))
            if back is not None:
                back()
            return _cuda_work([output_tensor], opts, output_tensor.device) if cuda else _Work([output_tensor])
        # In place: the output is the input's own part. Any other overlap lands in a
        # separate tensor, copied back at the end.
        if self._comm._overlapping("reduce_scatter", src.data_ptr(), src.nbytes, out.data_ptr(), out.nbytes):
            target, out = out, torch.empty_like(out)
            back = _then(back, lambda: target.copy_(out))
        if cuda:
            self._gpu(out).reduce_scatter(src, out, op=op)
            back()
            return _cuda_work([output_tensor], opts, out.device)
        sp, _, dt = _tensor(src, what)
        pending = self._comm._reduce_scatter(sp, out.data_ptr(), out.numel(), dt, _OPS[op], [src, out], not _blocking(opts))
        return _done_or_pending([output_tensor], pending, back)

    def gather(self, output_tensors, input_tensors, opts=None):
        self._start_p2p()
        outs = output_tensors[0] if output_tensors else []
        if self.rank() != (opts.rootRank if opts is not None else 0):
            outs = [torch.empty_like(input_tensors[0]) for _ in range(self.size())]
        self.allgather([outs], input_tensors)
        return _Work(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._start_p2p()
        out = output_tensors[0]
        root = opts.rootRank if opts is not None else 0
        # The root's inputs broadcast whole, each rank keeping its part (the bytes of a
        # broadcast, which gradwire runs near the link's rate).
        cuda = _on_cuda([out, *(input_tensors[0] if self.rank() == root else [])], "scatter")
        if self.rank() == root:
            flat = torch.cat([(t if cuda else _cpu(t, "scatter")).reshape(-1) for t in input_tensors[0]])
        else:
            flat = torch.empty(out.numel() * self.size(), dtype=out.dtype, device=out.device)
        if cuda:
            self._gpu(flat).broadcast(flat, root=root)
        else:
            self._comm.broadcast(flat, root=root)
        out.copy_(flat[self.rank() * out.numel() : (self.rank() + 1) * out.numel()].view_as(out))
        if cuda:
            return _cuda_work(output_tensors, opts, out.device)
        return _Work(output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._start_p2p()
        what = "all_to_all_single"
        cuda = _on_cuda([output, input], what)
        dense = _dense if cuda else _contiguous
        src, _ = dense(input, what)
        dst, back = dense(output, what)

        # Splits count rows of dim 0: elements per row times the split.
        def counts(t, splits):
            row = t[0].numel() if t.dim() > 0 and t.shape[0] else 0
            splits = list(splits) if splits else [t.shape[0] // self.size()] * self.size()
            return [s * row for s in splits]

        split = bool(output_split_sizes or input_split_sizes)
        sc, rc = (counts(src, input_split_sizes), counts(dst, output_split_sizes)) if split else (None, None)
        if cuda:  # any contiguous tensor, as its elements in order: no reshape to pay for
            self._gpu(dst).alltoall(src, dst, sc, rc)
            back()
            return _cuda_work([output], opts, dst.device)
        pending = self._comm.alltoall(src.reshape(-1), dst.reshape(-1), sc, rc, async_op=not _blocking(opts))
        return _done_or_pending([output], pending, back)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._start_p2p()
        what = "all_to_all"
        cuda = _on_cuda([*output_tensors, *input_tensors], what)
        ins = input_tensors if cuda else [_cpu(t, what) for t in input_tensors]
        if len(ins) != self.size() or len(output_tensors) != self.size():
            raise ValueError(f"gradwire: all_to_all needs {self.size()} input and output tensors")
        flat_in = torch.cat([t.reshape(-1) for t in ins])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype, device=flat_in.device)

        def scatter_back():
            at = 0
            for t in output_tensors:
                t.copy_(flat_out[at : at + t.numel()].view_as(t))
                at += t.numel()

        sc, rc = [t.numel() for t in ins], [t.numel() for t in output_tensors]
        if cuda:
            self._gpu(flat_in).alltoall(flat_in, flat_out, sc, rc)
            scatter_back()
            return _cuda_work(output_tensors, opts, flat_in.device)
        pending = self._comm.alltoall(flat_in, flat_out, sc, rc, async_op=not _blocking(opts))
        return _done_or_pending(output_tensors, pending, scatter_back)

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("gradwire: recv from any source is not supported (every message is matched to its sender): pass src")

    def _queue_p2p(self, ops):
        """Adds ops to the open batch (a new one if it has started) and returns it."""
        with self._p2p_lock:
            if self._native:  # before the ops go in: no collective may pass them
                self._set_p2p_pending(True)
            while True:
                if self._batch is None or self._batch.started:
                    self._batch = _P2PBatch(self._comm, self._p2p_started if self._native else None)
                batch = self._batch
                if batch.add(ops):
                    return batch

    def _p2p_started(self, batch):
        """A batch has started (whoever started it): once the group's open batch has, the
        C++ group's blocking calls may take their fast path again."""
        with self._p2p_lock:
            if self._batch is batch:
                self._set_p2p_pending(False)

    def _start_p2p(self):
        """Starts the sends and receives issued so far, ahead of the call being made."""
        if self._batch is not None and not self._batch.started:
            self._batch.start()

    def send(self, tensors, dst, tag):
        ops = [("send", _contiguous(t, "send")[0], dst, tag, lambda: None) for t in tensors]
        return _Work(tensors, self._queue_p2p(ops))

    def recv(self, tensors, src, tag):
        ops = []
        for t in tensors:
            c, back = _contiguous(t, "recv")
            ops.append(("recv", c, src, tag, back))
        return _Work(tensors, self._queue_p2p(ops))

    def barrier(self, opts=None):
        self._start_p2p()
        # As ProcessGroupNCCL's: the work queued on this group's GPUs is done first.
        for index in self._gpus:
            torch.cuda.synchronize(index)
        self._comm.barrier()
        return _Work([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitored barrier, through the group's store (where each rank's arrival
        is seen on its own, whatever the others do): every rank checks in, rank 0 waits at
        most `timeout` in all and names the ranks that did not come (the first, or all with
        `wait_all_ranks`), as gloo words it; then it releases the others, which wait as long
        for that."""
        self._start_p2p()
        limit = timeout if timeout is not None else timedelta(minutes=30)
        deadline = time.monotonic() + limit.total_seconds()
        call, me = self._monitored_calls, self.rank()
        self._monitored_calls += 1
        key = f"gradwire/monitored_barrier/{call}/"
        self._store.set(f"{key}{me}", "1")
        if me != 0:
            # gloo's words where rank 0 failed or never answered.
            failed = f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0"
            try:
                self._store.wait([f"{key}release"], limit)
            except RuntimeError as e:
                raise RuntimeError(f"[Rank {me}]: {failed} (no answer within {limit.total_seconds() * 1000:.0f} ms)") from e
            if self._store.get(f"{key}release") != b"1":
                raise RuntimeError(f"[Rank {me}]: {failed} (rank 0 found ranks missing)")
            return _Work([])
        missing = []
        for r in range(1, self.size()):
            left = deadline - time.monotonic()
            if left <= 0 and not wait_all_ranks:
                # As gloo: rank 0's own time ran out before it could wait for rank r (with
                # wait_all_ranks it goes on to name every rank that did not come).
                self._store.set(f"{key}release", "failed")
                raise RuntimeError(f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {limit.total_seconds() * 1000:.0f} ms")
            if left > 0:
                try:
                    self._store.wait([f"{key}{r}"], timedelta(seconds=left))
                    continue
                except RuntimeError:
                    pass
            if not self._store.check([f"{key}{r}"]):
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            who = f"Rank {missing[0]}" if len(missing) == 1 else "Ranks " + ", ".join(map(str, missing))
            self._store.set(f"{key}release", "failed")
            raise RuntimeError(f"[Rank 0]: {who} failed to pass monitoredBarrier in {limit.total_seconds() * 1000:.0f} ms")
        self._store.set(f"{key}release", "1")
        return _Work([])

    # The calls the C++ group (_torch_group.cpp) takes on its fast path when there is one
    # (see _native_class), and hands these methods when it does not.
    allreduce = _py_allreduce
    broadcast = _py_broadcast
    all_gather_single = _py_all_gather_single
    reduce_scatter_single = _py_reduce_scatter_single

    # The names torch before 2.12 calls these by (checked on torch 2.11): the same calls.
    _allgather_base = _py_all_gather_single
    _reduce_scatter_base = _py_reduce_scatter_single
    alltoall_base = all_to_all_single

    def shutdown(self):
        if self._native:
            self._detach()
        for gpu in self._gpus.values():
            gpu.free()
        self._comm.finalize()


# The C calls the C++ group makes itself (it has the addresses of the library loaded here).
_NATIVE_CALLS = (
    "gradwire_buffer_layout",
    "gradwire_allreduce",
    "gradwire_broadcast",
    "gradwire_allgather",
    "gradwire_reduce_scatter",
    "gradwire_iallreduce",
    "gradwire_ibroadcast",
    "gradwire_iallgather",
    "gradwire_ireduce_scatter",
    "gradwire_wait",
)

# The calls the C++ group overrides, by torch's name for them, and the Python method that
# makes each otherwise (torch before 2.12 names the tensor forms _allgather_base and
# _reduce_scatter_base).
_NATIVE_ENTRIES = {
    "allreduce": "_py_allreduce",
    "broadcast": "_py_broadcast",
    "all_gather_single": "_py_all_gather_single",
    "reduce_scatter_single": "_py_reduce_scatter_single",
    "_allgather_base": "_py_all_gather_single",
    "_reduce_scatter_base": "_py_reduce_scatter_single",
}


def _gate(name, entry, python_name):
    """The method `name` of the group over the C++ one: a blocking call on CPU tensors goes to
    torch's entry point (`entry`, which calls the C++ method without the GIL), every other
    call to the Python method at once. Async and CUDA calls so return the Python group's own
    work object, with all its methods (is_completed, exception, ...), at no extra cost; torch's
    wrapper of a Python work that the C++ side would return forwards only wait and
    get_future. The C++ method checks the rest (contiguity, dtype, op) itself."""
    if name in ("allreduce", "broadcast"):

        def call(self, tensors, opts=None):
            # Integer and bool tensors take the Python method (bitwise ops live there).
            if opts is not None and not opts.asyncOp and type(tensors) is list and len(tensors) == 1 and tensors[0].is_cpu and tensors[0].is_floating_point():
                return entry(self, tensors, opts)
            return getattr(self, python_name)(tensors, opts)

    else:

        def call(self, output, input, opts=None):
            # Integer and bool tensors take the Python method (bitwise ops live there).
            if opts is not None and not opts.asyncOp and output.is_cpu and input.is_cpu and input.is_floating_point():
                return entry(self, output, input, opts)
            return getattr(self, python_name)(output, input, opts)

    call.__name__ = call.__qualname__ = name
    return call


_native_group_class = None  # the group class over the C++ one, made at the first group


def _native_class():
    """ProcessGroupGradwire over the C++ hot path (_torch_group.cpp, built at the first
    group: see _torch_native), or ProcessGroupGradwire itself where that is not built."""
    global _native_group_class
    if _native_group_class is None:
        fast, _ = _torch_native.fast_group()
        _native_group_class = ProcessGroupGradwire
        if fast is not None:
            try:
                if not hasattr(dist.AllreduceOptions(), "asyncOp"):
                    raise RuntimeError(f"torch {torch.__version__} does not say which calls are blocking (no asyncOp)")
                # torch's entry points as its class holds them (binding descriptors).
                entries = {
                    name: _gate(name, inspect.getattr_static(dist.ProcessGroup, name), python_name)
                    for name, python_name in _NATIVE_ENTRIES.items()
                    if hasattr(dist.ProcessGroup, name)
                }
                # The C++ class's metaclass is pybind11's; torch's ProcessGroup has its own
                # from torch 2.12 (before, pybind11's too, which cannot be a base twice).
                metas = tuple(dict.fromkeys((type(fast), type(ProcessGroupGradwire))))
                meta = metas[0] if len(metas) == 1 else type("_NativeMeta", metas, {})
                _native_group_class = meta("ProcessGroupGradwire", (ProcessGroupGradwire, fast), {**entries, "_native": True, "__module__": __name__})
            except Exception as e:  # noqa: BLE001 (this torch is not the one checked: the Python group)
                _torch_native.warn(f"{type(e).__name__}: {e}")
    return _native_group_class


class _RegistryEntry(torch._C._distributed_c10d.Backend):
    """What torch's group registry holds for a gradwire group on each of its devices, where
    the C++ part is not built (else its RegistryEntry, the same in C++). torch names a group
    through its registered backends and reads its devices from them (`group_name`,
    `destroy_process_group(group)`, `init_device_mesh`, FSDP2): without one, "ProcessGroup
    name not set". The group itself overrides every collective it offers, so calls reach
    it, not this entry; one torch sends to the entry directly (monitored barrier, the
    coalesced forms) is refused by torch, naming gradwire."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group.rank(), group.size())

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "gradwire"


def _registry_entry(group: dist.ProcessGroup):
    """The group's registry entry: the C++ part's where it is built (every torch it builds
    for), else the Python one, which needs a torch whose Backend binding has a constructor
    (not 2.11's); None, with a warning saying what is lost, where neither can be had."""
    fast, _ = _torch_native.fast_group()
    if fast is not None:
        return fast._registry_entry(group.rank(), group.size())
    try:
        return _RegistryEntry(group)
    except TypeError as e:  # torch's Backend has no Python constructor here
        warnings.warn(
            f"gradwire: torch {torch.__version__} cannot register a Python group ({e}) and the backend's C++ part is not built: "
            "the group has no name, so DeviceMesh and FSDP2 refuse it; every collective works",
            stacklevel=3,
        )
        return None


def _create(store, rank, size, timeout):
    group = _native_class()(store, rank, size, timeout)
    entry = _registry_entry(group)
    if entry is not None:
        group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        for device in ("cpu", "cuda"):
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, entry)
    return group


def register() -> None:
    """Registers the "gradwire" backend for CPU and CUDA tensors (idempotent)."""
    if "gradwire" in getattr(dist.Backend, "backend_list", []):
        return
    dist.Backend.register_backend("gradwire", _create, devices=["cpu", "cuda"])


register()

# The schemes as optimizers, beside the backend they may run on.
from gradwire.optim import BSP, DASO, ParameterServer, PoolSampler  # noqa: E402,F401

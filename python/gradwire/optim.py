"""The three papers' training schemes around a PyTorch model, each used as `opt.step()`
after `loss.backward()` (re-exported by `gradwire.torch`):

- `DASO(local_optimizer, total_epochs, ...)`: hierarchical, asynchronous global sync with
  Heat's protocol (`step()`, `zero_grad()`, `last_batch`, `epoch_loss_logic(loss)`), so a
  script written for Heat's DASO runs with its import changed (see `gradwire.heat`);
- `BSP(local_optimizer, interval=K, topk=None)`: K local steps, then one allreduce of the
  change (top-k with error feedback);
- `ParameterServer(model, scheme="ddcgu"|"cyclic"|"downpour"|"eamsgd", ...)` with
  `PoolSampler`, the shared minibatch pool the asynchronous schemes draw from.

The model's parameters and gradients move into one gradwire buffer each (memory shared
with the host's ranks): every parameter's `.data` and `.grad` become views into them, so a
step hands the scheme one flat vector without copying. The communicator is `comm` if
given, else the default process group's when it is "gradwire", else one made from the
launcher's environment (`gradwire launch`, torchrun). Parameters must be float32 tensors
on the CPU or on one CUDA device per rank. The schemes' schedules and bookkeeping run in
libgradwire (docs/algorithms.md). For a CUDA model, DASO and dense BSP keep the data on the
device by default (`device_resident`): libgradwire records each data step and the Python
side runs it on NCCL, staging only what crosses nodes through pinned host memory. The
parameter servers and top-k BSP run on host mirrors: the gradients and parameters cross to
the host and back once per step.

Buffers (BatchNorm's running statistics) are not parameters: given the model (`model=`,
DASO's `set_model` or Heat's `DataParallelMultiGPU`, a ParameterServer made from a module),
a scheme makes them rank 0's at construction, averages the floating ones over the ranks
where it agrees the parameters globally (DASO: every synchronous batch and each epoch's
last; BSP: every K-th step; every scheme: `end_epoch` and `finish()`, which also hand on
rank 0's integer counts), and leaves them identical on every rank after `finish()`.
Between those points each rank's buffers follow its own data, as its parameters do.
Without the model a scheme cannot see the buffers: each rank keeps its own.
"""

import contextlib
import numbers
import re
import warnings
from typing import Any, Callable, Iterable, Iterator, List, Optional, Union

import torch

from gradwire import Comm, Strategy
from gradwire._buffers import ModelBuffers
from gradwire._caller_plane import CallerPlane

__all__ = ["DASO", "BSP", "ParameterServer", "PoolSampler", "FlatParameters"]

_world: Optional[Comm] = None


def resolve_comm(comm: Any = None) -> Comm:
    """`comm` as a gradwire communicator: a `gradwire.Comm`, a gradwire process group, or
    None (the default process group's when it is gradwire's, else one for the whole job
    from the launcher's environment, made once)."""
    global _world
    if isinstance(comm, Comm):
        return comm
    import torch.distributed as dist

    from .torch import comm_of

    if comm is not None:
        view = comm_of(comm) if isinstance(comm, dist.ProcessGroup) else None
        if view is None:
            raise TypeError(f"comm must be a gradwire.Comm or a gradwire process group, got {type(comm).__name__}")
        return view
    if dist.is_available() and dist.is_initialized():
        view = comm_of(None)
        if view is not None:
            return view
    if _world is None:
        _world = Comm()
    return _world


def _integer(value, name, lo):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be at least {lo}, got {value}")
    return int(value)


def _fraction(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _option_string(options: dict) -> str:
    """The options as libgradwire takes them ("key=value,..."). A value is one token: one
    holding a separator would add or replace options ("sum,lr=5" is two), so it is refused."""
    items = []
    for key, value in options.items():
        # libgradwire's booleans are "true" and "false" (Python's str gives "True").
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if not text or any(c in text for c in ",=") or text != text.strip():
            raise ValueError(f"option {key}={text!r}: a value may not be empty or hold ',', '=' or surrounding spaces")
        items.append(f"{key}={text}")
    return ",".join(items)


class FlatParameters:
    """`params` (deduplicated, in order) moved into one float32 buffer for the values and
    one for the gradients. On the CPU both come from `comm.empty` (registered memory shared
    with the host's ranks) and every parameter's `.data` and `.grad` become views into
    them. For a CUDA model the views go into two flat buffers on its device, and `data` and
    `grad` are host mirrors the scheme works on: `pull_params`/`gather_grads` copy device
    to host, `push_params`/`push_grads` back (each one copy of the whole vector; on the
    CPU they do nothing). With `host_mirror=False` (a scheme whose caller moves the data)
    `data` and `grad` are the model's own flat buffers on its device, and nothing is
    copied. `host_bytes_copied` counts the bytes copies between host and device moved."""

    def __init__(self, params: Iterable[torch.Tensor], comm: Comm, host_mirror: bool = True) -> None:
        seen, self.params = set(), []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"a parameter is on {p.device}: gradwire's schemes take CPU or CUDA parameters")
            if p.dtype != torch.float32:
                raise TypeError(f"a parameter is {p.dtype}: gradwire's schemes take float32 parameters")
            self.params.append(p)
        n = sum(p.numel() for p in self.params)
        if n == 0:
            raise ValueError("no parameters to train")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"the parameters are on several devices ({', '.join(sorted(map(str, devices)))}); gradwire's schemes take one device per rank")
        self.device = self.params[0].device
        self.host_bytes_copied = 0
        if self.device.type == "cuda":
            self._model_data, self._model_grad = torch.empty(n, device=self.device), torch.zeros(n, device=self.device)
        if self.device.type == "cuda" and not host_mirror:
            self.data, self.grad = self._model_data, self._model_grad
        else:
            self.data = torch.from_numpy(comm.empty(n, "float32"))
            self.grad = torch.from_numpy(comm.empty(n, "float32"))
            self.grad.zero_()
        if self.device.type != "cuda":
            self._model_data, self._model_grad = self.data, self.grad
        self._views, self._index = [], {}
        at = 0
        for p in self.params:
            k = p.numel()
            value, grad = self._model_data[at : at + k].view_as(p), self._model_grad[at : at + k].view_as(p)
            with torch.no_grad():
                value.copy_(p)
                if p.grad is not None:
                    grad.copy_(p.grad)
            p.data = value
            if p.requires_grad:
                p.grad = grad
            self._index[id(p)] = len(self._views)
            self._views.append((value, grad))
            at += k
        self.pull_params()

    def __len__(self) -> int:
        return self.data.numel()

    def pull_params(self) -> torch.Tensor:
        """The host values, brought up to date with the model's (a CUDA model's)."""
        if self._model_data is not self.data:
            self.data.copy_(self._model_data)
            self.host_bytes_copied += self.data.nbytes
        return self.data

    def push_params(self) -> None:
        """The model's values set to the host ones (a CUDA model's)."""
        if self._model_data is not self.data:
            self._model_data.copy_(self.data)
            self.host_bytes_copied += self.data.nbytes

    def push_grads(self) -> None:
        """The model's gradients set to the host ones (a CUDA model's)."""
        if self._model_grad is not self.grad:
            self._model_grad.copy_(self.grad)
            self.host_bytes_copied += self.grad.nbytes

    def gather_grads(self) -> torch.Tensor:
        """Makes every trainable parameter's `.grad` a view into the flat gradients again
        and returns the host gradients (copied from a CUDA model's): after a
        `zero_grad(set_to_none=True)`, or for a parameter that took no part in backward,
        None becomes a zero gradient (as DDP gives unused parameters; every rank then steps
        the averaged one alike); a replaced `.grad` is copied in once. Frozen parameters
        (requires_grad False) keep no gradient. A replaced `.data` (e.g. `model.to(...)`)
        is an error: the scheme would no longer see the model."""
        for p, (value, grad) in zip(self.params, self._views):
            if p.data.data_ptr() != value.data_ptr():
                raise RuntimeError("a parameter's .data was replaced after the scheme was made (model.to(), load_state_dict(assign=True)?): make the scheme after moving the model")
            if not p.requires_grad:
                continue
            if p.grad is None:
                grad.zero_()
                p.grad = grad
            elif p.grad.data_ptr() != grad.data_ptr():
                with torch.no_grad():
                    grad.copy_(p.grad)
                p.grad = grad
        if self._model_grad is not self.grad:
            self.grad.copy_(self._model_grad)
            self.host_bytes_copied += self.grad.nbytes
        return self.grad

    def zero_unused_grad(self, p: torch.Tensor) -> None:
        """A trainable parameter that took no part in backward: a zero gradient (None
        becomes the view), a replaced one copied in."""
        grad = self._views[self._index[id(p)]][1]
        if p.grad is None:
            grad.zero_()
            p.grad = grad
        else:
            self.own_grad(p)

    def own_grad(self, p: torch.Tensor) -> None:
        """`p.grad` is a view into the flat gradients again (a replaced one copied in)."""
        grad = self._views[self._index[id(p)]][1]
        if p.grad is not None and p.grad.data_ptr() != grad.data_ptr():
            with torch.no_grad():
                grad.copy_(p.grad)
            p.grad = grad

    @contextlib.contextmanager
    def frozen_kept(self) -> Iterator[None]:
        """The frozen parameters (requires_grad False, asked each time: fine-tuning unfreezes
        layers) leave the body as they entered it. A scheme merges whole vectors, and a
        merge of equal values can round (DASO's moved a frozen layer by 1e-8)."""
        kept = [(value, value.clone()) for p, (value, _) in zip(self.params, self._views) if not p.requires_grad]
        yield
        with torch.no_grad():
            for value, before in kept:
                value.copy_(before)

    def zero_grad(self) -> None:
        """Zeroes the gradients in place (they stay views)."""
        self._model_grad.zero_()
        for p, (_, grad) in zip(self.params, self._views):
            if p.requires_grad and (p.grad is None or p.grad.data_ptr() != grad.data_ptr()):
                p.grad = grad


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"local_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [p for group in optimizer.param_groups for p in group["params"]]


class _Scheme:
    """A scheme of libgradwire over a model's flat parameters; the wrappers' common part."""

    # Whether the model to evaluate is the scheme's agreed anchor (BSP) or this rank's
    # parameters (DASO), where the caller moves the data.
    _model_is_anchor = False

    def __init__(self, params: Iterable[torch.Tensor], scheme: str, options: str, comm: Any, caller_moves: bool = False) -> None:
        self.comm = resolve_comm(comm)
        self.flat = FlatParameters(params, self.comm, host_mirror=not caller_moves)
        self._scheme, self._options, self._caller_moves = scheme, options, caller_moves
        self.plane: Optional[CallerPlane] = None
        self._strategy = self._new_strategy()
        if caller_moves:
            self.plane = CallerPlane(self.flat, self.comm, self._strategy, node_grads=scheme == "daso")
        self._on_params(self._strategy.start)
        self.epochs_ended = 0
        self.buffers: Optional[ModelBuffers] = None

    def _new_strategy(self) -> Strategy:
        """The scheme (collective); where the caller moves the data, it gets only the size."""
        if self._caller_moves:
            options = ",".join(o for o in (self._options, "data=caller") if o)
            return Strategy(self.comm, self._scheme, None, options, count=len(self.flat))
        return Strategy(self.comm, self._scheme, self.flat.pull_params(), self._options)

    def _on_params(self, call: Callable[[Optional[torch.Tensor]], Any]) -> Any:
        """`call` on the parameters: the host ones (pulled from a CUDA model, pushed back
        after), or, where the caller moves the data, no buffer and then the recorded
        actions run where the model lives."""
        if self.plane is not None:
            result = call(None)
            self.plane.run()
            return result
        result = call(self.flat.pull_params())
        self.flat.push_params()
        return result

    def _keep_buffers(self, model: torch.nn.Module) -> None:
        """`model`'s buffers (BatchNorm's statistics) become rank 0's now and are kept in
        agreement from here on (see each scheme's text for when). Collective."""
        self.buffers = ModelBuffers(model, self.comm)
        self.buffers.broadcast()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients in place (`set_to_none` is accepted and ignored: the
        gradients stay views into the scheme's buffer)."""
        del set_to_none
        self.flat.zero_grad()

    def end_epoch(self, loss: Union[float, torch.Tensor]) -> float:
        """At an epoch's end, with this rank's mean training loss: returns it averaged over
        the ranks. Collective."""
        with self.flat.frozen_kept():
            mean = self._on_params(lambda x: self._strategy.end_epoch(x, float(loss)))
        if self.buffers is not None:
            self.buffers.agree()
        self.epochs_ended += 1
        return mean

    def current_model(self) -> torch.Tensor:
        """The model to evaluate, flat (the agreed anchor, the servers' parameters, the
        centre variable), as a new tensor; the model's own parameters are left as they are.
        (Where the caller moves the data, on the model's device.)"""
        if self.plane is not None:
            return (self.plane.anchor if self._model_is_anchor else self.flat.data).clone()
        return self._strategy.current_model(self.flat.pull_params().clone())

    def finish(self) -> None:
        """Leaves the final model in the parameters, and the model's buffers, identical on
        every rank. Collective."""
        with self.flat.frozen_kept():
            self._on_params(self._strategy.finish)
        if self.plane is not None:
            self.plane.close()  # no more node averages from this model's backwards
        if self.buffers is not None:
            self.buffers.agree()

    @property
    def host_bytes_copied(self) -> int:
        """Bytes this layer copied between a CUDA model and host memory for the parameters
        and gradients so far (0 on the CPU): the host mirrors' copies, or a device-resident
        DASO's global sends and sums. The GPU communicator's own staging of a cross-node
        shard (BSP's averages) is not counted here."""
        return self.flat.host_bytes_copied

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent for the scheme."""
        return self._strategy.bytes_sent

    def describe(self) -> str:
        """The scheme's name and state (DASO's schedule, BSP's K)."""
        return self._strategy.describe()


class _FrameworkStep(_Scheme):
    """Schemes whose local step is the framework's optimizer (DASO, BSP). On host copies
    the gradients are averaged inside `step()`, just before the optimizer's step: gradient
    clipping between backward and step sees this rank's own gradients, not the average
    (DDP's). A device-resident DASO averages them in the node during backward, as DDP does:
    there clipping sees the node's average on the batches the node averages."""

    def __init__(self, local_optimizer: torch.optim.Optimizer, scheme: str, options: str, comm: Any, caller_moves: bool = False) -> None:
        super().__init__(_optimizer_params(local_optimizer), scheme, options, comm, caller_moves)
        self.local_optimizer = local_optimizer
        self.scaler = None
        self.scheduler: Any = None

    @property
    def param_groups(self):
        """The local optimizer's parameter groups (learning-rate schedules edit these)."""
        return self.local_optimizer.param_groups

    def _step(self, last_of_epoch: bool) -> None:
        grads = self.flat.gather_grads()
        if self.plane is not None:
            self._strategy.before_update(None, last_of_epoch)
            self.plane.run()
        else:
            self._strategy.before_update(grads, last_of_epoch)
            self.flat.push_grads()
        if self.scaler is not None:
            self.scaler.step(self.local_optimizer)
            self.scaler.update()
        else:
            self.local_optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        with self.flat.frozen_kept():
            self._on_params(lambda x: self._strategy.after_update(x, last_of_epoch))


class DASO(_FrameworkStep):
    """Distributed Asynchronous and Selective Optimization (Coquelin et al.), with the
    interface of Heat's `heat.optim.DASO`: node-local gradient averages every `local_skip`
    batches, a non-blocking global parameter sum every `global_skip` batches merged
    `batches_to_wait` batches later, synchronous warm-up and cool-down, and a plateau
    controller fed by `epoch_loss_logic`. Nodes are the launcher's (host identity;
    `gradwire launch --netns --ranks-per-node G`), and every node must hold the same number
    of ranks.

    A training loop, as with Heat::

        daso = DASO(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), total_epochs=E)
        for epoch in range(E):
            daso.last_batch = len(loader) - 1
            for data, target in loader:
                daso.zero_grad()
                loss_fn(model(data), target).backward()
                daso.step()
            daso.epoch_loss_logic(epoch_loss)

    Heat's arguments mean what they mean in Heat, checked as Heat checks them, and the
    schedule and arithmetic are Heat's batch for batch (src/train/daso.rs): synchronous
    phases average the sending local index's parameters over the nodes in `downcast_type`
    (bf16, fp16 or float32) and broadcast them in the node; cycling sends rotate over the
    local indices (`send_mod`), merge `batches_to_wait` batches later and are broadcast in
    the node; `warmup_epochs=0` stays synchronous. Where gradwire differs, it says so:

    - the parameters are made equal at construction (rank 0's), not re-initialised from a
      common seed;
    - `scheduler` (a torch learning-rate scheduler) steps after the local optimizer on every
      batch (Heat calls it instead of the optimizer's step, which torch's schedulers do
      not take); a warning says so;
    - with more than two nodes a bf16 or fp16 sum accumulates in float32 and rounds once;
    - `use_mpi_groups` has no effect (the groups are the launcher's nodes either way);
    - the model's buffers (`model=` or `set_model`) are, as under Heat's DDP, local index
      0's in the node before every batch whose gradients the node averages, and besides
      averaged over every rank where the parameters are agreed (Heat leaves each node its
      own).

    gradwire's own variants, off by default: `sync_average="change"` averages every rank's
    change since the parameters last agreed, in float32 sums (a bf16 cast of the
    parameters rounds a small step away), and `cap_phases=True` caps warm-up and cool-down
    at a quarter of the run each.

    `device_resident` (default: True for a CUDA model) keeps the flat parameters and
    gradients where the model is: the node-local gradient average runs on NCCL, started
    during backward bucket by bucket (as DDP's), the node broadcasts on NCCL, and only the
    parameters a global send carries, and the sum it brings back, pass through pinned host
    memory; `host_bytes_copied` counts them. False runs every step on host copies of the
    model (each step copies it to the host and back). On the CPU both give the same bits."""

    def __init__(
        self,
        local_optimizer: torch.optim.Optimizer,
        total_epochs: int,
        comm: Any = None,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        scheduler: Any = None,
        stability_level: float = 0.05,
        max_global_skips: int = 8,
        sending_chunk_size: int = 10_000_000,
        downcast_type: torch.dtype = torch.bfloat16,
        use_mpi_groups: bool = True,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        verbose: bool = False,
        model: Optional[torch.nn.Module] = None,
        sync_average: str = "heat",
        cap_phases: bool = False,
        device_resident: Optional[bool] = None,
    ) -> None:
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DASO: local_optimizer must be a torch.optim.Optimizer, got {type(local_optimizer).__name__}")
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"DASO: scheduler must be a torch learning-rate scheduler, got {type(scheduler).__name__}")
        if device_resident is None:
            params = _optimizer_params(local_optimizer)
            device_resident = bool(params) and params[0].device.type == "cuda"
        for name, value in (("verbose", verbose), ("use_mpi_groups", use_mpi_groups), ("cap_phases", cap_phases), ("device_resident", device_resident)):
            if not isinstance(value, bool):
                raise TypeError(f"DASO: {name} must be a bool, got {type(value).__name__} {value!r}")
        if not isinstance(downcast_type, torch.dtype):
            raise TypeError(f"DASO: downcast_type must be a torch.dtype, got {type(downcast_type).__name__} {downcast_type!r}")
        wires = {torch.bfloat16: "bf16", torch.half: "f16", torch.float: "f32"}
        if downcast_type not in wires:
            raise ValueError(f"DASO: downcast_type must be torch.bfloat16, torch.half or torch.float, got {downcast_type}")
        if sync_average not in ("heat", "change"):
            raise ValueError(f"DASO: sync_average must be 'heat' or 'change', got {sync_average!r}")
        options = {
            "epochs": _integer(total_epochs, "total_epochs", 1),
            "warmup_epochs": _integer(warmup_epochs, "warmup_epochs", 0),
            "cooldown_epochs": _integer(cooldown_epochs, "cooldown_epochs", 0),
            "stability_level": _fraction(stability_level, "stability_level"),
            "max_global_skips": _integer(max_global_skips, "max_global_skips", 0),
            "sending_chunk_size": _integer(sending_chunk_size, "sending_chunk_size", 1),
            "skip_reduction_factor": _integer(skip_reduction_factor, "skip_reduction_factor", 1),
            "local_skip_factor": _integer(local_skip_factor, "local_skip_factor", 1),
            "wire": wires[downcast_type],
            "sync_average": sync_average,
            "cap_phases": cap_phases,
        }
        del use_mpi_groups  # gradwire's groups come from the launcher's topology
        super().__init__(local_optimizer, "daso", _option_string(options), comm, caller_moves=device_resident)
        self.total_epochs = options["epochs"]
        self.verbose = verbose
        if scheduler is not None:
            warnings.warn(
                "DASO: scheduler steps after the local optimizer on every batch (Heat calls scheduler.step() instead of the optimizer's step)",
                stacklevel=2,
            )
            self.scheduler = scheduler
        self.module: Optional[torch.nn.Module] = None
        self._node: Optional[Comm] = None  # the node's ranks, for the buffers (set_model)
        self.amp = False
        self.last_batch: Optional[int] = None
        self.current_batch = 0
        self.epoch = 0
        if model is not None:
            self.set_model(model)

    def set_model(self, model: torch.nn.Module) -> None:
        """The model the local optimizer trains (`DataParallelMultiGPU` calls this, as does
        `model=`): its buffers become rank 0's and are kept in agreement. Collective."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"DASO.set_model: model must be a torch.nn.Module, got {type(model).__name__}")
        mine = {id(p) for p in self.flat.params}
        if any(p.requires_grad and id(p) not in mine for p in model.parameters()):
            raise ValueError("DASO.set_model: the model has trainable parameters the local optimizer does not hold")
        self.module = model
        self._keep_buffers(model)
        if self.buffers and self._node is None:
            self._node = self.plane.node if self.plane is not None else self.comm.node_local()

    def add_scaler(self, scaler: Any) -> None:
        """A `torch.amp.GradScaler`: step() then steps through it."""
        self.scaler, self.amp = scaler, True

    def step(self) -> None:
        """After `loss.backward()`: the node-local gradient average when due, the local
        optimizer's step, then the global parameter sync or merge when due; the batch
        numbered `last_batch` ends the epoch with a blocking global sync."""
        if self.last_batch is None:
            raise ValueError("DASO.step: set last_batch to the index of the epoch's last batch (len(loader) - 1) first, as with Heat")
        last = self.current_batch >= self.last_batch
        self._strategy.set_last_batch(self.last_batch)
        self._step(last)
        if self.buffers is not None and (last or self.global_skip == 0):
            # Where the parameters were just agreed globally (every synchronous batch, each
            # epoch's last): the buffers too.
            self.buffers.average()
        if self._node is not None and self._node.size > 1 and self._strategy.node_average_next:
            # Heat's DDP broadcasts the buffers in the node at the start of each forward
            # whose gradients it averages: local index 0's, for the next batch.
            self.buffers.broadcast(self._node)
        self.current_batch = 0 if last else self.current_batch + 1
        self.epoch += int(last)

    def epoch_loss_logic(self, loss: Union[float, torch.Tensor], loss_globally_averaged: bool = False) -> None:
        """Once per epoch, with the epoch's training loss: averaged over the ranks (again,
        harmlessly, when `loss_globally_averaged`), it drives the phase and the plateau
        controller that adapts global_skip, local_skip and batches_to_wait. Collective."""
        del loss_globally_averaged
        if self.current_batch != 0:
            raise ValueError(
                f"DASO.epoch_loss_logic: the epoch ended {self.current_batch} batches after its last flagged batch: "
                f"last_batch ({self.last_batch}) must be the index of the epoch's last batch, len(loader) - 1"
            )
        value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
        mean = self.end_epoch(value)
        self.print0(f"DASO: epoch {self.epoch} loss {mean:.6f} {self.describe()}")

    def _schedule(self):
        m = re.search(r"gs=(\d+) ls=(\d+) W=(-?\d+)", self.describe())
        return tuple(int(v) for v in m.groups()) if m else (0, 0, 0)

    @property
    def global_skip(self) -> int:
        """Batches between global sends (0: synchronous)."""
        return self._schedule()[0]

    @property
    def local_skip(self) -> int:
        """Batches between node-local gradient averages (0: every batch, synchronous)."""
        return self._schedule()[1]

    @property
    def batches_to_wait(self) -> int:
        """Batches between a global send and its merge (0: synchronous)."""
        return self._schedule()[2]

    def print0(self, *args: Any, **kwargs: Any) -> None:
        """Prints on rank 0 when verbose."""
        if self.verbose and self.comm.rank == 0:
            print(*args, **kwargs)

    def reset(self) -> None:
        """Back to the start of training (warm-up, a fresh controller), keeping the current
        parameters (made equal again). Collective."""
        self._strategy.free()
        self._strategy = self._new_strategy()
        if self.plane is not None:
            self.plane.reset(self._strategy)
        self._on_params(self._strategy.start)
        if self.buffers is not None:
            self.buffers.agree()
        self.current_batch, self.epoch = 0, 0
        self.zero_grad()


class BSP(_FrameworkStep):
    """Aggregation-interval bulk-synchronous SGD: `interval` (K) local steps of
    `local_optimizer` from the agreed anchor, then one allreduce averages every rank's
    change and every rank moves to the anchor minus that average (the optimizer's state,
    momentum included, stays local). `topk` (a fraction of the entries) sends only the
    largest entries of the change, keeping the rest for the next interval (error feedback);
    `node_interval` K1 (dividing K) also averages inside the node every K1 steps.

    `device_resident` (default: True for a CUDA model without `topk`) keeps the anchors and
    the change on the model's device: the averages run on the GPU communicator (NCCL inside
    the node, a 1/G shard per rank through pinned memory across nodes). False works on host
    copies of the model (each step copies it to the host and back); top-k selection needs
    them. On the CPU both give the same bits."""

    def __init__(
        self,
        local_optimizer: torch.optim.Optimizer,
        interval: int = 4,
        topk: Optional[float] = None,
        node_interval: int = 0,
        comm: Any = None,
        model: Optional[torch.nn.Module] = None,
        device_resident: Optional[bool] = None,
    ) -> None:
        options = {"interval": _integer(interval, "interval", 1), "node_interval": _integer(node_interval, "node_interval", 0)}
        if topk is not None:
            # None sends the whole change; a top-0 would send nothing.
            if _fraction(topk, "topk") == 0:
                raise ValueError("topk must be in (0, 1], got 0; topk=None sends the whole change")
            options["topk"] = repr(float(topk))
        if device_resident is None:
            params = _optimizer_params(local_optimizer)
            device_resident = topk is None and bool(params) and params[0].device.type == "cuda"
        if not isinstance(device_resident, bool):
            raise TypeError(f"BSP: device_resident must be a bool, got {type(device_resident).__name__} {device_resident!r}")
        if device_resident and topk is not None:
            raise ValueError("BSP: topk needs device_resident=False (the top-k selection runs on host copies)")
        super().__init__(local_optimizer, "bsp", _option_string(options), comm, caller_moves=device_resident)
        self._model_is_anchor = True
        self.interval = options["interval"]
        self.steps = 0
        if model is not None:
            self._keep_buffers(model)

    def step(self, last_of_epoch: bool = False) -> None:
        """After `loss.backward()`: the local optimizer's step, and every K-th step the
        change averaged over the ranks (and the model's floating buffers with it)."""
        self._step(bool(last_of_epoch))
        self.steps += 1
        if self.buffers is not None and self.steps % self.interval == 0:
            self.buffers.average()


_PS_OPTIONS = {"ddcgu": ("lr", "rule"), "cyclic": ("lr", "rule"), "downpour": ("lr", "fetch", "push", "background"), "eamsgd": ("lr", "tau", "beta")}


class ParameterServer(_Scheme):
    """The parameter-server schemes, whose update rule runs on the servers as their papers
    define it (no local optimizer): `ddcgu` (dynamic-delay cyclic gradient push over a
    remote-memory token ring), `cyclic` (the fixed cyclic push), `downpour` (fetch every
    `fetch` steps, push every `push`, local SGD between; `background=True` fetches and
    pushes on a thread of their own, as Dean et al. run them, a fetched θ replacing the
    replica when it lands; the default blocks the worker on each) and `eamsgd` (elastic averaging,
    period `tau`, moving rate `beta`). Options as in ffi/gradwire.h: lr; rule ("sum",
    "mean", "staleness") for ddcgu and cyclic. Draw minibatches with `sampler()`: a fast
    worker takes more of the epoch's pool instead of waiting for a slow one."""

    def __init__(self, model: Union[torch.nn.Module, Iterable[torch.Tensor]], scheme: str = "ddcgu", comm: Any = None, **options: Any) -> None:
        if scheme not in _PS_OPTIONS:
            raise ValueError(f"ParameterServer: scheme must be one of {', '.join(_PS_OPTIONS)}, got {scheme!r}")
        for k in options:
            if k not in _PS_OPTIONS[scheme]:
                raise ValueError(f"ParameterServer: {scheme} takes no option {k!r}; its options: {', '.join(_PS_OPTIONS[scheme])}")
        if "background" in options:
            if not isinstance(options["background"], bool):
                raise TypeError(f"ParameterServer: background must be a bool, got {type(options['background']).__name__} {options['background']!r}")
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        super().__init__(params, scheme, _option_string(options), comm)
        self.scheme = scheme
        if isinstance(model, torch.nn.Module):
            self._keep_buffers(model)

    def step(self) -> None:
        """After `loss.backward()`: the scheme's push, pull and update; the parameters are
        then the next minibatch's."""
        with self.flat.frozen_kept():
            self._strategy.step(self.flat.pull_params(), self.flat.gather_grads())
            self.flat.push_params()

    @property
    def shared_pool(self) -> bool:
        """Whether the ranks draw from one minibatch pool per epoch (ddcgu, downpour,
        eamsgd); `cyclic` gives every rank its fixed share (a DistributedSampler's)."""
        return self._strategy.shared_pool

    def claim_batch(self, total: int) -> bool:
        """Whether this rank may take one more of the epoch's `total` minibatches."""
        return self._strategy.claim_batch(total)

    def sampler(self, dataset_size: int, batch_size: int, seed: int = 0) -> "PoolSampler":
        """A batch sampler over the shared pool (`DataLoader(ds, batch_sampler=...)`)."""
        if not self.shared_pool:
            raise ValueError(f"{self.scheme} gives every rank its fixed share of the epoch: use torch's DistributedSampler")
        return PoolSampler(self, dataset_size, batch_size, seed)


class PoolSampler(torch.utils.data.Sampler):
    """A batch sampler for the asynchronous schemes: each epoch the ranks share one pool of
    `dataset_size // batch_size` minibatches; this rank yields a minibatch of indices (from
    its own shuffled stream of the dataset) for every one it claims, until the pool is
    empty. Call the scheme's `end_epoch` after each epoch (it moves the pool on). With
    DataLoader workers, batches are claimed as the loader prefetches them."""

    def __init__(self, scheme: ParameterServer, dataset_size: int, batch_size: int, seed: int = 0) -> None:
        self.scheme = scheme
        self.dataset_size = _integer(dataset_size, "dataset_size", 1)
        self.batch_size = _integer(batch_size, "batch_size", 1)
        if self.batch_size > self.dataset_size:
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({dataset_size})")
        # The epochs this sampler has been iterated for (each needs its end_epoch first).
        self.seed, self.epoch, self._passes = int(seed), 0, 0
        self.total = self.dataset_size // self.batch_size

    def __len__(self) -> int:
        """This rank's even share (an estimate: a faster rank takes more)."""
        return max(1, self.total // self.scheme.comm.size)

    def _stream(self) -> Iterator[List[int]]:
        while True:
            self._passes += 1
            # Ints hash alike in every process: each rank its own stream, each pass its order.
            g = torch.Generator().manual_seed(hash((self.seed, self.scheme.comm.rank, self._passes)) & ((1 << 63) - 1))
            order = torch.randperm(self.dataset_size, generator=g).tolist()
            for i in range(0, self.dataset_size - self.batch_size + 1, self.batch_size):
                yield order[i : i + self.batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        # The pool moves to the next epoch at the scheme's end_epoch: iterating twice in one
        # epoch would silently find it empty.
        if self.scheme.epochs_ended < self.epoch:
            raise RuntimeError(f"PoolSampler: epoch {self.epoch} was iterated already; call end_epoch(loss) on the scheme after each epoch")
        self.epoch = self.scheme.epochs_ended + 1
        stream = self._stream()
        while self.scheme.claim_batch(self.total):
            yield next(stream)

"""The data side of a scheme made with `data=caller` (src/train/plan.rs): libgradwire keeps
the schedule and says, action by action, what to do with the model's parameters and
gradients; this runs those actions where the model lives. For a CUDA model that is its
device: DASO's node-local gradient average is NCCL (through `Comm.gpu`), started during
backward bucket by bucket as DDP's is, the node broadcasts are NCCL, and only what crosses
nodes (a sender's parameters, a sum coming back) is staged through pinned host memory;
averages over every rank (BSP's change, DASO's `sync_average="change"`) run on the GPU
communicator, whose cross-node step stages one 1/G shard per rank.
A CPU model runs the same actions on the host communicators, which is how CI checks them
against the host schemes bit for bit.
"""

import collections
import weakref
from typing import Callable, Deque, List, Optional, Tuple

import torch

from . import Comm, Strategy, Work

# The action codes of ffi/gradwire.h (gradwire_strategy_take_actions).
BROADCAST_ALL, AVERAGE_GRADS_NODE, BROADCAST_NODE, SEND_SUM, MERGE_OLDEST = 1, 2, 3, 4, 5
TAKE_AVERAGE, AVERAGE_ON_WIRE, AVERAGE_CHANGE, SET_ANCHOR, AVERAGE_NEXT_GRADS = 6, 7, 8, 9, 10
AVERAGE_GRADS_ALL, AVERAGE_CHANGE_NODE, TAKE_ANCHOR, SET_NODE_ANCHOR = 11, 12, 13, 14
WIRE_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}

# DDP's default bucket: big enough to keep the link busy, small enough to start early.
BUCKET_BYTES = 25 << 20


class _NodeGradAverage:
    """The node-local gradient average, started during backward as DDP's is: the trainable
    parameters, in reverse order (roughly the order backward finishes them), form buckets
    of about `BUCKET_BYTES`; the buckets' runs of the flat gradient are averaged over the
    node (NCCL on the CUDA stream, or a non-blocking host allreduce) strictly in bucket
    order, each as soon as it and every bucket before it have their gradients, so every
    rank issues them in the same order whichever parameters it used. At the end of
    backward the rest start (an unused parameter's gradient is zero), and on the CPU they
    are waited for: after `backward()` the gradients are the node's average, as under DDP.
    Parameters made trainable after construction are averaged in `finish()` and get hooks
    for the next backward."""

    def __init__(self, flat, average: Callable[[torch.Tensor], Optional[Work]], wait_at_end: bool) -> None:
        self.flat, self.average, self.bucket_bytes, self.wait_at_end = flat, average, BUCKET_BYTES, wait_at_end
        self.armed = False
        self.handles: List = []
        self._build()

    def _build(self) -> None:
        self.close()
        self.buckets, self.bucket_of = [], {}
        offsets, at = {}, 0
        for p in self.flat.params:
            offsets[id(p)] = (at, at + p.numel())
            at += p.numel()
        self.hooked = [p for p in self.flat.params if p.requires_grad]
        bucket: List[torch.Tensor] = []
        size = 0
        for p in reversed(self.hooked):
            bucket.append(p)
            size += p.numel() * 4
            if size >= self.bucket_bytes:
                self._add_bucket(bucket, offsets)
                bucket, size = [], 0
        if bucket:
            self._add_bucket(bucket, offsets)
        me = weakref.ref(self)
        for p in self.hooked:
            # A parameter serves one scheme at a time: an earlier scheme's hooks go.
            earlier = getattr(p, "_gradwire_node_average", None)
            if earlier is not None and earlier() is not None and earlier() is not self:
                earlier().close()
            p._gradwire_node_average = me
            self.handles.append(p.register_post_accumulate_grad_hook(_hook(me)))
        self._reset()

    def _add_bucket(self, params: List[torch.Tensor], offsets) -> None:
        # The bucket's contiguous runs of the flat gradient (frozen parameters between
        # trainable ones are left out: their gradient is never touched).
        spans = sorted(offsets[id(p)] for p in params)
        runs: List[Tuple[int, int]] = []
        for lo, hi in spans:
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi)
            else:
                runs.append((lo, hi))
        index = len(self.buckets)
        self.buckets.append((runs, list(params)))
        for p in params:
            self.bucket_of[id(p)] = index

    def _reset(self) -> None:
        self.waiting = [len(ps) for _, ps in self.buckets]
        self.started: List[bool] = [False] * len(self.buckets)
        self.next = 0  # the first bucket not started
        self.fired = set()  # the parameters whose gradient this backward produced
        self.works: List[Work] = []
        self.end_queued = False

    def ready(self, p: torch.Tensor) -> None:
        """A parameter's gradient is accumulated (its hook)."""
        if not self.armed:
            return
        index = self.bucket_of[id(p)]
        if self.started[index] or id(p) in self.fired:
            # The averages under way finish first (the node's other ranks run them too), so
            # nothing is left writing into the gradients after the error.
            for work in self.works:
                work.wait()
            self._reset()
            self.armed = False
            raise RuntimeError(
                "DASO: a second backward before step() while the node averages this step's gradients; "
                "accumulate over several backwards only on batches that skip the node-local average, or call step() after each"
            )
        if not self.end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.end_queued = True
        self.flat.own_grad(p)
        self.fired.add(id(p))
        self.waiting[index] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._start(self.next)

    def _start(self, index: int) -> None:
        self.started[index] = True
        self.next = index + 1
        for lo, hi in self.buckets[index][0]:
            work = self.average(self.flat.grad[lo:hi])
            if work is not None:
                self.works.append(work)

    def _start_rest(self) -> None:
        """Starts, in order, the buckets backward did not complete; a parameter it did not
        reach has a zero gradient (as `gather_grads` would make it)."""
        while self.next < len(self.buckets):
            for p in self.buckets[self.next][1]:
                if id(p) not in self.fired:
                    self.flat.zero_unused_grad(p)
            self._start(self.next)

    def _end_of_backward(self) -> None:
        if not self.armed:
            return
        self._start_rest()
        if self.wait_at_end:
            for work in self.works:
                work.wait()
            self.works = []

    def finish(self) -> None:
        """Every bucket started and done; the gradients are the node's average."""
        self._start_rest()
        for work in self.works:
            work.wait()
        unfrozen = [p for p in self.flat.params if p.requires_grad and not any(p is q for q in self.hooked)]
        if unfrozen or len(self.hooked) != sum(p.requires_grad for p in self.flat.params):
            self._average_unhooked(unfrozen)
            self._build()
        self._reset()

    def _average_unhooked(self, params: List[torch.Tensor]) -> None:
        at = 0
        for p in self.flat.params:
            if any(p is q for q in params):
                work = self.average(self.flat.grad[at : at + p.numel()])
                if work is not None:
                    work.wait()
            at += p.numel()

    def close(self) -> None:
        """The hooks go (after `finish()`, or when another scheme takes the parameters)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.armed = False


def _hook(grads_ref):
    """A post-accumulate-grad hook that does not keep the scheme alive."""

    def hook(p: torch.Tensor) -> None:
        grads = grads_ref()
        if grads is not None:
            grads.ready(p)

    return hook


class CallerPlane:
    """Runs a `data=caller` scheme's actions on `flat` (parameters and gradients where the
    model lives) over `comm`'s node-local and cross-node groups. Collective to make."""

    def __init__(self, flat, comm: Comm, strategy: Strategy, node_grads: bool) -> None:
        self.flat, self.world, self.strategy = flat, comm, strategy
        self.node, self.cross = comm.node_local(), comm.cross_node()
        self.cuda = flat.device.type == "cuda"
        self.node_gpu = self.node.gpu(flat.device.index) if self.cuda and self.node.size > 1 else None
        self.world_gpu = comm.gpu(flat.device.index) if self.cuda and comm.size > 1 else None
        self.in_flight: Deque[Tuple[List[Work], torch.Tensor]] = collections.deque()
        self.anchor: Optional[torch.Tensor] = None
        self.node_anchor: Optional[torch.Tensor] = None
        # DASO's node-local gradient average (BSP's averages are whole-vector actions).
        self.grads = _NodeGradAverage(flat, self._node_average, wait_at_end=not self.cuda) if node_grads and self.node.size > 1 else None

    def reset(self, strategy: Strategy) -> None:
        """A new strategy (DASO.reset): nothing of the old one stays in flight."""
        for works, _ in self.in_flight:
            for w in works:
                w.wait()
        self.in_flight.clear()
        self.strategy = strategy
        if self.grads is not None:
            self.grads._build()  # the hooks again (finish() took them)

    def close(self) -> None:
        if self.grads is not None:
            self.grads.close()

    def _node_average(self, grad: torch.Tensor) -> Optional[Work]:
        if self.node_gpu is not None:
            self.node_gpu.allreduce(grad, "avg")  # enqueued on torch's stream
            return None
        return self.node.iallreduce(grad, "avg")

    def _to_host(self, t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """`t` itself on the CPU (a copy if `copy`), else its values in pinned host memory."""
        if not self.cuda:
            return t.clone() if copy else t
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t)
        self.flat.host_bytes_copied += h.nbytes
        return h

    def _to_device(self, h: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return h
        self.flat.host_bytes_copied += h.nbytes
        return h.to(self.flat.device)

    def _on_host(self, comm: Comm, t: torch.Tensor, collective: Callable[[torch.Tensor], object]) -> None:
        """`collective` over `comm` on `t`'s values in host memory, the result back in `t`
        (nothing moves where `comm` is this rank alone: its sum, average or broadcast is `t`)."""
        if comm.size == 1:
            return
        h = self._to_host(t)
        collective(h)
        if self.cuda:
            t.copy_(h)
            self.flat.host_bytes_copied += h.nbytes

    def run(self) -> None:
        """Takes the scheme's recorded actions and runs them, in order."""
        x = self.flat.data
        for code, a, b in self.strategy.take_actions():
            with torch.no_grad():
                if code == BROADCAST_ALL:
                    self._on_host(self.world, x, lambda h: self.world.broadcast(h, a))
                elif code == AVERAGE_GRADS_NODE:
                    self.grads.finish()
                elif code == BROADCAST_NODE:
                    if self.node_gpu is not None:
                        self.node_gpu.broadcast(x, a)
                    else:
                        self.node.broadcast(x, a)
                elif code == SEND_SUM:
                    self._send(x, a, b)
                elif code == MERGE_OLDEST:
                    # Heat's merge, as its torch expressions (x *= factor; x += sum / denom).
                    numer = 2.0 * a if a > 0 else 1.0
                    denom = float(b + numer)
                    total = self._receive()
                    x *= numer / denom
                    x += total / denom
                elif code == TAKE_AVERAGE:
                    x.copy_(self._receive() / float(a))
                elif code == AVERAGE_ON_WIRE:
                    wire = WIRE_DTYPES[b]
                    w = x if wire == torch.float32 else x.to(wire)
                    self._on_host(self.cross, w, self.cross.allreduce)
                    x.copy_(w / float(a))
                elif code == AVERAGE_CHANGE:
                    self._average_change(x, self.anchor, WIRE_DTYPES[a], self.world, self.world_gpu)
                elif code == AVERAGE_CHANGE_NODE:
                    self._average_change(x, self.node_anchor, torch.float32, self.node, self.node_gpu)
                elif code == AVERAGE_GRADS_ALL:
                    self._average(self.flat.grad, self.world, self.world_gpu)
                elif code == TAKE_ANCHOR:
                    x.copy_(self.anchor)
                elif code == SET_NODE_ANCHOR:
                    self.node_anchor = x.clone() if self.node_anchor is None else self.node_anchor.copy_(x)
                elif code == SET_ANCHOR:
                    self.anchor = x.clone() if self.anchor is None else self.anchor.copy_(x)
                elif code == AVERAGE_NEXT_GRADS:
                    if self.grads is not None:
                        self.grads.armed = bool(a)
                else:
                    raise RuntimeError(f"DASO: unknown action {code} from libgradwire (a Python layer older than the library?)")

    def _average(self, t: torch.Tensor, comm: Comm, gpu) -> None:
        """`t` averaged over `comm`: on the GPU communicator for a CUDA model (NCCL inside
        the node, a 1/G shard through pinned memory across), in place on the CPU."""
        if comm.size == 1:
            return
        if gpu is not None:
            gpu.allreduce(t, "avg")
        else:
            comm.allreduce(t, "avg")

    def _average_change(self, x: torch.Tensor, anchor: torch.Tensor, wire: torch.dtype, comm: Comm, gpu) -> None:
        """x ← anchor + the average over `comm` of (x − anchor) cast to `wire`; the anchor
        becomes x."""
        w = (x - anchor).to(wire)
        self._average(w, comm, gpu)
        x.copy_(anchor + w.to(torch.float32))
        anchor.copy_(x)

    def _send(self, x: torch.Tensor, first: int, chunk: int) -> None:
        """Starts the float32 sum of a copy of `x` over the nodes, Heat's chunks in order."""
        if self.cross.size == 1:
            self.in_flight.append(([], x.clone()))  # one node: the sum is the copy
            return
        h = self._to_host(x, copy=True)
        bounds = [(0, first)] + [(lo, min(lo + chunk, h.numel())) for lo in range(first, h.numel(), chunk)]
        works = [self.cross.iallreduce(h[lo:hi]) for lo, hi in bounds]
        self.in_flight.append((works, h))

    def _receive(self) -> torch.Tensor:
        """The oldest sum in flight, waited for, where the model lives."""
        works, h = self.in_flight.popleft()
        for w in works:
            w.wait()
        return self._to_device(h) if works else h

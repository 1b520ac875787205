"""Under `gradwire launch -n 4 --netns --ranks-per-node 2`: DASO with the data where the
model lives (`device_resident=True`, the path a CUDA model takes; here CPU tensors through
the same Python code) against DASO on gradwire's host buffers, on a model with BatchNorm,
a frozen layer that is unfrozen mid-run, a parameter no batch uses and one only the even
ranks use (so the ranks complete their buckets in different orders), with momentum SGD,
several gradient buckets and a schedule that skips node-local averages (a constant loss
drives the plateau controller to its reset, gs 4, ls 2). Both runs start
from the same parameters and see the same data; their parameters and buffers must be
bit-identical after every epoch on every rank. Also checked: the node-local average is done
when backward returns, the hooks go at finish(), a second backward before step() on such a
batch is an error, nothing is copied between host and device for
a CPU model. Then BSP the same way (K = 3; K = 4 with K1 = 2 in the node; K = 1, the
gradient form): parameters, buffers and `current_model()` bit-identical to the host run
after every epoch. Prints "device resident: ok" per rank.
"""

import sys

import numpy as np
import torch
import torch.nn as nn

import gradwire._caller_plane as plane
from gradwire.optim import BSP, DASO, resolve_comm

torch.set_num_threads(1)
comm = resolve_comm()
rank = comm.rank
failures = []
EPOCHS, BATCHES = 14, 5
plane.BUCKET_BYTES = 256  # several buckets in a small model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # In no forward: its gradient stays zero. Registered first, so its bucket is the last
        # (buckets go in reverse order) and the even ranks' parameter's bucket is the first.
        self.unused = nn.Linear(3, 3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 3)
        self.even = nn.Linear(3, 3)  # used on even ranks only: buckets complete in another order

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(torch.relu(self.bn(self.conv(x))).flatten(1))))
        return out + self.even(out) if rank % 2 == 0 else out


def batch(epoch, step):
    g = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
    return torch.randn(6, 3, 4, 4, generator=g) * (1 + rank), torch.randint(0, 3, (6,), generator=g)


def train(resident):
    torch.manual_seed(50 + rank)  # different on every rank: DASO makes them rank 0's
    model = Net()
    model.fc1.weight.requires_grad_(False)
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    daso = DASO(local, total_epochs=EPOCHS, warmup_epochs=1, cooldown_epochs=1, max_global_skips=4, local_skip_factor=2, model=model, device_resident=resident)
    if (daso.plane is not None) != resident:
        failures.append(f"device_resident={resident}, but the caller plane is {'on' if daso.plane else 'off'}")
    daso.last_batch = BATCHES - 1
    states, schedules, during_backward = [], [], 0
    for epoch in range(EPOCHS):
        if epoch == 4:
            model.fc1.weight.requires_grad_(True)  # fine-tuning unfreezes a layer
        for step in range(BATCHES):
            schedules.append((daso.global_skip, daso.local_skip, daso.batches_to_wait))
            x, y = batch(epoch, step)
            daso.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grads = daso.plane.grads if resident else None
            if grads is not None and grads.armed:
                # Every bucket is under way when backward returns, and on the CPU done: the
                # gradients are the node's average already, as under DDP.
                if not all(grads.started) or grads.works:
                    failures.append(f"epoch {epoch} batch {step}: the node average is not done when backward returns")
                during_backward += sum(grads.started)
            daso.step()
        # A constant loss: plateaus walk gs 4 -> 2 -> 1, then the reset to gs = ls = W... max.
        daso.epoch_loss_logic(1.0)
        states.append(flat_state(model))
    daso.finish()
    states.append(flat_state(model))
    if resident and daso.plane.grads is not None and daso.plane.grads.handles:
        failures.append("the gradient hooks outlive finish()")
    if daso.host_bytes_copied != 0:
        failures.append(f"{daso.host_bytes_copied} bytes copied between host and device for a CPU model")
    return states, schedules, during_backward, daso


def flat_state(model):
    return torch.cat([t.detach().reshape(-1).double() for t in list(model.parameters()) + list(model.buffers())]).numpy()


host_states, host_schedules, _, _ = train(False)
res_states, res_schedules, started, daso = train(True)
if host_schedules != res_schedules:
    failures.append("the schedules differ")
if len({s for s in host_schedules if s[1] > 1}) == 0 or len({s for s in host_schedules if s[0] > 0}) == 0:
    failures.append(f"the run never cycled with local skips: {sorted(set(host_schedules))}")
for e, (a, b) in enumerate(zip(host_states, res_states)):
    if not np.array_equal(a, b):
        failures.append(f"epoch {e}: parameters or buffers differ from the host run by up to {np.abs(a - b).max():.3g}")
        break
in_node = daso.plane.grads is not None  # more than one rank per node
if in_node and started == 0:
    failures.append("no bucket started during backward")
if in_node and len(daso.plane.grads.buckets) < 3:
    failures.append(f"only {len(daso.plane.grads.buckets)} gradient buckets: the test meant several")
every = np.empty(comm.size * res_states[-1].size)
comm.allgather(np.ascontiguousarray(res_states[-1]), every)
if not (every.reshape(comm.size, -1) == res_states[-1]).all():
    failures.append("after finish() the ranks' parameters and buffers differ")

# A second backward before step() on a batch whose gradients the node averages.
torch.manual_seed(0)
model = Net()
daso = DASO(torch.optim.SGD(model.parameters(), lr=0.1), total_epochs=2, model=model, device_resident=True)
daso.last_batch = 0
x, y = batch(0, 0)
nn.functional.cross_entropy(model(x), y).backward()
if in_node:
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        failures.append("a second backward before step() was accepted")
    except RuntimeError as e:
        if "second backward" not in str(e):
            failures.append(f"a second backward: unclear error {e}")
daso.finish()



def train_bsp(resident, **options):
    torch.manual_seed(70 + rank)
    model = Net()
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bsp = BSP(local, model=model, device_resident=resident, **options)
    if (bsp.plane is not None) != resident:
        failures.append(f"BSP device_resident={resident}, but the caller plane is {'on' if bsp.plane else 'off'}")
    states = []
    for epoch in range(4):
        for step in range(BATCHES):
            x, y = batch(epoch, step)
            bsp.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            bsp.step(last_of_epoch=step == BATCHES - 1)
        bsp.end_epoch(1.0)
        states.append(np.concatenate([flat_state(model), bsp.current_model().double().numpy()]))
    bsp.finish()
    states.append(flat_state(model))
    return states


for options in ({"interval": 3}, {"interval": 4, "node_interval": 2}, {"interval": 1}):
    host, resident = train_bsp(False, **options), train_bsp(True, **options)
    for e, (a, b) in enumerate(zip(host, resident)):
        if not np.array_equal(a, b):
            failures.append(f"BSP {options}, epoch {e}: parameters, buffers or current_model differ from the host run by up to {np.abs(a - b).max():.3g}")
            break
try:
    BSP(torch.optim.SGD(Net().parameters(), lr=0.1), topk=0.1, device_resident=True)
    failures.append("BSP accepted topk with device_resident=True")
except ValueError as e:
    if "topk" not in str(e):
        failures.append(f"BSP topk with device_resident: unclear error {e}")

for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
if not failures:
    print(f"rank {rank}: device resident: ok ({len(host_states)} states equal, {started} buckets started in backward)", flush=True)
sys.exit(1 if failures else 0)

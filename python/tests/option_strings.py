"""Under `gradwire launch -n 2`: scheme options and the strategy life cycle at the Python
boundary. An option value holding a separator cannot add or replace options, a key given
twice is refused, BSP's topk=0 is refused (None sends the whole change), and a strategy
refuses calls out of its life cycle (start twice; steps after finish). Prints
"options: ok" when every case holds.
"""

import numpy as np
import torch

import gradwire
from gradwire.optim import BSP, ParameterServer

comm = gradwire.Comm()
failures = []


def refused(what, kind, call, needle):
    try:
        call()
    except kind as e:
        if needle not in str(e):
            failures.append(f"{what}: refused, but the error does not say {needle!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001 (the wrong kind is a failure to report)
        failures.append(f"{what}: raised {type(e).__name__}, not {kind.__name__}: {e}")
        return
    failures.append(f"{what}: accepted")


model = torch.nn.Linear(4, 2)
refused("a comma in rule", ValueError, lambda: ParameterServer(model, "ddcgu", comm=comm, rule="sum,lr=5"), "may not")
refused("a comma in beta", ValueError, lambda: ParameterServer(model, "eamsgd", comm=comm, beta="0.5,tau=3"), "may not")
refused("an '=' in lr", ValueError, lambda: ParameterServer(model, "ddcgu", comm=comm, lr="lr=0.5"), "may not")
refused("topk=0", ValueError, lambda: BSP(torch.optim.SGD(model.parameters(), lr=0.1), topk=0, comm=comm), "topk")

params = np.zeros(8, dtype=np.float32)
refused("a key given twice", gradwire.InvalidArgumentError, lambda: gradwire.Strategy(comm, "bsp", params, "interval=2,interval=3"), "given twice")
refused("a key injected twice", gradwire.InvalidArgumentError, lambda: gradwire.Strategy(comm, "ddcgu", params, "rule=sum,lr=5,lr=0.01"), "given twice")
refused("raw topk=0", gradwire.InvalidArgumentError, lambda: gradwire.Strategy(comm, "bsp", params, "topk=0"), "topk")

s = gradwire.Strategy(comm, "bsp", params, "interval=2")
refused("a step before start", gradwire.InvalidArgumentError, lambda: s.before_update(np.zeros(8, dtype=np.float32)), "start first")
s.start(params)
refused("start twice", gradwire.InvalidArgumentError, lambda: s.start(params), "already started")
s.before_update(np.zeros(8, dtype=np.float32))
s.after_update(params)
s.finish(params)
refused("before_update after finish", gradwire.InvalidArgumentError, lambda: s.before_update(np.zeros(8, dtype=np.float32)), "has finished")
refused("after_update after finish", gradwire.InvalidArgumentError, lambda: s.after_update(params), "has finished")
refused("end_epoch after finish", gradwire.InvalidArgumentError, lambda: s.end_epoch(params, 0.0), "has finished")
refused("finish twice", gradwire.InvalidArgumentError, lambda: s.finish(params), "has finished")
refused("start after finish", gradwire.InvalidArgumentError, lambda: s.start(params), "has finished")
s.current_model(np.zeros(8, dtype=np.float32))  # the final model stays readable
s.free()

ps = gradwire.Strategy(comm, "ddcgu", params, "lr=0.1")
ps.start(params)
ps.finish(params)
refused("a parameter-server step after finish", gradwire.InvalidArgumentError, lambda: ps.step(params, np.zeros(8, dtype=np.float32)), "has finished")
ps.free()

for f in failures:
    print(f"rank {comm.rank}: {f}", flush=True)
print("options: ok" if not failures else f"options: {len(failures)} failed", flush=True)
raise SystemExit(1 if failures else 0)

"""gradwire's own communicator (`gradwire.Comm()`, what the schemes and the C ABI's
gradwire_comm_init use) made from whatever a launcher gives its ranks: no gradwire
variable. Checks an allreduce of known values and that gradwire's nodes are the launcher's
(`--per-node N`: N ranks in each). Prints "launcher comm: ok (rank R of W)"."""

import argparse
import os

import numpy as np

import gradwire

ap = argparse.ArgumentParser()
ap.add_argument("--per-node", type=int, required=True)
args = ap.parse_args()
leaked = sorted(k for k in os.environ if k.startswith("GRADWIRE_") and k != "GRADWIRE_LIB")
if leaked:
    raise SystemExit(f"gradwire variables in the job's environment: {leaked}")
comm = gradwire.Comm()
rank, world = comm.rank, comm.size
x = np.full(4096, rank + 1, dtype=np.float32)
comm.allreduce(x)
if not np.array_equal(x, np.full(4096, world * (world + 1) / 2, dtype=np.float32)):
    raise SystemExit(f"rank {rank}: allreduce gave {x[:4]}")
node = comm.node_local()
if node.size != args.per_node:
    raise SystemExit(f"rank {rank}: gradwire's node has {node.size} ranks, the launcher put {args.per_node} on each")
print(f"launcher comm: ok (rank {rank} of {world})", flush=True)

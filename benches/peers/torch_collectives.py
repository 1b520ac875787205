#!/usr/bin/env python3
"""torch_collectives.py -- torch.distributed collectives on gradwire's PyTorch backend.

The timing code of gloo_collectives.py (same options, sizes, method, correctness check
and CSV: size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong), with
init_process_group("gradwire") after `import gradwire.torch` (python/gradwire/torch.py
registers the backend).  benches/collectives.sh's torch part runs it for
reduce_scatter (dist.reduce_scatter_tensor), allgather (dist.all_gather_into_tensor) and
allreduce (dist.all_reduce) beside `gradwire bench` of the same collective and sizes:

    GRADWIRE_LIB=target/release/libgradwire.so PYTHONPATH=python \
    gradwire launch -n 2 -- python3 benches/peers/torch_collectives.py \
        -c reduce_scatter -b 1M -e 64M -f 4 -n 20 -w 5 --csv torch.csv

A collective the backend lacks prints `gw-na: gradwire: <error>` on rank 0 and writes no
CSV (recorded as "n/a (gradwire: <error>)").  The backend can be changed with
GW_TORCH_BACKEND (default "gradwire").
"""
import os
import sys

import gradwire.torch  # noqa: F401  (registers the "gradwire" backend)

from gloo_collectives import main

if __name__ == "__main__":
    sys.exit(main(backend=os.environ.get("GW_TORCH_BACKEND", "gradwire"), prog="torch_collectives"))

#!/bin/sh
# One node of a torchrun job across network namespaces, as a cluster runs it:
#
#   gradwire launch -n NODES --netns --bind none -- sh python/tests/torchrun_node.sh SCRIPT ARGS...
#
# gradwire launch only makes the "nodes" (one namespace each, on a private bridge) and
# starts this script once per node; everything it exports (RANK, MASTER_ADDR,
# GRADWIRE_JOB_SECRET, ...) is dropped here, and torchrun starts the node's ranks with its
# c10d rendezvous on node 0's address. Environment: PER_NODE (ranks per node, default 2),
# MAX_RESTARTS (default 0).
set -eu
addr=$(ip -4 -o addr show dev eth0 | awk '{ split($4, a, "/"); print a[1]; exit }')
first=10.77.0.2  # node 0's address on gradwire launch's bridge
host=0
[ "$addr" = "$first" ] && host=1
exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT \
    -u GRADWIRE_JOB_SECRET GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
    python3 -m torch.distributed.run --nnodes "$WORLD_SIZE" --nproc-per-node "${PER_NODE:-2}" \
    --rdzv-backend c10d --rdzv-endpoint "$first:29400" --rdzv-id job --rdzv-conf "is_host=$host" \
    --local-addr "$addr" --max-restarts "${MAX_RESTARTS:-0}" "$@"

#!/usr/bin/env bash
# hydra_netns.sh -- run a program under Hydra's mpiexec (MPICH's launcher, the one
# `pip install mpich` brings) across the network namespaces `gradwire launch --netns`
# creates, with no gradwire variable in the ranks' environment:
#
#   gradwire launch -n NODES --netns --bind none -- tests/launchers/hydra_netns.sh PER_NODE PROGRAM ARGS...
#
# gradwire launch only makes the "nodes" and starts this script once per namespace; every
# copy but node 0's exits at once. Node 0 drops what gradwire launch exported (RANK,
# MASTER_ADDR, GRADWIRE_JOB_SECRET, ...) and becomes mpiexec, PER_NODE ranks on each
# node's eth0 address; for the other nodes Hydra calls this script as its rsh agent
# (`hydra_netns.sh HOST CMD...` with GW_HYDRA_NETNS_PREFIX set), which runs the proxy in
# the namespace that owns HOST, as ssh would on a real node. The ranks find each other through Hydra's PMI server
# (PMI_FD), as gradwire does under any launcher that offers one.
set -uo pipefail
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
die() { echo "hydra_netns.sh: $*" >&2; exit 1; }
ns_addr() { ip -n "$1" -4 -o addr show dev eth0 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'; }

if [ -n "${GW_HYDRA_NETNS_PREFIX:-}" ]; then
    while [ "${1:-}" != "${1#-}" ]; do shift; done  # an rsh agent's own options, if any
    host=${1:?agent: no host}; shift
    for ns in $(ip netns list | awk '{ print $1 }' | grep -E "^${GW_HYDRA_NETNS_PREFIX:?}[0-9]+\$"); do
        [ "$(ns_addr "$ns")" = "$host" ] && exec ip netns exec "$ns" sh -c "$*"
    done
    die "agent: no namespace ${GW_HYDRA_NETNS_PREFIX}* owns $host"
fi

per_node=${1:?usage: hydra_netns.sh PER_NODE PROGRAM ARGS...}; shift
[ "${RANK:?start it with gradwire launch --netns}" = 0 ] || exit 0
me=$(ip netns identify $$ 2>/dev/null)
[[ "$me" =~ ^(.*n)0$ ]] || die "not in namespace ...n0 of gradwire launch --netns (in '$me')"
prefix=${BASH_REMATCH[1]}
hosts=()
for i in $(seq 0 $((WORLD_SIZE - 1))); do
    hosts+=("$(ns_addr "$prefix$i"):$per_node")
done
host_list=$(IFS=,; echo "${hosts[*]}")
echo "hydra_netns.sh: mpiexec -n $((WORLD_SIZE * per_node)) -hosts $host_list $*" >&2
exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT \
    -u GRADWIRE_JOB_SECRET GW_HYDRA_NETNS_PREFIX="$prefix" \
    mpiexec -n $((WORLD_SIZE * per_node)) -hosts "$host_list" -launcher rsh -launcher-exec "$SELF" \
    -iface eth0 "$@"

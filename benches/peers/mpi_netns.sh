#!/usr/bin/env bash
# mpi_netns.sh -- run an Open MPI job across the network namespaces that
# `gradwire launch --netns` creates, so Open MPI crosses exactly the same
# bridge and the same tbf-shaped links as gradwire and Gloo do.
#
#   gradwire launch -n 4 --netns --link-gbit 10 -- \
#       benches/peers/mpi_netns.sh [--mpi-args "ARGS"] -- PROGRAM ARGS...
#
# gradwire launch starts this script once per namespace ("node", 1 rank per
# node).  Every rank but RANK 0 exits at once.  Rank 0 finds its own
# namespace (`ip netns identify`), the sibling namespaces of the same launch
# (same name, last "n<i>" replaced) and their eth0 addresses, and then
# *becomes* (exec) mpirun, so the launcher's timeout/signals reach mpirun
# directly:
#
#   mpirun --allow-run-as-root -np W --host A0,A1,...  --bind-to none \
#       --mca plm_rsh_agent "mpi_netns.sh --agent" --mca plm_rsh_no_tree_spawn 1 \
#       --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include eth0 \
#       --mca oob_tcp_if_include eth0 [--mca mpi_yield_when_idle 1] \
#       [ARGS] PROGRAM ARGS...
#
# mpirun runs in namespace 0; A0 is its own address, so rank 0 is started by
# mpirun itself; for A1.. mpirun calls the "rsh agent", which is this script
# in --agent mode: it maps the address to the namespace that owns it and
# runs the orted command there (`ip netns exec NS sh -c "CMD"`, as ssh would
# run it through a shell).  The orteds call back to mpirun over the shaped
# links (oob), and the MPI data goes over eth0 (btl tcp), i.e. through the
# tbf qdisc of every node.
#
# Every orted thinks it has a node (all of this host's cores) to itself, so
# two of Open MPI's automatic choices would go wrong when the "nodes" are
# namespaces of one host:
#   --bind-to none              otherwise every orted binds its rank to core 0:
#                               all W ranks on one core;
#   --mca mpi_yield_when_idle 1 (only when W > cores) otherwise every rank
#                               busy-polls as on a dedicated node; with more
#                               ranks than cores a waiting rank then burns the
#                               time slice its sender needs (64 KiB allreduce,
#                               W=4 on 2 cores: ~13 ms instead of ~0.3 ms).
#                               It is what Open MPI itself does when it knows
#                               a node is oversubscribed (the local W=4 runs).
#
# Needs root (ip netns exec), like gradwire launch --netns itself.  Creates
# nothing: the namespaces belong to gradwire launch, which removes them.
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

die() { echo "mpi_netns.sh: $*" >&2; exit 1; }

ns_addr() {  # ns_addr NS -> IPv4 address of eth0 in NS
    ip -n "$1" -4 -o addr show dev eth0 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'
}

if [ "${1:-}" = "--agent" ]; then
    # rsh-agent mode: mpi_netns.sh --agent HOST CMD...
    shift
    host=${1:-}; shift || true
    [ -n "${GW_MPI_NETNS_PREFIX:-}" ] || die "--agent: GW_MPI_NETNS_PREFIX not set"
    [ -n "$host" ] || die "--agent: no host"
    for ns in $(ip netns list | awk '{ print $1 }' | grep -E "^${GW_MPI_NETNS_PREFIX}[0-9]+\$"); do
        if [ "$(ns_addr "$ns")" = "$host" ]; then
            exec ip netns exec "$ns" sh -c "$*"
        fi
    done
    die "--agent: no namespace ${GW_MPI_NETNS_PREFIX}* owns $host"
fi

MPI_EXTRA=""
while [ $# -gt 0 ]; do
    case "$1" in
        --mpi-args) MPI_EXTRA=$2; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || die "usage: mpi_netns.sh [--mpi-args ARGS] -- PROGRAM ARGS..."

: "${RANK:?mpi_netns.sh: RANK not set (start it with gradwire launch --netns)}"
: "${WORLD_SIZE:?mpi_netns.sh: WORLD_SIZE not set}"
[ "${LOCAL_WORLD_SIZE:-1}" = 1 ] || die "needs 1 rank per namespace (got LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE)"
[ "$RANK" = 0 ] || exit 0

me=$(ip netns identify $$ 2>/dev/null)
[ -n "$me" ] || die "not inside a named network namespace (run under gradwire launch --netns)"
[[ "$me" =~ ^(.*n)0$ ]] || die "unexpected namespace name '$me' (expected ...n0)"
prefix=${BASH_REMATCH[1]}
hosts=()
for i in $(seq 0 $((WORLD_SIZE - 1))); do
    a=$(ns_addr "$prefix$i")
    [ -n "$a" ] || die "namespace $prefix$i has no eth0 address"
    hosts+=("$a")
done
export GW_MPI_NETNS_PREFIX=$prefix
host_list=$(IFS=,; echo "${hosts[*]}")
# shellcheck disable=SC2054  # the commas are Open MPI's list syntax
cmd=("${MPIRUN:-mpirun}" --allow-run-as-root -np "$WORLD_SIZE" --host "$host_list" --bind-to none
     --mca plm_rsh_agent "$SELF --agent" --mca plm_rsh_no_tree_spawn 1
     --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include eth0
     --mca oob_tcp_if_include eth0)
if [ "$WORLD_SIZE" -gt "$(nproc)" ]; then
    cmd+=(--mca mpi_yield_when_idle 1)
fi
# shellcheck disable=SC2206
[ -n "$MPI_EXTRA" ] && cmd+=($MPI_EXTRA)
cmd+=("$@")
echo "mpi_netns.sh: namespaces ${prefix}0..$((WORLD_SIZE - 1)), hosts $host_list" >&2
echo "mpi_netns.sh: ${cmd[*]}" >&2
exec "${cmd[@]}"

#!/usr/bin/env bash
# mpi_netns.sh -- run a program under an MPI launcher across the network namespaces
# `gradwire launch --netns` creates, with no gradwire variable in the ranks' environment:
#
#   gradwire launch -n NODES --netns --bind none -- tests/launchers/mpi_netns.sh LAUNCHER PER_NODE PROGRAM ARGS...
#
# LAUNCHER is `hydra` (MPICH's mpiexec, the one `pip install mpich` brings: its ranks get a
# PMI-1 connection, PMI_FD) or `openmpi` (Debian's Open MPI mpirun: PMIx). gradwire launch
# only makes the "nodes" and starts this script once per namespace; every copy but node
# 0's exits at once. Node 0 drops what gradwire launch exported (RANK, MASTER_ADDR,
# GRADWIRE_JOB_SECRET, ...) and becomes the launcher, PER_NODE ranks on each node's eth0
# address; for the other nodes the launcher calls this script as its rsh agent
# (`mpi_netns.sh [OPTIONS] HOST CMD...` with GW_MPI_NETNS_PREFIX set), which runs the
# launcher's daemon in the namespace that owns HOST, as ssh would on a real node.
set -uo pipefail
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
die() { echo "mpi_netns.sh: $*" >&2; exit 1; }
ns_addr() { ip -n "$1" -4 -o addr show dev eth0 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'; }

if [ -n "${GW_MPI_NETNS_PREFIX:-}" ]; then
    while [ "${1:-}" != "${1#-}" ]; do shift; done  # an rsh agent's own options, if any
    host=${1:?agent: no host}; shift
    for ns in $(ip netns list | awk '{ print $1 }' | grep -E "^${GW_MPI_NETNS_PREFIX:?}[0-9]+\$"); do
        [ "$(ns_addr "$ns")" = "$host" ] && exec ip netns exec "$ns" sh -c "$*"
    done
    die "agent: no namespace ${GW_MPI_NETNS_PREFIX}* owns $host"
fi

launcher=${1:?usage: mpi_netns.sh hydra|openmpi PER_NODE PROGRAM ARGS...}; shift
per_node=${1:?usage: mpi_netns.sh hydra|openmpi PER_NODE PROGRAM ARGS...}; shift
[ "${RANK:?start it with gradwire launch --netns}" = 0 ] || exit 0
me=$(ip netns identify $$ 2>/dev/null)
[[ "$me" =~ ^(.*n)0$ ]] || die "not in namespace ...n0 of gradwire launch --netns (in '$me')"
prefix=${BASH_REMATCH[1]}
hosts=()
for i in $(seq 0 $((WORLD_SIZE - 1))); do
    hosts+=("$(ns_addr "$prefix$i"):$per_node")
done
host_list=$(IFS=,; echo "${hosts[*]}")
n=$((WORLD_SIZE * per_node))
clean=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT
    -u GRADWIRE_JOB_SECRET GW_MPI_NETNS_PREFIX="$prefix")
case "$launcher" in
hydra)
    # Hydra's mpiexec: pip's mpich, else Debian's (Open MPI's may own the name mpiexec).
    mpiexec=
    for m in mpiexec mpiexec.hydra; do
        case "$("$m" --version 2>/dev/null)" in *HYDRA*) mpiexec=$m; break ;; esac
    done
    [ -n "$mpiexec" ] || die "no Hydra mpiexec (pip install mpich)"
    echo "mpi_netns.sh: $mpiexec -n $n -hosts $host_list $*" >&2
    exec "${clean[@]}" "$mpiexec" -n $n -hosts "$host_list" -launcher rsh -launcher-exec "$SELF" -iface eth0 "$@" ;;
openmpi)
    # Every namespace has all of the host's cores: no binding, and oversubscription allowed.
    # Every namespace also has the host's name, so Open MPI's own messages (an MPI program's)
    # go over tcp on eth0 only: its shared-memory transport would pair ranks of different
    # "nodes". The daemons reach mpirun over eth0; PYTHONPATH and GRADWIRE_LIB go to every
    # rank (-x), as a job script exports them on a cluster.
    echo "mpi_netns.sh: mpirun -np $n --host $host_list $*" >&2
    exec "${clean[@]}" mpiexec.openmpi --allow-run-as-root -np $n --host "$host_list" --bind-to none --oversubscribe \
        --mca plm_rsh_agent "$SELF" --mca plm_rsh_no_tree_spawn 1 --mca oob_tcp_if_include eth0 \
        --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include eth0 -x PYTHONPATH -x GRADWIRE_LIB "$@" ;;
*) die "unknown launcher $launcher (hydra or openmpi)" ;;
esac

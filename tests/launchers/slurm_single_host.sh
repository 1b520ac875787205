#!/usr/bin/env bash
# slurm_single_host.sh -- a Slurm cluster of one node on this host (Debian's slurmctld and
# slurmd, no munge: auth/none), for as long as a command runs:
#
#   tests/launchers/slurm_single_host.sh CPUS COMMAND ARGS...
#
# The controller and the node daemon run in the foreground of this script, with their
# configuration, state and logs in a fresh directory, on free ports; COMMAND runs with
# SLURM_CONF pointing at that configuration (so `srun -n 4 ...` inside it runs on this
# node, which claims CPUS CPUs). Both daemons stop and the directory goes when COMMAND
# ends, also when it fails or this script is killed. Needs root (slurmd starts tasks as
# their user). The daemons' logs are printed when COMMAND fails.
set -uo pipefail
die() { echo "slurm_single_host.sh: $*" >&2; exit 1; }
cpus=${1:?usage: slurm_single_host.sh CPUS COMMAND ARGS...}; shift
[ $# -gt 0 ] || die "no command"
for d in slurmctld slurmd srun sinfo; do command -v $d >/dev/null || die "no $d (Debian: slurmctld slurmd slurm-client)"; done

dir=$(mktemp -d /tmp/gw-slurm.XXXXXX)
pids=()
finish() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    rm -rf "$dir"
}
trap finish EXIT
trap 'exit 143' TERM INT
read -r ctld_port slurmd_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<CONF
ClusterName=gwtest
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdParameters=config_overrides
NodeName=gwnode NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=gwnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -D -i >"$dir/slurmctld.out" 2>&1 & pids+=($!)
slurmd -D -N gwnode >"$dir/slurmd.out" 2>&1 & pids+=($!)
for _ in $(seq 300); do
    [ "$(sinfo -h -o %t 2>/dev/null)" = idle ] && break
    sleep 0.1
done
[ "$(sinfo -h -o %t 2>/dev/null)" = idle ] || { cat "$dir"/*.out "$dir"/*.log >&2; die "the node did not come up within 30 s"; }
"$@"
rc=$?
[ $rc = 0 ] || { echo "slurm_single_host.sh: '$*' failed ($rc); the daemons' logs:" >&2; tail -n 30 "$dir"/*.log >&2; }
exit $rc

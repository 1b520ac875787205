# shellcheck shell=bash
# benches/lib.sh -- what benches/compare.sh and benches/collectives.sh share: sourced by
# both after they set PROG (the name in messages), ROOT, and before use PYTHON, GW,
# DO_BUILD, RESULTS, META (the meta TSV), RUNS (the runs TSV), OUTER_TIMEOUT, KILL_AFTER
# and ORIG_CMD; they keep LAUNCHER_PIDS, CUR_PID and CUR_PIDF as their runs go.

log() { printf '[%s %s] %s\n' "$PROG" "$(date +%H:%M:%S)" "$*" >&2; }

# The mode of a benchmark script that keeps what it measures in benches/results/NAME/:
# `kept_run NAME "${1:-}"` sets mode ("", --record or --report), kept (that directory), tmp
# (a directory removed at exit) and raw (where the run's outputs go and the report reads
# them: tmp without a mode, kept with one).
kept_run() {
    mode=$2
    case "$mode" in ""|--record|--report) ;; *) echo "usage: $0 [--record|--report]" >&2; exit 2 ;; esac
    kept=benches/results/$1
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    raw=$tmp
    if [ -n "$mode" ]; then raw=$kept; fi
}

# Open MPI's commands by their Debian names where they exist: another MPI may own `mpirun`
# and `mpicc` on PATH (the PyPI mpich wheel the Heat comparison installs does).
openmpi_commands() {
    MPIRUN=$(command -v mpirun.openmpi || command -v mpirun || echo mpirun)
    MPICC=$(command -v mpicc.openmpi || command -v mpicc || echo mpicc)
    export MPIRUN
}
openmpi_commands

to_bytes() {  # 4K -> 4096
    local s=$1 n m=1
    case "$s" in
        *[kK]) m=1024; n=${s%?} ;;
        *[mM]) m=$((1024 * 1024)); n=${s%?} ;;
        *[gG]) m=$((1024 * 1024 * 1024)); n=${s%?} ;;
        *) n=$s ;;
    esac
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "$PROG.sh: bad size '$s'" >&2; exit 2; }
    echo $((n * m))
}

meta() { printf '%s\t%s\n' "$1" "$(printf '%s' "$2" | tr '\t\n' '  ')" >>"$META"; }

machine_meta() {  # the command, the date, the machine and its load, into META
    meta command "$ORIG_CMD"
    meta date "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    meta uname_r "$(uname -r)"
    meta nproc "$(nproc)"
    meta cpu_model "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    meta mem_total "$(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    meta loadavg_start "$(cut -d' ' -f1-3 /proc/loadavg)"
    # A busy machine skews everything (blocking waits pay scheduler latency,
    # busy-polling ranks fight the other load): warn loudly, in the output too.
    local load1
    load1=$(cut -d' ' -f1 /proc/loadavg)
    if awk -v l="$load1" -v n="$(nproc)" 'BEGIN { exit !(l > 0.5 * n) }'; then
        log "WARNING: load average $load1 on $(nproc) cores: results will be noisy; run on an idle machine"
        meta load_warning "1-minute load average was $load1 on $(nproc) cores when the run started: other work was competing for the CPUs, so these numbers are not representative"
    fi
}

torch_ok() {
    "$PYTHON" -c 'import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()' \
        >/dev/null 2>&1
}

netns_sweep() {  # netns_sweep PID...: what a dead launcher of ours left behind
    local pid ns i left
    for pid in "$@"; do
        [ -n "$pid" ] || continue
        kill -0 "$pid" 2>/dev/null && continue   # still running: it cleans up itself
        left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^gw${pid}n[0-9]+\$")
        for ns in $left; do
            i=${ns##*n}
            ip link del "gw${pid}h$i" 2>/dev/null
            ip netns del "$ns" 2>/dev/null && log "removed namespace $ns left by launcher $pid"
        done
        ip link del "gwb$pid" 2>/dev/null && log "removed bridge gwb$pid left by launcher $pid"
    done
}

cleanup() {
    if [ ${#LAUNCHER_PIDS[@]} -gt 0 ]; then
        sleep 0.5   # a launcher stopped by the same signal may still be cleaning up
        netns_sweep "${LAUNCHER_PIDS[@]}"
    fi
}

on_signal() {
    log "interrupted: stopping the current run"
    if [ -n "$CUR_PID" ]; then
        kill -TERM "$CUR_PID" 2>/dev/null
        wait "$CUR_PID" 2>/dev/null
        [ -n "$CUR_PIDF" ] && [ -s "$CUR_PIDF" ] && LAUNCHER_PIDS+=("$(cat "$CUR_PIDF")")
    fi
    exit 130
}

# shellcheck disable=SC2034  # GW_STATUS is the caller's
gradwire_status() {  # sets GW_STATUS: ok, or why $GW cannot run (built first when DO_BUILD=1)
    GW_STATUS=ok
    if [ "$DO_BUILD" = 1 ]; then
        log "cargo build --release"
        if ! (cd "$ROOT" && cargo build --release) >"$RESULTS/logs/cargo_build.log" 2>&1; then
            GW_STATUS="n/a (cargo build --release failed)"
            return
        fi
    fi
    if [ ! -x "$GW" ]; then
        GW_STATUS="n/a (no gradwire binary at $GW)"
    elif [[ "$("$GW" bench allreduce --help 2>&1)" != *--csv* ]] ||
         [[ "$("$GW" launch --help 2>&1)" != *--timeout* ]]; then
        GW_STATUS="n/a (gradwire has no 'launch --timeout' / 'bench --csv')"
    fi
}

# run_timed TAG NETNS CMD...: runs CMD, its last word replaced by TAG's CSV path, under the
# per-launch timeout ($OUTER_TIMEOUT, then SIGKILL after $KILL_AFTER), its output in TAG's
# log; NETNS=1 sweeps what its launcher, if it died, left behind. In the background + wait,
# so that a signal to the script is handled at once (on_signal stops the run; `timeout`
# forwards SIGTERM to the launcher, which stops its ranks and removes its namespaces).
# Sets RUN_CSV, RUN_LOG, RUN_RC, RUN_MS and RUN_CMD (the command as run).
run_timed() {
    local tag=$1 netns=$2; shift 2
    RUN_CSV="$RESULTS/csv/$tag.csv"
    RUN_LOG="$RESULTS/logs/$tag.log"
    local pidf="$RESULTS/logs/$tag.pid" t0 pid
    CUR_PIDF=$pidf
    RUN_CMD=("$@")
    RUN_CMD[${#RUN_CMD[@]}-1]=$RUN_CSV
    log "run $tag"
    t0=$(date +%s%N)
    # shellcheck disable=SC2016  # $$ and $@ belong to the inner shell
    timeout --kill-after="$KILL_AFTER" "$OUTER_TIMEOUT" \
        bash -c 'echo $$ >"$0"; exec "$@"' "$pidf" "${RUN_CMD[@]}" >"$RUN_LOG" 2>&1 </dev/null &
    CUR_PID=$!
    wait "$CUR_PID"
    RUN_RC=$?
    CUR_PID=""
    RUN_MS=$(( ($(date +%s%N) - t0) / 1000000 ))
    pid=$(cat "$pidf" 2>/dev/null); rm -f "$pidf"
    if [ "$netns" = 1 ] && [ -n "$pid" ]; then
        LAUNCHER_PIDS+=("$pid")
        netns_sweep "$pid"
    fi
}

failure_status() {  # why the last run_timed failed: its timeout, a signal or its exit status
    if [ "$RUN_RC" -eq 124 ] || { [ "$RUN_RC" -eq 137 ] && [ $((RUN_MS / 1000)) -ge "$OUTER_TIMEOUT" ]; }; then
        echo "timeout after ${OUTER_TIMEOUT}s"
    elif [ "$RUN_RC" -gt 128 ]; then
        echo "killed by signal $((RUN_RC - 128))"
    else
        echo "failed (exit $RUN_RC)"
    fi
}

record_run() {  # record_run FIELD...: a row of RUNS, the run's seconds and command after the fields
    local shown="${RUN_CMD[*]}"
    shown=${shown//"$ROOT/"/}
    printf '%s\t' "$@" >>"$RUNS"
    printf '%d.%d\t%s\n' $((RUN_MS / 1000)) $((RUN_MS % 1000 / 100)) "$shown" >>"$RUNS"
}

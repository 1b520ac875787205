#!/usr/bin/env bash
# benches/compare.sh -- side-by-side allreduce benchmark: gradwire vs Open MPI
# vs Gloo (torch.distributed), same sizes, same machine, one run; writes
# BENCHMARKS.md at the repository root.
#
#   benches/compare.sh                  # full run: 4K..256M x4, W=2,4, shm+tcp, 3 repeats
#   benches/compare.sh --quick          # smoke test: 4K..4M, 1 repeat
#   benches/compare.sh --help           # all options
#
# What it does (idempotent, safe to re-run):
#   1. installs Open MPI from Debian if mpicc/mpirun are missing (apt-get);
#      torch only with --install-torch (else the Gloo columns read
#      "n/a (torch not importable)");
#   2. builds gradwire (cargo build --release) and the peers
#      (benches/peers/*.c) into target/peers/;
#   3. measures the machine's single-thread copy bandwidth (copybw);
#   4. for each repeat, for W in RANKS, for transport in shm tcp: runs
#      gradwire, then Open MPI, then (once per W and repeat) Gloo, all with the
#      same -b/-e/-f/-n/-w; every run is wrapped in `timeout`;
#   5. benches/peers/merge.py takes the median busbw per cell across repeats
#      and writes the markdown.
# Raw CSVs, logs and the run list stay in target/peers/results/.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS="$ROOT/benches/peers"
BUILD="$ROOT/target/peers"
RESULTS="$BUILD/results"
# GRADWIRE_BIN: override the binary (testing the script with a stand-in)
GW="${GRADWIRE_BIN:-$ROOT/target/release/gradwire}"

# ---- defaults -------------------------------------------------------------
MIN=4K MAX=256M FACTOR=4 ITERS=20 WARMUP=5 REPEATS=3
RANKS="2 4"
TRANSPORTS="shm tcp"
TOOLS="gradwire mpi gloo"
OUT="$ROOT/BENCHMARKS.md"
RUN_TIMEOUT=""          # seconds per launch; default depends on MAX
INSTALL_TORCH=0
DO_BUILD=1
DO_INSTALL=1
MPI_EXTRA=""
MPI_PLACE="--inplace"   # gradwire's bench and Gloo allreduce in place; so does MPI by default
PYTHON="${PYTHON:-python3}"   # the interpreter that has torch (Gloo) and runs merge.py

usage() {
    cat <<EOF
usage: benches/compare.sh [options]
  --quick               sizes 4K..4M, 1 repeat (smoke test; same as -e 4M --repeats 1)
  -b, --min SIZE        smallest message in bytes, K/M/G suffixes (default $MIN)
  -e, --max SIZE        largest message (default $MAX)
  -f, --factor F        size multiplier (default $FACTOR)
  -n, --iters N         timed iterations per size (default $ITERS)
  -w, --warmup N        untimed warmup iterations per size (default $WARMUP)
  --repeats R           whole-sweep repeats; BENCHMARKS.md shows the median (default $REPEATS)
  --ranks "2 4"         world sizes (default "$RANKS")
  --transports "shm tcp"  gradwire/MPI transports (default "$TRANSPORTS"; Gloo is always TCP)
  --tools "gradwire mpi gloo"  subset of tools to run (default all)
  --timeout S           per-launch time limit in seconds (default 120, or 600 if MAX > 16M)
  --mpi-args "ARGS"     extra mpirun arguments (recorded in the output)
  --mpi-out-of-place    MPI_Allreduce with separate send/recv buffers (default: MPI_IN_PLACE,
                        like gradwire's bench and Gloo)
  --out FILE            markdown output (default BENCHMARKS.md at the repo root)
  --install-torch       pip-install a torch that imports on this CPU-only machine if missing
  --no-build            do not run cargo build --release (use the existing binary)
  --no-install          never run apt-get/pip
  -h, --help            this text
environment:
  PYTHON=python3        interpreter with torch (Gloo runs, torch install, merge.py)
  GRADWIRE_BIN=PATH     use this gradwire binary instead of target/release/gradwire
EOF
}

ORIG_CMD="benches/compare.sh"
for a in "$@"; do ORIG_CMD+=" $(printf '%q' "$a")"; done

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) MAX=4M; REPEATS=1 ;;
        -b|--min) MIN=$2; shift ;;
        -e|--max) MAX=$2; shift ;;
        -f|--factor) FACTOR=$2; shift ;;
        -n|--iters) ITERS=$2; shift ;;
        -w|--warmup) WARMUP=$2; shift ;;
        --repeats) REPEATS=$2; shift ;;
        --ranks) RANKS=$2; shift ;;
        --transports) TRANSPORTS=$2; shift ;;
        --tools) TOOLS=$2; shift ;;
        --timeout) RUN_TIMEOUT=$2; shift ;;
        --mpi-args) MPI_EXTRA=$2; shift ;;
        --mpi-out-of-place) MPI_PLACE="" ;;
        --out) OUT=$2; shift ;;
        --install-torch) INSTALL_TORCH=1 ;;
        --no-build) DO_BUILD=0 ;;
        --no-install) DO_INSTALL=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "compare.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

to_bytes() {  # 4K -> 4096
    local s=$1 n m=1
    case "$s" in
        *[kK]) m=1024; n=${s%?} ;;
        *[mM]) m=$((1024 * 1024)); n=${s%?} ;;
        *[gG]) m=$((1024 * 1024 * 1024)); n=${s%?} ;;
        *) n=$s ;;
    esac
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "compare.sh: bad size '$s'" >&2; exit 2; }
    echo $((n * m))
}
MIN_B=$(to_bytes "$MIN"); MAX_B=$(to_bytes "$MAX")
for v in "$FACTOR" "$ITERS" "$WARMUP" "$REPEATS"; do
    [[ "$v" =~ ^[0-9]+$ ]] || { echo "compare.sh: '$v' is not a number" >&2; exit 2; }
done
if [ "$REPEATS" -lt 1 ] || [ "$FACTOR" -lt 2 ] || [ "$MAX_B" -lt "$MIN_B" ]; then
    echo "compare.sh: bad parameters" >&2; exit 2
fi
if [ -z "$RUN_TIMEOUT" ]; then
    if [ "$MAX_B" -gt $((16 * 1024 * 1024)) ]; then RUN_TIMEOUT=600; else RUN_TIMEOUT=120; fi
fi
has_tool() { [[ " $TOOLS " == *" $1 "* ]]; }

log() { printf '[compare %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

mkdir -p "$BUILD"
rm -rf "$RESULTS"
mkdir -p "$RESULTS/logs" "$RESULTS/csv"
META="$RESULTS/meta.tsv"
RUNS="$RESULTS/runs.tsv"
: >"$META"
printf 'tool\tworld\ttransport\trepeat\tstatus\tcsv\tseconds\tcommand\n' >"$RUNS"
meta() { printf '%s\t%s\n' "$1" "$(printf '%s' "$2" | tr '\t\n' '  ')" >>"$META"; }

meta command "$ORIG_CMD"
meta date "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
meta uname_r "$(uname -r)"
meta nproc "$(nproc)"
meta cpu_model "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
meta mem_total "$(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
meta loadavg_start "$(cut -d' ' -f1-3 /proc/loadavg)"
# A busy machine skews everything (blocking waits pay scheduler latency,
# busy-polling ranks fight the other load): warn loudly, in the output too.
LOAD1=$(cut -d' ' -f1 /proc/loadavg)
if awk -v l="$LOAD1" -v n="$(nproc)" 'BEGIN { exit !(l > 0.5 * n) }'; then
    log "WARNING: load average $LOAD1 on $(nproc) cores: results will be noisy; run on an idle machine"
    meta load_warning "1-minute load average was $LOAD1 on $(nproc) cores when the run started: other work was competing for the CPUs, so these numbers are not representative"
fi
meta params "-b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP, repeats $REPEATS, W in {$RANKS}, transports {$TRANSPORTS}, per-launch timeout ${RUN_TIMEOUT}s"
meta repeats "$REPEATS"
meta ranks "$RANKS"
meta transports "$TRANSPORTS"
meta tools "$TOOLS"
meta mpi_place "$([ -n "$MPI_PLACE" ] && echo in-place || echo out-of-place)"

# ---- 1. dependencies --------------------------------------------------------
if has_tool mpi && ! { command -v mpicc && command -v mpirun; } >/dev/null 2>&1; then
    if [ "$DO_INSTALL" = 1 ]; then
        log "installing Open MPI (apt-get install -y openmpi-bin libopenmpi-dev)"
        apt-get update -qq >"$RESULTS/logs/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev \
            >>"$RESULTS/logs/apt.log" 2>&1 || log "apt-get install failed, see $RESULTS/logs/apt.log"
    else
        log "mpicc/mpirun missing and --no-install given"
    fi
fi

torch_ok() {
    "$PYTHON" -c 'import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()' \
        >/dev/null 2>&1
}
if has_tool gloo && ! torch_ok && [ "$INSTALL_TORCH" = 1 ] && [ "$DO_INSTALL" = 1 ]; then
    log "installing torch (~2 GB download; log: $RESULTS/logs/install_torch.log)"
    "$PYTHON" "$PEERS/install_torch.py" >"$RESULTS/logs/install_torch.log" 2>&1 ||
        log "torch install failed, see $RESULTS/logs/install_torch.log"
fi

# ---- 2. builds ---------------------------------------------------------------
GW_STATUS=ok
if has_tool gradwire; then
    if [ "$DO_BUILD" = 1 ]; then
        log "cargo build --release"
        if ! (cd "$ROOT" && cargo build --release) >"$RESULTS/logs/cargo_build.log" 2>&1; then
            GW_STATUS="n/a (cargo build --release failed)"
        fi
    fi
    if [ "$GW_STATUS" = ok ]; then
        if [ ! -x "$GW" ]; then
            GW_STATUS="n/a (no target/release/gradwire)"
        elif [[ "$("$GW" bench allreduce --help 2>&1)" != *--csv* ]] ||
             [[ "$("$GW" launch --help 2>&1)" != *--timeout* ]]; then
            GW_STATUS="n/a (gradwire has no 'launch' / 'bench allreduce --csv' yet)"
        fi
    fi
else
    GW_STATUS="not run (--tools)"
fi
# `gradwire launch` also starts the Gloo ranks, when it exists.
LAUNCH_OK=0
if [ -x "$GW" ] && [[ "$("$GW" launch --help 2>&1)" == *--timeout* ]]; then LAUNCH_OK=1; fi
GW_OK=0; [ "$GW_STATUS" = ok ] && GW_OK=1
[ -n "${GRADWIRE_BIN:-}" ] && GW_STATUS+=" (GRADWIRE_BIN=$GRADWIRE_BIN)"
meta gradwire_status "$GW_STATUS"
meta gradwire_rev "$(cd "$ROOT" && { git rev-parse --short HEAD 2>/dev/null || echo 'no commit'; }) ($(cd "$ROOT" && git status --porcelain 2>/dev/null | grep -c .) uncommitted paths)"
meta rustc "$(rustc --version 2>/dev/null || echo '?')"

MPI_STATUS=ok
if ! has_tool mpi; then
    MPI_STATUS="not run (--tools)"
elif ! command -v mpicc >/dev/null 2>&1; then
    MPI_STATUS="n/a (mpicc not installed)"
elif ! mpicc -O2 -o "$BUILD/mpi_allreduce" "$PEERS/mpi_allreduce.c" >"$RESULTS/logs/mpicc.log" 2>&1; then
    MPI_STATUS="n/a (mpicc failed)"
fi
meta mpi_status "$MPI_STATUS"
meta mpi_version "$(mpirun --version 2>/dev/null | head -1)"

GLOO_STATUS=ok
if ! has_tool gloo; then
    GLOO_STATUS="not run (--tools)"
elif ! torch_ok; then
    GLOO_STATUS="n/a (torch not importable)"
fi
meta gloo_status "$GLOO_STATUS"
meta torch_version "$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')"
meta python_version "$("$PYTHON" --version 2>&1)"

# Gloo is started by `gradwire launch` (torchrun-style env); until that exists,
# by torch's own launcher (torchrun) so the Gloo columns still fill in.
if [ "$LAUNCH_OK" = 1 ]; then
    GLOO_LAUNCHER="gradwire launch"
else
    GLOO_LAUNCHER="torchrun (gradwire launch unavailable)"
fi
meta gloo_launcher "$GLOO_LAUNCHER"

# ---- 3. machine copy bandwidth, loopback wake-up latency ------------------------
if gcc -O3 -o "$BUILD/copybw" "$PEERS/copybw.c" >"$RESULTS/logs/copybw_build.log" 2>&1; then
    log "measuring copy bandwidth (256 MiB, best of 7)"
    meta copybw "$("$BUILD/copybw" -H | tr '\n' ';')"
else
    meta copybw "n/a (gcc failed)"
fi
if gcc -O2 -o "$BUILD/pingpong" "$PEERS/pingpong.c" >"$RESULTS/logs/pingpong_build.log" 2>&1; then
    meta pingpong "$("$BUILD/pingpong" -H 5000 | tr '\n' ';')"
else
    meta pingpong "n/a (gcc failed)"
fi

# ---- 4. runs -----------------------------------------------------------------
BENCH_ARGS=(-b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP")
KILL_AFTER=10
OUTER_TIMEOUT=$((RUN_TIMEOUT + 30))

# run_one TOOL W TRANSPORT REPEAT CMD...   (CMD must write the CSV itself)
run_one() {
    local tool=$1 w=$2 tr=$3 rep=$4; shift 4
    local tag="${tool}_w${w}_${tr}_r${rep}"
    local csv="$RESULTS/csv/$tag.csv" logf="$RESULTS/logs/$tag.log"
    local cmd=("$@") status t0 t1 rc
    # the CSV path is the last argument of every command
    cmd[${#cmd[@]}-1]=$csv
    log "run $tag"
    t0=$(date +%s%N)
    timeout --kill-after=$KILL_AFTER "$OUTER_TIMEOUT" "${cmd[@]}" >"$logf" 2>&1
    rc=$?
    t1=$(date +%s%N)
    if [ $rc -eq 0 ] && [ -s "$csv" ]; then
        status=ok
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="timeout after ${OUTER_TIMEOUT}s"
    else
        status="failed (exit $rc)"
    fi
    [ "$status" = ok ] || log "  $tag: $status (log: $logf)"
    local shown="${cmd[*]}"
    shown=${shown//"$ROOT/"/}
    local ms=$(( (t1 - t0) / 1000000 ))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%d.%d\t%s\n' "$tool" "$w" "$tr" "$rep" "$status" \
        "$csv" $((ms / 1000)) $((ms % 1000 / 100)) "$shown" >>"$RUNS"
}

record_na() {  # record_na TOOL W TRANSPORT REPEAT STATUS
    printf '%s\t%s\t%s\t%s\t%s\t\t0\t\n' "$@" >>"$RUNS"
}

NPROC=$(nproc)
for rep in $(seq 1 "$REPEATS"); do
    for w in $RANKS; do
        for tr in $TRANSPORTS; do
            if [ "$GW_OK" = 1 ]; then
                run_one gradwire "$w" "$tr" "$rep" \
                    "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                    "$GW" bench allreduce "${BENCH_ARGS[@]}" -d float32 -o sum \
                    --transport "$tr" --check --csv CSV
            else
                record_na gradwire "$w" "$tr" "$rep" "$GW_STATUS"
            fi

            if [ "$MPI_STATUS" = ok ]; then
                case "$tr" in
                    shm) btl=(--mca btl "self,vader") ;;
                    tcp) btl=(--mca btl "self,tcp" --mca btl_tcp_if_include lo) ;;
                    *) btl=() ;;
                esac
                # pml ob1 so the btl choice is honoured (the ucx pml would bypass it).
                # shellcheck disable=SC2086
                run_one mpi "$w" "$tr" "$rep" \
                    mpirun --allow-run-as-root --oversubscribe -np "$w" \
                    --mca pml ob1 "${btl[@]}" $MPI_EXTRA \
                    "$BUILD/mpi_allreduce" "${BENCH_ARGS[@]}" -d float32 -o sum \
                    $MPI_PLACE --csv CSV
            else
                record_na mpi "$w" "$tr" "$rep" "$MPI_STATUS"
            fi
        done

        # Gloo: TCP only, run once per (W, repeat), shown beside every transport.
        if [ "$GLOO_STATUS" = ok ]; then
            if [ "$LAUNCH_OK" = 1 ]; then
                launcher=("$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" --)
            else
                launcher=("$PYTHON" -m torch.distributed.run --standalone --no-python --nproc-per-node "$w")
            fi
            run_one gloo "$w" tcp "$rep" \
                env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 "${launcher[@]}" \
                "$PYTHON" "$PEERS/gloo_allreduce.py" "${BENCH_ARGS[@]}" -d float32 -o sum --csv CSV
        else
            record_na gloo "$w" tcp "$rep" "$GLOO_STATUS"
        fi
    done
done
meta loadavg_end "$(cut -d' ' -f1-3 /proc/loadavg)"
[ "$NPROC" -gt 0 ] && meta oversubscribed_when "W > $NPROC"

# ---- 5. merge -------------------------------------------------------------------
"$PYTHON" "$PEERS/merge.py" --results "$RESULTS" --out "$OUT" || { log "merge.py failed"; exit 1; }
log "wrote $OUT (raw data: $RESULTS)"

#!/usr/bin/env bash
# benches/collectives.sh -- every collective of `gradwire bench` against Open MPI and
# Gloo (torch.distributed), same sizes, same machine, one run; writes a markdown report
# (default target/peers/collectives.md): one table per collective and a "Goals" table
# judged from this run's medians.  The sibling of benches/compare.sh (allreduce only);
# same conventions.
#
#   benches/collectives.sh                   # full run: all parts, 3 repeats
#   benches/collectives.sh --quick           # smoke test: local/torch up to 16M,
#                                            # netns 16M only, 1 repeat
#   benches/collectives.sh --parts local --colls "allgather broadcast" --ranks 2
#   benches/collectives.sh --help            # all options
#
# Collectives (--colls, default "allreduce reduce_scatter allgather broadcast alltoall
# reduce"), float32, sum, sizes as `gradwire bench` (and nccl-tests) count them: the whole
# buffer -- reduce_scatter's total input, allgather's total output, alltoall's total input
# of one rank; busbw = algbw x 2(W-1)/W (allreduce), (W-1)/W (reduce_scatter, allgather,
# alltoall), 1 (broadcast, reduce).  Peers: benches/peers/mpi_collectives.c (-c COLL) and
# benches/peers/gloo_collectives.py (-c COLL); a collective a tool lacks is recorded as
# "n/a (...)" -- `gradwire bench` without it ("unknown collective") or Gloo without it
# (the peer's `gw-na:` line) -- and the run goes on.
#
# Parts (--parts, default "local netns torch"):
#   local   one host, W in --ranks: gradwire (`gradwire launch -n W gradwire bench COLL
#           --transport shm --buffers B --check`), Open MPI over its shared-memory BTL
#           (--mca pml ob1 --mca btl self,vader, as compare.sh), Gloo over TCP loopback;
#           sizes -b..-e (1M..64M, x4); plus, for allgather, alltoall, broadcast and
#           reduce_scatter, the one-copy ceiling (benches/peers/thread_copies.c: W
#           threads of one process copying, or reducing, every output byte once,
#           straight from its inputs): gradwire's busbw is also reported as a fraction
#           of it, and the goals say where the ceiling itself is below the goal
#   netns   --netns-ranks (4) ranks, one per network namespace, links shaped to
#           --netns-rate (10) Gbit/s (`gradwire launch --netns --link-gbit R`, needs
#           root): gradwire over TCP, Open MPI inside the same launch through
#           benches/peers/mpi_netns.sh, Gloo over eth0; sizes --netns-min..--netns-max
#           (16M..64M); plus the socket ceiling (benches/peers/tcpring.c, compare.sh's
#           bound part, for the same W and rate and sizes): each collective's busbw is
#           reported as a fraction of the ceiling at the same size
#   torch   W = --torch-ranks (2), one host: torch.distributed on gradwire's PyTorch
#           backend (benches/peers/torch_collectives.py: reduce_scatter_tensor,
#           all_gather_into_tensor, all_reduce; --torch-colls) against `gradwire bench`
#           of the same collective and sizes (-b..-e) in the same run
#
# What it does: installs Open MPI with apt-get if mpicc/mpirun are missing (not with
# --no-install); builds gradwire (cargo build --release; not with --no-build) and the
# peers into target/peers/; for each repeat runs every part, tools interleaved, every
# run wrapped in `timeout`; then benches/peers/merge_collectives.py takes the median per
# cell across repeats and writes the markdown (tables, goals, machine, exact commands).
# Raw CSVs, logs and the run list: target/peers/results-coll/.  Network namespaces are
# made and removed by `gradwire launch --netns`; should a launcher die without cleaning
# up, what its pid left is removed here (as compare.sh does).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS="$ROOT/benches/peers"
PROG=collectives
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
BUILD="$ROOT/target/peers"
RESULTS="$BUILD/results-coll"
GW="${GRADWIRE_BIN:-$ROOT/target/release/gradwire}"

# ---- defaults -------------------------------------------------------------
ALL_COLLS="allreduce reduce_scatter allgather broadcast alltoall reduce"
COLLS=$ALL_COLLS
MIN=1M MAX=64M FACTOR=4 ITERS=20 WARMUP=5 REPEATS=3
RANKS="2 4"
PARTS="local netns torch"
NETNS_RANKS=4 NETNS_RATE=10
NETNS_MIN=16M NETNS_MAX=64M NETNS_ITERS=5 NETNS_WARMUP=2
TORCH_RANKS=2
TORCH_COLLS="reduce_scatter allgather allreduce"
GW_BUFFERS=private
OUT="$ROOT/target/peers/collectives.md"
RUN_TIMEOUT=""
DO_BUILD=1
DO_INSTALL=1
MPI_EXTRA=""
PYTHON="${PYTHON:-python3}"

usage() {
    cat <<EOF
usage: benches/collectives.sh [options]
  --quick               smoke test: 1 repeat, local and torch sizes up to 16M, netns 16M only
  --parts "local netns torch"  which parts to run (default "$PARTS")
  --colls "..."         collectives of the local and netns parts
                        (default "$ALL_COLLS")
  --repeats R           repeats of every part, interleaved; tables show medians (default $REPEATS)
 local part (one host, W in --ranks) and torch part sizes:
  -b, --min SIZE        smallest size in bytes, K/M/G suffixes (default $MIN)
  -e, --max SIZE        largest size (default $MAX)
  -f, --factor F        size multiplier, all parts (default $FACTOR)
  -n, --iters N         timed iterations per size (default $ITERS)
  -w, --warmup N        untimed warmup iterations per size (default $WARMUP)
  --ranks "2 4"         world sizes of the local part (default "$RANKS")
  --buffers B           gradwire bench --buffers: private, shared, registered, mixed
                        (default $GW_BUFFERS)
 netns part (needs root; W namespaces, 1 rank each, links shaped with tc tbf):
  --netns-ranks W       (default $NETNS_RANKS)
  --netns-rate R        link rate in Gbit/s (default $NETNS_RATE)
  --netns-min SIZE      (default $NETNS_MIN)
  --netns-max SIZE      (default $NETNS_MAX)
  --netns-iters N       (default $NETNS_ITERS)
  --netns-warmup N      (default $NETNS_WARMUP)
 torch part (one host; gradwire's PyTorch backend vs gradwire bench):
  --torch-ranks W       (default $TORCH_RANKS)
  --torch-colls "..."   (default "$TORCH_COLLS")
  --timeout S           per-launch time limit in seconds (default 120, or 600 if a part's
                        largest size > 16M)
  --mpi-args "ARGS"     extra mpirun arguments (recorded in the output)
  --out FILE            markdown output (default target/peers/collectives.md)
  --no-build            do not run cargo build --release (use the existing binary)
  --no-install          never run apt-get
  -h, --help            this text
environment:
  PYTHON=python3        interpreter with torch (Gloo, torch part, merge)
  GRADWIRE_BIN=PATH     gradwire binary (default target/release/gradwire)
  GRADWIRE_LIB=PATH     libgradwire.so of the torch part (default: next to GRADWIRE_BIN,
                        else target/release/libgradwire.so)
EOF
}

ORIG_CMD="benches/collectives.sh"
for a in "$@"; do ORIG_CMD+=" $(printf '%q' "$a")"; done

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) MAX=16M; REPEATS=1; NETNS_MIN=16M; NETNS_MAX=16M ;;
        --parts) PARTS=$2; shift ;;
        --colls) COLLS=$2; shift ;;
        --repeats) REPEATS=$2; shift ;;
        -b|--min) MIN=$2; shift ;;
        -e|--max) MAX=$2; shift ;;
        -f|--factor) FACTOR=$2; shift ;;
        -n|--iters) ITERS=$2; shift ;;
        -w|--warmup) WARMUP=$2; shift ;;
        --ranks) RANKS=$2; shift ;;
        --buffers) GW_BUFFERS=$2; shift ;;
        --netns-ranks) NETNS_RANKS=$2; shift ;;
        --netns-rate) NETNS_RATE=$2; shift ;;
        --netns-min) NETNS_MIN=$2; shift ;;
        --netns-max) NETNS_MAX=$2; shift ;;
        --netns-iters) NETNS_ITERS=$2; shift ;;
        --netns-warmup) NETNS_WARMUP=$2; shift ;;
        --torch-ranks) TORCH_RANKS=$2; shift ;;
        --torch-colls) TORCH_COLLS=$2; shift ;;
        --timeout) RUN_TIMEOUT=$2; shift ;;
        --mpi-args) MPI_EXTRA=$2; shift ;;
        --out) OUT=$2; shift ;;
        --no-build) DO_BUILD=0 ;;
        --no-install) DO_INSTALL=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "collectives.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

MIN_B=$(to_bytes "$MIN") || exit 2
MAX_B=$(to_bytes "$MAX") || exit 2
NETNS_MIN_B=$(to_bytes "$NETNS_MIN") || exit 2
NETNS_MAX_B=$(to_bytes "$NETNS_MAX") || exit 2
for v in "$FACTOR" "$ITERS" "$WARMUP" "$REPEATS" "$NETNS_RANKS" "$NETNS_ITERS" \
         "$NETNS_WARMUP" "$TORCH_RANKS" $RANKS; do
    [[ "$v" =~ ^[0-9]+$ ]] || { echo "collectives.sh: '$v' is not a number" >&2; exit 2; }
done
[[ "$NETNS_RATE" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "collectives.sh: bad rate '$NETNS_RATE' (Gbit/s)" >&2; exit 2; }
for p in $PARTS; do
    case "$p" in local|netns|torch) ;; *) echo "collectives.sh: unknown part '$p' (local netns torch)" >&2; exit 2 ;; esac
done
for c in $COLLS $TORCH_COLLS; do
    case " $ALL_COLLS " in *" $c "*) ;; *) echo "collectives.sh: unknown collective '$c' ($ALL_COLLS)" >&2; exit 2 ;; esac
done
case "$GW_BUFFERS" in private|shared|registered|mixed) ;; *) echo "collectives.sh: bad --buffers '$GW_BUFFERS'" >&2; exit 2 ;; esac
if [ "$REPEATS" -lt 1 ] || [ "$FACTOR" -lt 2 ] || [ "$MAX_B" -lt "$MIN_B" ] ||
   [ "$NETNS_MAX_B" -lt "$NETNS_MIN_B" ] || [ "$NETNS_RANKS" -lt 2 ] || [ "$TORCH_RANKS" -lt 2 ] ||
   [ "$ITERS" -lt 1 ] || [ "$NETNS_ITERS" -lt 1 ] || [ -z "$COLLS" ]; then
    echo "collectives.sh: bad parameters" >&2; exit 2
fi
has_part() { [[ " $PARTS " == *" $1 "* ]]; }
if [ -z "$RUN_TIMEOUT" ]; then
    RUN_TIMEOUT=120
    if { { has_part local || has_part torch; } && [ "$MAX_B" -gt $((16 * 1024 * 1024)) ]; } ||
       { has_part netns && [ "$NETNS_MAX_B" -gt $((16 * 1024 * 1024)) ]; }; then
        RUN_TIMEOUT=600
    fi
fi


mkdir -p "$BUILD"
rm -rf "$RESULTS"
mkdir -p "$RESULTS/logs" "$RESULTS/csv"
META="$RESULTS/meta.tsv"
RUNS="$RESULTS/runs.tsv"
: >"$META"
printf 'tool\tcoll\tworld\tpart\trepeat\tstatus\tcsv\tseconds\tcommand\n' >"$RUNS"

machine_meta
meta parts "$PARTS"
meta colls "$COLLS"
meta torch_colls "$TORCH_COLLS"
meta repeats "$REPEATS"
meta ranks "$RANKS"
meta netns_ranks "$NETNS_RANKS"
meta netns_rate "$NETNS_RATE"
meta torch_ranks "$TORCH_RANKS"
meta params "parts {$PARTS}, repeats $REPEATS, per-launch timeout ${RUN_TIMEOUT}s"
meta local_params "-b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP, W in {$RANKS}; gradwire --transport shm --buffers $GW_BUFFERS, Open MPI btl self,vader, Gloo TCP loopback"
meta netns_params "-b $NETNS_MIN -e $NETNS_MAX -f $FACTOR -n $NETNS_ITERS -w $NETNS_WARMUP, W = $NETNS_RANKS namespaces (1 rank each), links $NETNS_RATE Gbit/s (tc tbf)"
meta torch_params "-b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP, W = $TORCH_RANKS, one host, collectives {$TORCH_COLLS}"

# ---- 1. dependencies and builds -----------------------------------------------
if ! { command -v "$MPICC" && command -v "$MPIRUN"; } >/dev/null 2>&1; then
    if [ "$DO_INSTALL" = 1 ]; then
        log "installing Open MPI (apt-get install -y openmpi-bin libopenmpi-dev)"
        apt-get update -qq >"$RESULTS/logs/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev \
            >>"$RESULTS/logs/apt.log" 2>&1 || log "apt-get install failed, see $RESULTS/logs/apt.log"
    else
        log "mpicc/mpirun missing and --no-install given"
    fi
fi
openmpi_commands  # as installed now

gradwire_status
GW_OK=0; [ "$GW_STATUS" = ok ] && GW_OK=1
[ -n "${GRADWIRE_BIN:-}" ] && GW_STATUS+=" (GRADWIRE_BIN=$GRADWIRE_BIN)"
meta gradwire_status "$GW_STATUS"
meta gradwire_rev "$(cd "$ROOT" && { git rev-parse --short HEAD 2>/dev/null || echo 'no commit'; }) ($(cd "$ROOT" && git status --porcelain 2>/dev/null | grep -c .) uncommitted paths)"
meta gradwire_bin "${GW//"$ROOT/"/}"

MPI_STATUS=ok
if ! command -v "$MPICC" >/dev/null 2>&1; then
    MPI_STATUS="n/a (mpicc not installed)"
elif ! "$MPICC" -O2 -Wall -Wextra -o "$BUILD/mpi_collectives" "$PEERS/mpi_collectives.c" >"$RESULTS/logs/mpicc.log" 2>&1; then
    MPI_STATUS="n/a (mpicc failed, see $RESULTS/logs/mpicc.log)"
fi
meta mpi_status "$MPI_STATUS"
meta mpi_version "$("$MPIRUN" --version 2>/dev/null | head -1)"

GLOO_STATUS=ok
torch_ok || GLOO_STATUS="n/a (torch not importable)"
meta gloo_status "$GLOO_STATUS"
meta torch_version "$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')"
meta python_version "$("$PYTHON" --version 2>&1)"

# The torch part: gradwire's PyTorch backend (python/gradwire/torch.py) on libgradwire.so.
if [ -n "${GRADWIRE_LIB:-}" ]; then
    GW_LIB=$GRADWIRE_LIB
elif [ -f "$(dirname "$GW")/libgradwire.so" ]; then
    GW_LIB="$(dirname "$GW")/libgradwire.so"
else
    GW_LIB="$ROOT/target/release/libgradwire.so"
fi
TORCH_STATUS=ok
if ! has_part torch; then
    TORCH_STATUS="not run (--parts)"
elif [ "$GW_OK" != 1 ]; then
    TORCH_STATUS=$GW_STATUS
elif [ "$GLOO_STATUS" != ok ]; then
    TORCH_STATUS="n/a (torch not importable)"
elif ! err=$(GRADWIRE_LIB=$GW_LIB PYTHONPATH="$ROOT/python" PYTHONDONTWRITEBYTECODE=1 \
             "$PYTHON" -c 'import gradwire.torch' 2>&1); then
    TORCH_STATUS="n/a (import gradwire.torch failed: $(printf '%s' "$err" | tail -n 1 | cut -c1-200))"
fi
meta torch_status "$TORCH_STATUS"
meta gradwire_lib "${GW_LIB//"$ROOT/"/}"

NETNS_STATUS=ok
if ! has_part netns; then
    NETNS_STATUS="not run (--parts)"
elif [ "$(id -u)" != 0 ]; then
    NETNS_STATUS="n/a (needs root: network namespaces, veth pairs, tc)"
elif ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    NETNS_STATUS="n/a (ip/tc missing: install iproute2)"
elif [ ! -x "$GW" ] || [[ "$("$GW" launch --help 2>&1)" != *--link-gbit* ]]; then
    NETNS_STATUS="n/a (gradwire launch has no --netns --link-gbit)"
fi
meta netns_status "$NETNS_STATUS"
BOUND_STATUS=$NETNS_STATUS
if [ "$NETNS_STATUS" = ok ] &&
   ! gcc -O2 -o "$BUILD/tcpring" "$PEERS/tcpring.c" >"$RESULTS/logs/tcpring_build.log" 2>&1; then
    BOUND_STATUS="n/a (gcc failed on tcpring.c)"
fi
meta bound_status "$BOUND_STATUS"
COPY_STATUS=ok
if ! has_part local; then
    COPY_STATUS="not run (--parts)"
elif ! gcc -O3 -pthread -o "$BUILD/thread_copies" "$PEERS/thread_copies.c" >"$RESULTS/logs/thread_copies_build.log" 2>&1; then
    COPY_STATUS="n/a (gcc failed on thread_copies.c)"
fi
meta copy_status "$COPY_STATUS"

# ---- 2. runs -----------------------------------------------------------------
BENCH_ARGS=(-b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP")
NETNS_ARGS=(-b "$NETNS_MIN" -e "$NETNS_MAX" -f "$FACTOR" -n "$NETNS_ITERS" -w "$NETNS_WARMUP")
KILL_AFTER=10
OUTER_TIMEOUT=$((RUN_TIMEOUT + 30))
export PYTHONDONTWRITEBYTECODE=1   # no __pycache__ beside the peers

LAUNCHER_PIDS=()
CUR_PID=""
CUR_PIDF=""
trap cleanup EXIT
trap on_signal INT TERM HUP

# run_one TOOL COLL W PART REPEAT CMD...   (CMD writes the CSV itself; its last argument
# is a placeholder for the CSV path).  Status: ok; "n/a (...)" when the tool lacks the
# collective (a peer's `gw-na:` line, or gradwire bench's "unknown collective"); else
# failed / timeout / killed.
run_one() {
    local tool=$1 coll=$2 w=$3 part=$4 rep=$5; shift 5
    local tag="${tool}_${coll}_w${w}_${part}_r${rep}" status na netns=0
    [[ "$part" == netns* ]] && netns=1
    run_timed "$tag" "$netns" "$@"
    na=$(grep -m1 -o 'gw-na: .*' "$RUN_LOG" 2>/dev/null | sed 's/^gw-na: *//' | tr -d '\r' | cut -c1-200)
    if [ -n "$na" ]; then
        status="n/a ($na)"
    elif [ "$tool" = gradwire ] && [ $RUN_RC -ne 0 ] &&
         grep -q -E "unknown collective|invalid value '$coll'" "$RUN_LOG" 2>/dev/null; then
        status="n/a (gradwire bench has no $coll)"
    elif [ $RUN_RC -eq 0 ] && [ -s "$RUN_CSV" ] && [ "$(wc -l <"$RUN_CSV")" -ge 2 ]; then
        status=ok
    elif [ $RUN_RC -eq 0 ]; then
        status="failed (no CSV rows)"
    else
        status=$(failure_status)
    fi
    [ "$status" = ok ] || log "  $tag: $status (log: ${RUN_LOG//"$ROOT/"/})"
    record_run "$tool" "$coll" "$w" "$part" "$rep" "$status" "$RUN_CSV"
}

record_na() {  # record_na TOOL COLL W PART REPEAT STATUS
    printf '%s\t%s\t%s\t%s\t%s\t%s\t\t0\t\n' "$@" >>"$RUNS"
}

last_status() { tail -n 1 "$RUNS" | cut -f6; }

part_local() {  # part_local REPEAT
    local rep=$1 w coll
    for w in $RANKS; do
        for coll in $COLLS; do
            if [ "$GW_OK" = 1 ]; then
                run_one gradwire "$coll" "$w" local "$rep" \
                    "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                    "$GW" bench "$coll" "${BENCH_ARGS[@]}" -d float32 -o sum \
                    --transport shm --buffers "$GW_BUFFERS" --check --csv CSV
            else
                record_na gradwire "$coll" "$w" local "$rep" "$GW_STATUS"
            fi
            if [ "$MPI_STATUS" = ok ]; then
                # pml ob1 so that the btl choice is honoured; vader = shared memory.
                # shellcheck disable=SC2086
                run_one mpi "$coll" "$w" local "$rep" \
                    "$MPIRUN" --allow-run-as-root --oversubscribe -np "$w" \
                    --mca pml ob1 --mca btl self,vader $MPI_EXTRA \
                    "$BUILD/mpi_collectives" -c "$coll" "${BENCH_ARGS[@]}" --csv CSV
            else
                record_na mpi "$coll" "$w" local "$rep" "$MPI_STATUS"
            fi
            case "$coll" in
                allgather|alltoall|broadcast|reduce_scatter)
                    if [ "$COPY_STATUS" = ok ]; then
                        run_one threads "$coll" "$w" local "$rep" \
                            "$BUILD/thread_copies" -c "$coll" -W "$w" "${BENCH_ARGS[@]}" --csv CSV
                    else
                        record_na threads "$coll" "$w" local "$rep" "$COPY_STATUS"
                    fi ;;
            esac
            if [ "$GLOO_STATUS" = ok ] && [ "$GW_OK" = 1 ]; then
                run_one gloo "$coll" "$w" local "$rep" \
                    env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 \
                    "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                    "$PYTHON" "$PEERS/gloo_collectives.py" -c "$coll" "${BENCH_ARGS[@]}" --csv CSV
            else
                record_na gloo "$coll" "$w" local "$rep" \
                    "$([ "$GLOO_STATUS" = ok ] && echo "n/a (no gradwire launch to start the ranks)" || echo "$GLOO_STATUS")"
            fi
        done
    done
}

part_netns() {  # part_netns REPEAT: W namespaces, 1 rank each, one link rate
    local rep=$1 w=$NETNS_RANKS coll i hosts
    local part="netns-$NETNS_RATE"
    local launch=("$GW" launch -n "$w" --netns --link-gbit "$NETNS_RATE" --timeout "$RUN_TIMEOUT" --)
    # The socket ceiling (compare.sh's bound part): tcpring across the same namespaces.
    hosts=$(for ((i = 0; i < w; i++)); do printf '10.77.0.%d,' $((i + 2)); done)
    if [ "$BOUND_STATUS" = ok ]; then
        run_one tcpring ceiling "$w" "$part" "$rep" "${launch[@]}" \
            "$BUILD/tcpring" --hosts "${hosts%,}" "${NETNS_ARGS[@]}" --csv CSV
    else
        record_na tcpring ceiling "$w" "$part" "$rep" "$BOUND_STATUS"
    fi
    for coll in $COLLS; do
        if [ "$NETNS_STATUS" != ok ]; then
            record_na gradwire "$coll" "$w" "$part" "$rep" "$NETNS_STATUS"
            record_na mpi "$coll" "$w" "$part" "$rep" "$NETNS_STATUS"
            record_na gloo "$coll" "$w" "$part" "$rep" "$NETNS_STATUS"
            continue
        fi
        if [ "$GW_OK" = 1 ]; then
            run_one gradwire "$coll" "$w" "$part" "$rep" "${launch[@]}" \
                "$GW" bench "$coll" "${NETNS_ARGS[@]}" -d float32 -o sum \
                --transport tcp --check --csv CSV
        else
            record_na gradwire "$coll" "$w" "$part" "$rep" "$GW_STATUS"
        fi
        if [ "$MPI_STATUS" = ok ]; then
            local extra=()
            [ -n "$MPI_EXTRA" ] && extra=(--mpi-args "$MPI_EXTRA")
            # As compare.sh: Open MPI's start across namespaces now and then loses an
            # orted and waits for ever -- a shorter limit, and one more try.
            local mpi_limit=$(( RUN_TIMEOUT < 240 ? RUN_TIMEOUT : 240 )) try outer=$OUTER_TIMEOUT
            local mpi_launch=("$GW" launch -n "$w" --netns --link-gbit "$NETNS_RATE" --timeout "$mpi_limit" --)
            OUTER_TIMEOUT=$((mpi_limit + 30))
            for try in 1 2; do
                run_one mpi "$coll" "$w" "$part" "$rep" "${mpi_launch[@]}" \
                    "$PEERS/mpi_netns.sh" "${extra[@]}" -- \
                    "$BUILD/mpi_collectives" -c "$coll" "${NETNS_ARGS[@]}" --csv CSV
                [ "$(last_status)" = ok ] && break
                [ "$try" = 1 ] && log "  mpi_${coll}_w${w}_${part}_r${rep}: trying once more"
            done
            OUTER_TIMEOUT=$outer
        else
            record_na mpi "$coll" "$w" "$part" "$rep" "$MPI_STATUS"
        fi
        if [ "$GLOO_STATUS" = ok ]; then
            run_one gloo "$coll" "$w" "$part" "$rep" \
                env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 "${launch[@]}" \
                "$PYTHON" "$PEERS/gloo_collectives.py" -c "$coll" "${NETNS_ARGS[@]}" --csv CSV
        else
            record_na gloo "$coll" "$w" "$part" "$rep" "$GLOO_STATUS"
        fi
    done
}

part_torch() {  # part_torch REPEAT: torch on the gradwire backend vs gradwire bench, one host
    local rep=$1 w=$TORCH_RANKS coll
    for coll in $TORCH_COLLS; do
        if [ "$TORCH_STATUS" = ok ]; then
            run_one torch "$coll" "$w" torch "$rep" \
                env GRADWIRE_LIB="$GW_LIB" PYTHONPATH="$ROOT/python" OMP_NUM_THREADS=1 \
                "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                "$PYTHON" "$PEERS/torch_collectives.py" -c "$coll" "${BENCH_ARGS[@]}" --csv CSV
        else
            record_na torch "$coll" "$w" torch "$rep" "$TORCH_STATUS"
        fi
        if [ "$GW_OK" = 1 ]; then
            # The same collective through the CLI (default transport, private buffers:
            # what the torch backend gets for CPU tensors).
            run_one gradwire "$coll" "$w" torch "$rep" \
                "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                "$GW" bench "$coll" "${BENCH_ARGS[@]}" -d float32 -o sum --check --csv CSV
        else
            record_na gradwire "$coll" "$w" torch "$rep" "$GW_STATUS"
        fi
    done
}

for rep in $(seq 1 "$REPEATS"); do
    has_part local && part_local "$rep"
    has_part netns && part_netns "$rep"
    has_part torch && part_torch "$rep"
done
meta loadavg_end "$(cut -d' ' -f1-3 /proc/loadavg)"
if has_part netns && [ "$NETNS_STATUS" = ok ]; then
    sleep 0.5
    netns_sweep "${LAUNCHER_PIDS[@]}"
fi

# ---- 3. merge -------------------------------------------------------------------
mkdir -p "$(dirname "$OUT")"
"$PYTHON" "$PEERS/merge_collectives.py" --results "$RESULTS" --out "$OUT" || { log "merge_collectives.py failed"; exit 1; }
log "wrote $OUT (raw data: ${RESULTS//"$ROOT/"/})"

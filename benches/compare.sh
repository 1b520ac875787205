#!/usr/bin/env bash
# benches/compare.sh -- side-by-side allreduce benchmark: gradwire vs Open MPI
# vs Gloo (torch.distributed), same sizes, same machine, one run; writes a
# report headed by a summary of the performance targets (judged from this run's
# medians), with a chart per table: target/peers/benchmarks.md, or with
# --record the report users read, docs/benchmarks.md, from the run's CSVs kept
# in benches/results/compare/ (committed).
#
#   benches/compare.sh                  # full run: all parts, 3 repeats (~16 min on 2 cores)
#   benches/compare.sh --record         # the same, kept and written into docs/benchmarks.md
#   benches/compare.sh --report         # no run: docs/benchmarks.md from the kept run
#   benches/compare.sh --quick          # smoke test: up to 16M, 1 repeat (~2 min)
#   benches/compare.sh --parts netns    # only the network-namespace part
#   benches/compare.sh --parts bound    # only the transport ceilings
#   benches/compare.sh --help           # all options
#
# Parts (--parts, default "local latency netns bound"):
#   local    one host, W in RANKS, gradwire + Open MPI over shm and TCP
#            loopback, Gloo over TCP loopback; sizes -b..-e
#   latency  one host, shm, W in RANKS, gradwire + Open MPI at one small size
#            (--lat-size, 4K) with many iterations (--lat-iters): the
#            small-message latency target
#   netns    --netns-ranks (4) network namespaces, 1 rank each, on a private
#            bridge with tbf-shaped links, one run per rate in --netns-rates
#            ("10 1" Gbit/s): gradwire, Open MPI, Gloo all under
#            `gradwire launch --netns --link-gbit R` (needs root); sizes
#            --netns-min..--netns-max with their own -n/-w
#   bound    the socket ceiling of the TCP targets: benches/peers/tcpring.c,
#            W processes in a ring, each streaming to the next and reading
#            from the previous at once, per "call" of size S exactly the
#            per-link traffic of a ring allreduce of S (2(W-1) chunks of S/W),
#            with no reduction, no framing and no step synchronisation, into
#            a receive buffer that stays in cache; timed as one stream and
#            call by call, the faster kept.  Its payload rate is
#            comparable with an allreduce's busbw (algbw*2(W-1)/W), and no
#            ring allreduce over the same TCP path (gradwire's, Gloo's,
#            Open MPI's) should beat it beyond noise.  Over TCP loopback for W in RANKS with
#            the local part's sizes and -n/-w, and under `gradwire launch -n W
#            --netns --link-gbit R` for every netns rate with the netns sizes
#            (that run needs root).  merge.py shows it in its own table and,
#            per size, beside targets 3a, 3b and 4 (context only: it does not
#            change met / not met).
#
# What it does (idempotent, safe to re-run):
#   1. installs Open MPI from Debian if mpicc/mpirun are missing (apt-get);
#      torch only with --install-torch (else the Gloo columns read
#      "n/a (torch not importable)");
#   2. builds gradwire (cargo build --release) and the peers
#      (benches/peers/*.c) into target/peers/;
#   3. measures the machine's single-thread copy bandwidth (copybw; its
#      memcpy figure is the copy_bw of the memory-bandwidth bound; its
#      all-cores memcpy bounds ranks that outnumber cores) and the
#      loopback TCP round trip (pingpong);
#   4. for each repeat, runs every selected part (tools interleaved), all
#      with the same sizes and iterations for every tool; every run is
#      wrapped in `timeout`;
#   5. benches/peers/merge.py takes the median per cell across repeats and
#      writes the markdown (summary, targets, charts, tables, exact commands).
# Raw CSVs, logs and the run list stay in target/peers/results/; --record
# copies the CSVs, the run list and the setup into benches/results/compare/.
#
# Network namespaces: this script creates none itself.  `gradwire launch
# --netns` creates gw<pid>n<i> + bridge gwb<pid> and removes them at exit;
# Open MPI runs inside the same launch through benches/peers/mpi_netns.sh.
# If a launcher dies without cleaning up (SIGKILL), the namespaces of that
# launcher pid are removed here after the run and in an EXIT trap.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS="$ROOT/benches/peers"
PROG=compare
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
BUILD="$ROOT/target/peers"
RESULTS="$BUILD/results"
# GRADWIRE_BIN: override the binary (testing the script with a stand-in)
GW="${GRADWIRE_BIN:-$ROOT/target/release/gradwire}"

# ---- defaults -------------------------------------------------------------
MIN=4K MAX=256M FACTOR=4 ITERS=20 WARMUP=5 REPEATS=3
RANKS="2 4"
TRANSPORTS="shm tcp"
TOOLS="gradwire mpi gloo"
OUT="$ROOT/target/peers/benchmarks.md"
KEPT="$ROOT/benches/results/compare"   # the recorded run (--record, --report)
REPORT="$ROOT/docs/benchmarks.md"
RECORD=0
RUN_TIMEOUT=""          # seconds per launch; default depends on MAX
INSTALL_TORCH=0
DO_BUILD=1
DO_INSTALL=1
MPI_EXTRA=""
MPI_PLACE="--inplace"   # gradwire's bench and Gloo allreduce in place; so does MPI by default
PARTS="local latency netns bound"
LAT_SIZE=4K LAT_ITERS=1000 LAT_WARMUP=100
NETNS_RANKS=4
NETNS_RATES="10 1"
NETNS_MIN=1M NETNS_MAX=64M NETNS_ITERS=5 NETNS_WARMUP=2
PYTHON="${PYTHON:-python3}"   # the interpreter that has torch (Gloo) and runs merge.py

usage() {
    cat <<EOF
usage: benches/compare.sh [options]
  --quick               smoke test: 1 repeat, local sizes 4K..16M, netns 1M..16M,
                        --lat-iters 200 (one size per target range: every target row fills)
  --parts "local latency netns bound"  which parts to run (default "$PARTS")
 local part (one host, W in --ranks):
  -b, --min SIZE        smallest message in bytes, K/M/G suffixes (default $MIN)
  -e, --max SIZE        largest message (default $MAX)
  -f, --factor F        size multiplier, local and netns parts (default $FACTOR)
  -n, --iters N         timed iterations per size (default $ITERS)
  -w, --warmup N        untimed warmup iterations per size (default $WARMUP)
  --repeats R           repeats of every part, interleaved; docs/benchmarks.md shows medians
                        (default $REPEATS)
  --ranks "2 4"         world sizes, local and latency parts (default "$RANKS")
  --transports "shm tcp"  gradwire/MPI transports (default "$TRANSPORTS"; Gloo is always TCP)
  --tools "gradwire mpi gloo"  subset of tools to run (default all)
 latency part (shm, W in --ranks, gradwire and Open MPI):
  --lat-size SIZE       message size (default $LAT_SIZE)
  --lat-iters N         timed iterations (default $LAT_ITERS)
  --lat-warmup N        warmup iterations (default $LAT_WARMUP)
 netns part (needs root; W = --netns-ranks namespaces, 1 rank each):
  --netns-ranks W       number of namespaces / ranks (default $NETNS_RANKS)
  --netns-rates "10 1"  link rates in Gbit/s, one run per rate (default "$NETNS_RATES")
  --netns-min SIZE      smallest message (default $NETNS_MIN)
  --netns-max SIZE      largest message (default $NETNS_MAX; at 1 Gbit/s, 64 MiB ~ 1 s a call)
  --netns-iters N       timed iterations (default $NETNS_ITERS)
  --netns-warmup N      warmup iterations (default $NETNS_WARMUP)
 bound part (transport ceilings of the TCP targets; no options of its own):
                        tcpring: ring streams with no reduction (the rate the sockets
                        sustain) over TCP loopback, W in --ranks, local sizes/-n/-w, and
                        under --netns --link-gbit R for every --netns-rates rate (root),
                        W = --netns-ranks, netns sizes/-n/-w; shown beside targets 3a, 3b, 4
  --timeout S           per-launch time limit in seconds (default 120, or 600 if MAX or
                        --netns-max > 16M)
  --mpi-args "ARGS"     extra mpirun arguments (recorded in the output)
  --mpi-out-of-place    MPI_Allreduce with separate send/recv buffers (default: MPI_IN_PLACE,
                        like gradwire's bench and Gloo)
  --out FILE            markdown output (default target/peers/benchmarks.md)
  --record              keep the run in benches/results/compare/ and write docs/benchmarks.md
  --report              run nothing: write docs/benchmarks.md from benches/results/compare/
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
        --quick) MAX=16M; REPEATS=1; NETNS_MAX=16M; LAT_ITERS=200; LAT_WARMUP=20 ;;
        --parts) PARTS=$2; shift ;;
        --lat-size) LAT_SIZE=$2; shift ;;
        --lat-iters) LAT_ITERS=$2; shift ;;
        --lat-warmup) LAT_WARMUP=$2; shift ;;
        --netns-ranks) NETNS_RANKS=$2; shift ;;
        --netns-rates) NETNS_RATES=$2; shift ;;
        --netns-min) NETNS_MIN=$2; shift ;;
        --netns-max) NETNS_MAX=$2; shift ;;
        --netns-iters) NETNS_ITERS=$2; shift ;;
        --netns-warmup) NETNS_WARMUP=$2; shift ;;
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
        --mpi-out-of-place) MPI_PLACE="--out-of-place" ;;
        --out) OUT=$2; shift ;;
        --record) RECORD=1 ;;
        --report)
            "${PYTHON:-python3}" "$PEERS/merge.py" --results "$KEPT" --out "$REPORT"
            exit ;;
        --install-torch) INSTALL_TORCH=1 ;;
        --no-build) DO_BUILD=0 ;;
        --no-install) DO_INSTALL=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "compare.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

MIN_B=$(to_bytes "$MIN"); MAX_B=$(to_bytes "$MAX")
NETNS_MIN_B=$(to_bytes "$NETNS_MIN"); NETNS_MAX_B=$(to_bytes "$NETNS_MAX")
to_bytes "$LAT_SIZE" >/dev/null
for v in "$FACTOR" "$ITERS" "$WARMUP" "$REPEATS" "$LAT_ITERS" "$LAT_WARMUP" \
         "$NETNS_RANKS" "$NETNS_ITERS" "$NETNS_WARMUP"; do
    [[ "$v" =~ ^[0-9]+$ ]] || { echo "compare.sh: '$v' is not a number" >&2; exit 2; }
done
for v in $NETNS_RATES; do
    [[ "$v" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "compare.sh: bad rate '$v' (Gbit/s)" >&2; exit 2; }
done
for p in $PARTS; do
    case "$p" in local|latency|netns|bound) ;; *) echo "compare.sh: unknown part '$p' (local latency netns bound)" >&2; exit 2 ;; esac
done
if [ "$REPEATS" -lt 1 ] || [ "$FACTOR" -lt 2 ] || [ "$MAX_B" -lt "$MIN_B" ] ||
   [ "$NETNS_MAX_B" -lt "$NETNS_MIN_B" ] || [ "$NETNS_RANKS" -lt 2 ] ||
   [ "$LAT_ITERS" -lt 1 ] || [ "$NETNS_ITERS" -lt 1 ]; then
    echo "compare.sh: bad parameters" >&2; exit 2
fi
has_part() { [[ " $PARTS " == *" $1 "* ]]; }
if [ -z "$RUN_TIMEOUT" ]; then
    RUN_TIMEOUT=120
    if { { has_part local || has_part bound; } && [ "$MAX_B" -gt $((16 * 1024 * 1024)) ]; } ||
       { { has_part netns || has_part bound; } && [ "$NETNS_MAX_B" -gt $((16 * 1024 * 1024)) ]; }; then
        RUN_TIMEOUT=600
    fi
fi
has_tool() { [[ " $TOOLS " == *" $1 "* ]]; }


mkdir -p "$BUILD"
rm -rf "$RESULTS"
mkdir -p "$RESULTS/logs" "$RESULTS/csv"
META="$RESULTS/meta.tsv"
RUNS="$RESULTS/runs.tsv"
: >"$META"
printf 'tool\tworld\ttransport\trepeat\tstatus\tcsv\tseconds\tcommand\n' >"$RUNS"

machine_meta
meta params "parts {$PARTS}, repeats $REPEATS, per-launch timeout ${RUN_TIMEOUT}s"
meta parts "$PARTS"
meta repeats "$REPEATS"
meta ranks "$RANKS"
meta transports "$TRANSPORTS"
meta local_params "-b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP, W in {$RANKS}, transports {$TRANSPORTS}"
meta lat_params "-b $LAT_SIZE -e $LAT_SIZE -n $LAT_ITERS -w $LAT_WARMUP, shm, W in {$RANKS}"
meta lat_iters "$LAT_ITERS"
meta netns_params "-b $NETNS_MIN -e $NETNS_MAX -f $FACTOR -n $NETNS_ITERS -w $NETNS_WARMUP, W = $NETNS_RANKS namespaces (1 rank each), link rates {$NETNS_RATES} Gbit/s"
meta netns_ranks "$NETNS_RANKS"
meta netns_rates "$NETNS_RATES"
meta bound_params "benches/peers/tcpring.c (ring streams, no reduction): TCP loopback with -b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP, W in {$RANKS}; netns with -b $NETNS_MIN -e $NETNS_MAX -f $FACTOR -n $NETNS_ITERS -w $NETNS_WARMUP, W = $NETNS_RANKS, link rates {$NETNS_RATES} Gbit/s"
meta tools "$TOOLS"
meta mpi_place "$([ "$MPI_PLACE" = --inplace ] && echo in-place || echo out-of-place)"

# ---- 1. dependencies --------------------------------------------------------
if has_tool mpi && ! { command -v "$MPICC" && command -v "$MPIRUN"; } >/dev/null 2>&1; then
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

if has_tool gloo && ! torch_ok && [ "$INSTALL_TORCH" = 1 ] && [ "$DO_INSTALL" = 1 ]; then
    log "installing torch (~2 GB download; log: $RESULTS/logs/install_torch.log)"
    "$PYTHON" "$PEERS/install_torch.py" >"$RESULTS/logs/install_torch.log" 2>&1 ||
        log "torch install failed, see $RESULTS/logs/install_torch.log"
fi

# ---- 2. builds ---------------------------------------------------------------
if has_tool gradwire; then
    gradwire_status
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
elif ! command -v "$MPICC" >/dev/null 2>&1; then
    MPI_STATUS="n/a (mpicc not installed)"
elif ! "$MPICC" -O2 -o "$BUILD/mpi_collectives" "$PEERS/mpi_collectives.c" >"$RESULTS/logs/mpicc.log" 2>&1; then
    MPI_STATUS="n/a (mpicc failed)"
fi
meta mpi_status "$MPI_STATUS"
meta mpi_version "$("$MPIRUN" --version 2>/dev/null | head -1)"

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

# The netns part (and the netns half of the bound part): root, iproute2/tc, and a
# gradwire launcher with --netns --link-gbit (it also starts the Open MPI and Gloo
# ranks there).
NETNS_STATUS=ok
if ! has_part netns && ! has_part bound; then
    NETNS_STATUS="not run (--parts)"
elif [ "$(id -u)" != 0 ]; then
    NETNS_STATUS="n/a (needs root: network namespaces, veth pairs, tc)"
elif ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    NETNS_STATUS="n/a (ip/tc missing: install iproute2)"
elif [ "$LAUNCH_OK" != 1 ] || [[ "$("$GW" launch --help 2>&1)" != *--link-gbit* ]]; then
    NETNS_STATUS="n/a (gradwire launch has no --netns --link-gbit)"
fi
meta netns_status "$NETNS_STATUS"

# The bound part runs benches/peers/tcpring.c under `gradwire launch`.
BOUND_STATUS=ok
if ! has_part bound; then
    BOUND_STATUS="not run (--parts)"
elif [ "$LAUNCH_OK" != 1 ]; then
    BOUND_STATUS="n/a (no gradwire launch to start tcpring's ranks)"
elif ! gcc -O2 -o "$BUILD/tcpring" "$PEERS/tcpring.c" >"$RESULTS/logs/tcpring_build.log" 2>&1; then
    BOUND_STATUS="n/a (gcc failed on tcpring.c)"
fi
meta bound_status "$BOUND_STATUS"

# ---- 3. machine copy bandwidth, loopback wake-up latency ------------------------
if gcc -O3 -pthread -o "$BUILD/copybw" "$PEERS/copybw.c" >"$RESULTS/logs/copybw_build.log" 2>&1; then
    log "measuring copy bandwidth (256 MiB, best of 7)"
    meta copybw "$("$BUILD/copybw" -H | tr '\n' ';')"
else
    meta copybw "n/a (gcc failed)"
fi
# Cross-core hand-off through shared memory: on a virtual machine it can change several-fold
# within minutes (where the host puts the two vCPUs); measured again after the runs.
HANDOFF=
if [ "$(nproc)" -ge 2 ] && gcc -O2 -pthread -o "$BUILD/handoff" "$PEERS/handoff.c" >"$RESULTS/logs/handoff_build.log" 2>&1; then
    HANDOFF="$BUILD/handoff"
    meta handoff_start "$("$HANDOFF" -H | tr '\n' ';')"
else
    meta handoff_start "n/a (fewer than 2 CPUs, or gcc failed)"
fi
if gcc -O2 -o "$BUILD/pingpong" "$PEERS/pingpong.c" >"$RESULTS/logs/pingpong_build.log" 2>&1; then
    meta pingpong "$("$BUILD/pingpong" -H 5000 | tr '\n' ';')"
else
    meta pingpong "n/a (gcc failed)"
fi

# ---- 4. runs -----------------------------------------------------------------
BENCH_ARGS=(-b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP")
LAT_ARGS=(-b "$LAT_SIZE" -e "$LAT_SIZE" -f 2 -n "$LAT_ITERS" -w "$LAT_WARMUP")
NETNS_ARGS=(-b "$NETNS_MIN" -e "$NETNS_MAX" -f "$FACTOR" -n "$NETNS_ITERS" -w "$NETNS_WARMUP")
KILL_AFTER=10
OUTER_TIMEOUT=$((RUN_TIMEOUT + 30))

# Namespaces are made and removed by `gradwire launch --netns` (gw<pid>n<i>, veth
# gw<pid>h<i>, bridge gwb<pid>).  We note the pid of every launcher we start and,
# should one die without cleaning up, remove what that pid left behind: only
# those names, never anybody else's.
LAUNCHER_PIDS=()
CUR_PID=""
CUR_PIDF=""
trap cleanup EXIT
trap on_signal INT TERM HUP

# run_one TOOL W TRANSPORT REPEAT CMD...   (CMD must write the CSV itself; its last
# argument is a placeholder for the CSV path).  The command runs through a tiny
# shell that records its pid (then execs it), so a netns launcher's leftovers
# can be attributed to it.
run_one() {
    local tool=$1 w=$2 tr=$3 rep=$4; shift 4
    local tag="${tool}_w${w}_${tr}_r${rep}" status netns=0
    [[ "$tr" == *netns-* ]] && netns=1
    run_timed "$tag" "$netns" "$@"
    if [ $RUN_RC -eq 0 ] && [ -s "$RUN_CSV" ]; then
        status=ok
    else
        status=$(failure_status)
    fi
    [ "$status" = ok ] || log "  $tag: $status (log: $RUN_LOG)"
    record_run "$tool" "$w" "$tr" "$rep" "$status" "$RUN_CSV"
}

record_na() {  # record_na TOOL W TRANSPORT REPEAT STATUS
    printf '%s\t%s\t%s\t%s\t%s\t\t0\t\n' "$@" >>"$RUNS"
}

mpi_btl() {  # mpi_btl TRANSPORT -> sets array BTL
    case "$1" in
        shm) BTL=(--mca btl "self,vader") ;;
        tcp) BTL=(--mca btl "self,tcp" --mca btl_tcp_if_include lo) ;;
        *) BTL=() ;;
    esac
}

gloo_launcher() {  # gloo_launcher W -> sets array LAUNCHER
    if [ "$LAUNCH_OK" = 1 ]; then
        LAUNCHER=("$GW" launch -n "$1" --timeout "$RUN_TIMEOUT" --)
    else
        LAUNCHER=("$PYTHON" -m torch.distributed.run --standalone --no-python --nproc-per-node "$1")
    fi
}

part_local() {  # part_local REPEAT
    local rep=$1 w tr
    for w in $RANKS; do
        for tr in $TRANSPORTS; do
            if [ "$GW_OK" = 1 ]; then
                run_one gradwire "$w" "$tr" "$rep" \
                    "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                    "$GW" bench allreduce "${BENCH_ARGS[@]}" -d float32 -o sum \
                    --transport "$tr" --check --csv CSV
                if [ "$tr" = shm ]; then
                    # Again on buffers from gradwire's allocator (gradwire_alloc), which
                    # the ranks of a host map: its zero-copy case, tabled beside.
                    run_one gradwire "$w" shm-shared "$rep" \
                        "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                        "$GW" bench allreduce "${BENCH_ARGS[@]}" -d float32 -o sum \
                        --transport shm --buffers shared --check --csv CSV
                    # And on private buffers registered in place (gradwire_register).
                    run_one gradwire "$w" shm-registered "$rep" \
                        "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                        "$GW" bench allreduce "${BENCH_ARGS[@]}" -d float32 -o sum \
                        --transport shm --buffers registered --check --csv CSV
                fi
            else
                record_na gradwire "$w" "$tr" "$rep" "$GW_STATUS"
            fi

            if [ "$MPI_STATUS" = ok ]; then
                mpi_btl "$tr"
                # pml ob1 so the btl choice is honoured (the ucx pml would bypass it).
                # shellcheck disable=SC2086
                run_one mpi "$w" "$tr" "$rep" \
                    "$MPIRUN" --allow-run-as-root --oversubscribe -np "$w" \
                    --mca pml ob1 "${BTL[@]}" $MPI_EXTRA \
                    "$BUILD/mpi_collectives" -c allreduce "${BENCH_ARGS[@]}" -d float32 -o sum \
                    $MPI_PLACE --csv CSV
            else
                record_na mpi "$w" "$tr" "$rep" "$MPI_STATUS"
            fi
        done

        # Gloo: TCP only, run once per (W, repeat), shown beside every transport.
        if [ "$GLOO_STATUS" = ok ]; then
            gloo_launcher "$w"
            run_one gloo "$w" tcp "$rep" \
                env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 "${LAUNCHER[@]}" \
                "$PYTHON" "$PEERS/gloo_collectives.py" -c allreduce "${BENCH_ARGS[@]}" -d float32 -o sum --csv CSV
        else
            record_na gloo "$w" tcp "$rep" "$GLOO_STATUS"
        fi
    done
}

part_latency() {  # part_latency REPEAT: shm only, gradwire and Open MPI
    local rep=$1 w
    for w in $RANKS; do
        if [ "$GW_OK" = 1 ]; then
            run_one gradwire "$w" lat-shm "$rep" \
                "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                "$GW" bench allreduce "${LAT_ARGS[@]}" -d float32 -o sum \
                --transport shm --check --csv CSV
        else
            record_na gradwire "$w" lat-shm "$rep" "$GW_STATUS"
        fi
        if [ "$MPI_STATUS" = ok ]; then
            mpi_btl shm
            # shellcheck disable=SC2086
            run_one mpi "$w" lat-shm "$rep" \
                "$MPIRUN" --allow-run-as-root --oversubscribe -np "$w" \
                --mca pml ob1 "${BTL[@]}" $MPI_EXTRA \
                "$BUILD/mpi_collectives" -c allreduce "${LAT_ARGS[@]}" -d float32 -o sum \
                $MPI_PLACE --csv CSV
        else
            record_na mpi "$w" lat-shm "$rep" "$MPI_STATUS"
        fi
    done
}

part_netns() {  # part_netns REPEAT: W namespaces, 1 rank each, per link rate
    local rep=$1 w=$NETNS_RANKS rate tr
    for rate in $NETNS_RATES; do
        tr="netns-$rate"
        local launch=("$GW" launch -n "$w" --netns --link-gbit "$rate" --timeout "$RUN_TIMEOUT" --)
        if [ "$NETNS_STATUS" != ok ]; then
            record_na gradwire "$w" "$tr" "$rep" "$NETNS_STATUS"
            record_na mpi "$w" "$tr" "$rep" "$NETNS_STATUS"
            record_na gloo "$w" "$tr" "$rep" "$NETNS_STATUS"
            continue
        fi
        if [ "$GW_OK" = 1 ]; then
            run_one gradwire "$w" "$tr" "$rep" "${launch[@]}" \
                "$GW" bench allreduce "${NETNS_ARGS[@]}" -d float32 -o sum \
                --transport tcp --check --csv CSV
        else
            record_na gradwire "$w" "$tr" "$rep" "$GW_STATUS"
        fi
        if [ "$MPI_STATUS" = ok ]; then
            local extra=()
            [ -n "$MPI_EXTRA" ] && extra=(--mpi-args "$MPI_EXTRA")
            # Open MPI's launch across namespaces now and then loses one orted at start-up
            # and then waits for ever (once in each of three runs): a shorter limit than
            # the sweep's, and one more try (both attempts are in runs.tsv).
            local mpi_limit=$(( RUN_TIMEOUT < 240 ? RUN_TIMEOUT : 240 )) try outer=$OUTER_TIMEOUT
            local mpi_launch=("$GW" launch -n "$w" --netns --link-gbit "$rate" --timeout "$mpi_limit" --)
            OUTER_TIMEOUT=$((mpi_limit + 30))
            for try in 1 2; do
                # shellcheck disable=SC2086
                run_one mpi "$w" "$tr" "$rep" "${mpi_launch[@]}" \
                    "$PEERS/mpi_netns.sh" "${extra[@]}" -- \
                    "$BUILD/mpi_collectives" -c allreduce "${NETNS_ARGS[@]}" -d float32 -o sum \
                    $MPI_PLACE --csv CSV
                [ "$(tail -n 1 "$RUNS" | cut -f5)" = ok ] && break
                [ "$try" = 1 ] && log "  mpi_w${w}_${tr}_r${rep}: trying once more"
            done
            OUTER_TIMEOUT=$outer
        else
            record_na mpi "$w" "$tr" "$rep" "$MPI_STATUS"
        fi
        if [ "$GLOO_STATUS" = ok ]; then
            # the namespace's only interface besides lo is eth0
            run_one gloo "$w" "$tr" "$rep" \
                env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 "${launch[@]}" \
                "$PYTHON" "$PEERS/gloo_collectives.py" -c allreduce "${NETNS_ARGS[@]}" -d float32 -o sum --csv CSV
        else
            record_na gloo "$w" "$tr" "$rep" "$GLOO_STATUS"
        fi
    done
}

# part_bound REPEAT: the socket ceiling of the TCP targets.  tcpring (ring streams,
# no reduction) over TCP loopback for W in RANKS with the local sizes, and across the
# namespaces for every netns rate with the netns sizes.  Recorded as tool tcpring,
# transport bound-tcp / bound-netns-<Gbit/s>.
part_bound() {
    local rep=$1 w rate tr hosts i
    for w in $RANKS; do
        if [ "$BOUND_STATUS" = ok ]; then
            run_one tcpring "$w" bound-tcp "$rep" \
                "$GW" launch -n "$w" --timeout "$RUN_TIMEOUT" -- \
                "$BUILD/tcpring" "${BENCH_ARGS[@]}" --csv CSV
        else
            record_na tcpring "$w" bound-tcp "$rep" "$BOUND_STATUS"
        fi
    done
    w=$NETNS_RANKS
    # `gradwire launch --netns` puts rank i at 10.77.0.(i+2) (for W <= 248).
    hosts=$(for ((i = 0; i < w; i++)); do printf '10.77.0.%d,' $((i + 2)); done)
    for rate in $NETNS_RATES; do
        tr="bound-netns-$rate"
        if [ "$BOUND_STATUS" != ok ]; then
            record_na tcpring "$w" "$tr" "$rep" "$BOUND_STATUS"
        elif [ "$NETNS_STATUS" != ok ]; then
            record_na tcpring "$w" "$tr" "$rep" "$NETNS_STATUS"
        else
            run_one tcpring "$w" "$tr" "$rep" \
                "$GW" launch -n "$w" --netns --link-gbit "$rate" --timeout "$RUN_TIMEOUT" -- \
                "$BUILD/tcpring" --hosts "${hosts%,}" "${NETNS_ARGS[@]}" --csv CSV
        fi
    done
}

NPROC=$(nproc)
for rep in $(seq 1 "$REPEATS"); do
    has_part local && part_local "$rep"
    has_part latency && part_latency "$rep"
    has_part netns && part_netns "$rep"
    has_part bound && part_bound "$rep"
done
meta loadavg_end "$(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$HANDOFF" ] && meta handoff_end "$("$HANDOFF" -H | tr '\n' ';')"
[ "$NPROC" -gt 0 ] && meta oversubscribed_when "W > $NPROC"
if { has_part netns || has_part bound; } && [ "$NETNS_STATUS" = ok ]; then
    sleep 0.5
    netns_sweep "${LAUNCHER_PIDS[@]}"
    left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^gw[0-9]+n[0-9]+$' | tr '\n' ' ')
    [ -n "$left" ] && log "note: namespaces present now (not started by this run, or still in use): $left"
fi

# ---- 5. merge -------------------------------------------------------------------
if [ "$RECORD" = 1 ]; then
    rm -rf "$KEPT"
    mkdir -p "$KEPT/csv" "$KEPT/logs"
    cp "$META" "$RUNS" "$KEPT/"
    cp "$RESULTS"/csv/*.csv "$KEPT/csv/" 2>/dev/null
    # merge.py reads the mpirun line of the namespace runs from their logs
    grep -lE '^mpi_netns.sh: [^ ]*mpirun[^ ]* ' "$RESULTS"/logs/*.log 2>/dev/null | xargs -r cp -t "$KEPT/logs/"
    RESULTS=$KEPT OUT=$REPORT
fi
"$PYTHON" "$PEERS/merge.py" --results "$RESULTS" --out "$OUT" || { log "merge.py failed"; exit 1; }
log "wrote $OUT (raw data: $RESULTS)"

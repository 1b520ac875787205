#!/usr/bin/env bash
# Every GPU test and benchmark gradwire has, in one run on a machine with a GPU; the
# binaries are built on another machine, so the GPU machine needs no Rust, only Python with
# torch (and torchvision for the DASO benchmark), a C++ compiler and NCCL.
#
#   benches/gpu.sh --stage DIR     (here) the release binaries, the GPU test binaries and the
#                                  C example, stripped, into DIR, and this machine's `ip`
#   benches/gpu.sh --run DIR OUT   (on the GPU machine, from the repository root) every test
#                                  and benchmark with DIR's binaries: one log, OUT/run.log,
#                                  and the DASO benchmark's CSVs
#   benches/gpu.sh --daso-netns DIR OUT   (on the GPU machine, as root) the DASO benchmark
#                                  alone, each rank a network namespace of its own (gradwire
#                                  launch --netns, with DIR's `ip` where the machine has
#                                  none): OUT/run-netns.log and its CSVs, beside --run's
#   python3 benches/gpu_report.py OUT [--record]   the report section from OUT's files
#
# One GPU is enough: the runs of several ranks make each rank a node of its own
# (GRADWIRE_HOST_ID=node<rank>, or its namespace under --daso-netns), so NCCL groups hold one rank and gradwire crosses between
# them through pinned memory. A GPU with more ranks per node than GPUs is refused by name
# (tests/gpu.rs checks that).
set -uo pipefail
cd "$(dirname "$0")/.."

stage() {
    local dir=$1
    mkdir -p "$dir"
    cargo build --release --bins --lib || return 1
    # The test binaries' paths, from cargo's own report of what it built.
    local tests
    tests=$(cargo test --release --no-run --lib --test gpu --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print("test" if m["target"]["kind"] == ["test"] else "lib", m["executable"])') || return 1
    cp target/release/gradwire target/release/libgradwire.so "$dir/" || return 1
    cp "$(awk '$1 == "lib" {print $2}' <<<"$tests")" "$dir/lib-test" || return 1
    cp "$(awk '$1 == "test" {print $2}' <<<"$tests")" "$dir/gpu-test" || return 1
    strip "$dir"/gradwire "$dir"/libgradwire.so "$dir"/lib-test "$dir"/gpu-test || return 1
    cc -std=c99 -Wall -Wextra -Werror -I ffi ffi/examples/gpu.c -L "$dir" -lgradwire -ldl -lm -Wl,-rpath,'$ORIGIN' -o "$dir/gpu-example" || return 1
    # This machine's `ip`, its libraries and its loader, for `gradwire launch --netns` on a
    # GPU machine without iproute2 (start() puts it on PATH only there). It runs through the
    # loader it came with, so neither the GPU machine's glibc nor LD_LIBRARY_PATH matters:
    # `ip netns exec` passes its environment on to the ranks, which must keep their own.
    mkdir -p "$dir/iproute" || return 1
    cp "$(command -v ip)" "$dir/iproute/ip.bin" || return 1
    ldd "$dir/iproute/ip.bin" | awk '$3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | xargs -r cp -L -t "$dir/iproute/" || return 1
    local loader
    loader=$(ldd "$dir/iproute/ip.bin" | awk '$1 ~ /^\// {print $1}' | xargs -r basename) || return 1
    printf '%s\n' '#!/bin/sh' 'here=$(dirname "$(readlink -f "$0")")' \
        "exec \"\$here/$loader\" --library-path \"\$here\" \"\$here/ip.bin\" \"\$@\"" >"$dir/iproute/ip" || return 1
    chmod +x "$dir/iproute/ip" || return 1
    "$dir/iproute/ip" -V || return 1
    ls -la "$dir"
}

# start DIR OUT LOG: the environment for DIR's binaries, the log OUT/LOG, and step().
start() {
    bin=$(cd "$1" && pwd) || exit 1
    out=$2
    mkdir -p "$out" || exit 1
    command -v ip >/dev/null || PATH=$bin/iproute:$PATH
    export PATH=$bin:$PATH GRADWIRE_LIB=$bin/libgradwire.so PYTHONPATH=$PWD/python GRADWIRE_TEST_BIN=$bin/gradwire
    export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=4
    exec > >(tee "$out/$3") 2>&1
    failed=0 t0=$(date +%s)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'
}

# step NAME LIMIT_S COMMAND...: the markers gpu_report.py reads the outcome from.
step() {
    local name=$1 limit=$2 s
    shift 2
    s=$(date +%s)
    echo "=== $name: $*"
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "=== $name rc=$rc $(($(date +%s) - s))s (t=$(($(date +%s) - t0))s)"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

daso_netns() {
    start "$1" "$2" run-netns.log
    # Each rank in a network namespace other than the launcher's, and the two apart.
    local seen
    seen=$(mktemp -d) || exit 1
    HOST_NS=$(readlink /proc/self/ns/net) SEEN=$seen step netns 60 gradwire launch -n 2 --netns -- sh -c \
        'ns=$(readlink /proc/self/ns/net); echo "rank $RANK: $ns"; echo "$ns" >"$SEEN/$RANK"; [ "$ns" != "$HOST_NS" ]'
    if [ "$(cat "$seen"/0 "$seen"/1 2>/dev/null | sort -u | wc -l)" != 2 ]; then
        echo "=== netns: the two ranks do not have namespaces of their own"
        failed=$((failed + 1))
    fi
    [ $failed -eq 0 ] || return 1
    for model in resnet50 resnet18; do
        step "daso-netns-$model-96" 300 gradwire launch -n 2 --netns -- python3 benches/gpu_daso.py --model $model --steps 96 --rounds 3 --csv "$out/gpu_daso_${model}_96_netns.csv"
    done
    echo "=== all done t=$(($(date +%s) - t0))s, $failed step(s) failed"
    [ $failed -eq 0 ]
}

run() {
    start "$1" "$2" run.log
    local npr tr
    npr='GRADWIRE_HOST_ID=node$RANK exec'
    tr="python3 -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1"
    step info 30 gradwire info
    step rust-gpu 200 gpu-test --test-threads 1 --skip c_example
    step lib-gpu 60 lib-test gpu:: --test-threads 1
    step check1 60 gradwire launch -n 1 -- gradwire gpu-check
    step check4 120 gradwire launch -n 4 -- sh -c "$npr gradwire gpu-check --hierarchical"
    step check3tcp 120 env GRADWIRE_TRANSPORT=tcp gradwire launch -n 3 -- sh -c "$npr gradwire gpu-check --hierarchical"
    step cex1 60 gradwire launch -n 1 -- gpu-example
    step cex3 60 gradwire launch -n 3 -- sh -c "$npr gpu-example"
    step native 180 python3 -m gradwire._torch_native
    step cuda1 150 gradwire launch -n 1 -- python3 python/tests/torch_cuda.py
    step cuda2 150 env GRADWIRE_TEST_NODE_PER_RANK=1 gradwire launch -n 2 -- python3 python/tests/torch_cuda.py
    step fsdp2-gloo-cpu 120 $tr --master-port 29611 python/tests/fsdp2_vs_gloo.py gloo
    step fsdp2-gradwire-cuda 120 $tr --master-port 29612 python/tests/fsdp2_vs_gloo.py gradwire cuda
    step badinput 120 gradwire launch -n 3 -- python3 python/tests/bad_input.py
    step buffers-cuda 150 gradwire launch -n 2 -- sh -c "$npr python3 python/tests/batchnorm_buffers.py cuda"
    step torchbackend 200 gradwire launch -n 2 -- python3 python/tests/torch_backend.py
    step torchbench 150 gradwire launch -n 1 -- python3 benches/gpu_torch.py --iters 100 --rounds 5
    step gpubench2 150 gradwire launch -n 2 -- sh -c "$npr gradwire gpu-bench -b 1M -e 256M -n 10"
    # Two epoch lengths: each timed epoch ends in DASO's blocking sync, so the two split its
    # per-step cost from its per-epoch one (gpu_report.py).
    for steps in 24 96; do
        for model in resnet50 resnet18; do
            step "daso-$model-$steps" 300 gradwire launch -n 2 -- python3 benches/gpu_daso.py --model $model --steps $steps --rounds 3 --csv "$out/gpu_daso_${model}_$steps.csv"
        done
    done
    echo "=== all done t=$(($(date +%s) - t0))s, $failed step(s) failed"
    [ $failed -eq 0 ]
}

usage() {
    sed -n '2,15p' "$0" >&2
    exit 2
}

case "${1:-}" in
--stage) [ $# -eq 2 ] || usage; stage "$2" ;;
--run) [ $# -eq 3 ] || usage; run "$2" "$3" ;;
--daso-netns) [ $# -eq 3 ] || usage; daso_netns "$2" "$3" ;;
*) usage ;;
esac

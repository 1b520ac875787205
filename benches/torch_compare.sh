#!/usr/bin/env bash
# torch.distributed.all_reduce on the "gradwire" backend against gloo, and against
# `gradwire bench` (the same allreduce without the Python layer), one host, W in RANKS;
# then DDP step time on a ~25 M-parameter model, gradwire backend vs gloo. Same machine,
# same sizes, one run; ratios within it.
#
#   benches/torch_compare.sh            # print the tables
#   benches/torch_compare.sh --record   # also write them into BENCHMARKS.md
#
# Environment: RANKS (default "2 4"), SIZES (default 4 KiB to 256 MiB, x4), DDP_STEPS (10).
# Needs torch (benches/peers/install_torch.py). About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
record=0
[ "${1:-}" = --record ] && record=1
ranks=${RANKS:-2 4}
export SIZES=${SIZES:-4096 16384 65536 262144 1048576 4194304 16777216 67108864 268435456}
sizes=$SIZES
cargo build --release --bin gradwire --lib >&2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
export GRADWIRE_LIB=$PWD/target/release/libgradwire.so PYTHONPATH=$PWD/python GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
{
  echo "## PyTorch: torch.distributed on the gradwire backend vs gloo"
  echo
  echo "Command: \`benches/torch_compare.sh --record\` ($(getconf _NPROCESSORS_ONLN) cores, torch $(python3 -c 'import torch; print(torch.__version__)'), $(date -u +%Y-%m-%d)). One host, ranks pinned by \`gradwire launch\`, float32 sum, private"
  echo "CPU tensors. busbw = 2(W-1)/W x bytes / time (nccl-tests), each time the slowest rank's mean."
  echo "\`torch gradwire\` is \`dist.all_reduce\` after \`init_process_group(\"gradwire\")\`, \`gloo\` the same script"
  echo "with \`init_process_group(\"gloo\")\` (one backend per launch: gloo's threads beside gradwire's slow it),"
  echo "\`gradwire bench\` the CLI's allreduce of the same sizes"
  echo "(no Python). Goals (issue 29): torch gradwire >= 2x gloo's busbw from 1 MiB, and within 10 % of"
  echo "gradwire bench from 1 MiB."
  for w in $ranks; do
    for backend in gradwire gloo; do
      BACKEND=$backend target/release/gradwire launch -n "$w" -- python3 benches/torch_allreduce.py > "$tmp/$backend-$w" 2>"$tmp/$backend-$w.err" \
        < /dev/null || { cat "$tmp/$backend-$w.err" >&2; exit 1; }
    done
    b=$(echo "$sizes" | awk '{print $1}'); e=$(echo "$sizes" | awk '{print $NF}')
    target/release/gradwire launch -n "$w" -- target/release/gradwire bench allreduce -b "$b" -e "$e" -f 4 --csv "$tmp/bench-$w.csv" >/dev/null 2>&1
    echo
    echo "### W = $w"
    echo
    echo "| bytes | torch gradwire busbw GB/s | gloo busbw GB/s | gradwire / gloo | gradwire bench busbw GB/s | torch gradwire / bench | torch gradwire µs | gloo µs |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
    python3 - "$tmp/gradwire-$w" "$tmp/gloo-$w" "$tmp/bench-$w.csv" "$w" <<'PY'
import csv, sys
w = int(sys.argv[4])
bench = {}
rows = list(csv.reader(open(sys.argv[3])))
head = rows[0]
for r in rows[1:]:
    d = dict(zip(head, r))
    bench[int(d["size_bytes"])] = float(d["busbw_gbs"])
def read(path):
    return [line.split() for line in open(path) if line.strip()]
gw_lines, gl_lines = read(sys.argv[1]), read(sys.argv[2])
gloo_us = {int(f[1]): float(f[2]) for f in gl_lines if f[0] == "allreduce"}
gloo_ddp = [float(f[2]) for f in gl_lines if f[0] == "ddp"]
for f in gw_lines:
    if f[0] != "allreduce":
        continue
    size, gw_us, gl_us = int(f[1]), float(f[2]), gloo_us[int(f[1])]
    bus = lambda us: 2 * (w - 1) / w * size / (us * 1e-6) / 1e9
    b = bench.get(size)
    print(f"| {size} | {bus(gw_us):.2f} | {bus(gl_us):.2f} | {gl_us / gw_us:.1f}x | {b:.2f} | {bus(gw_us) / b * 100:.0f} % | {gw_us:.1f} | {gl_us:.1f} |" if b else
          f"| {size} | {bus(gw_us):.2f} | {bus(gl_us):.2f} | {gl_us / gw_us:.1f}x | — | — | {gw_us:.1f} | {gl_us:.1f} |")
for f in gw_lines:
    if f[0] == "ddp" and gloo_ddp:
        print(f"\nDDP step (forward, backward, SGD step; {int(f[1]) / 1e6:.1f} M parameters, batch 16): gradwire {f[2]} ms, gloo {gloo_ddp[0]} ms: **{float(f[2]) / gloo_ddp[0]:.2f}x gloo's** (goal <= 0.8x).")
PY
  done
} > "$tmp/section.md"
cat "$tmp/section.md"
[ $record = 1 ] && python3 benches/record_section.py "$tmp/section.md"
exit 0

#!/usr/bin/env bash
# torch.distributed.all_reduce on the "gradwire" backend against gloo, and against
# `gradwire bench` (the same allreduce without the Python layer), one host, W in RANKS;
# then DDP step time on a ~25 M-parameter model, gradwire backend vs gloo. Same machine,
# same sizes, one run; ratios within it.
#
#   benches/torch_compare.sh            # print the tables
#   benches/torch_compare.sh --record   # also keep the raw outputs in benches/results/torch_compare/
#                                       # and write the tables into docs/benchmarks.md
#   benches/torch_compare.sh --report   # run nothing: rewrite the section from the kept outputs
#
# Environment: RANKS (default "2 4"), SIZES (default 4 KiB to 256 MiB, x4), DDP_STEPS (10),
# REPEATS (3): gradwire's runs (torch and bench) and the DDP steps alternate that many
# times and each figure is the median, with its range: 4 ranks on 2 cores move a single
# run by tens of percent. Gloo's allreduce runs once (its ratio is far from the goal).
# Needs torch (benches/peers/install_torch.py). About 12 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/lib.sh
. benches/lib.sh
kept_run torch_compare "${1:-}"
if [ "$mode" != --report ]; then
  ranks=${RANKS:-2 4}
  # Also 2 x 2 ranks in network namespaces (shm inside a "node", tcp between): NETNS=0 skips.
  [ "${NETNS:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v ip >/dev/null && ranks="$ranks 4ns"
  repeats=${REPEATS:-3}
  export SIZES=${SIZES:-4096 16384 65536 262144 1048576 4194304 16777216 67108864 268435456}
  sizes=$SIZES
  cargo build --release --bin gradwire --lib >&2
  export GRADWIRE_LIB=$PWD/target/release/libgradwire.so PYTHONPATH=$PWD/python GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
  if [ "$mode" = --record ]; then rm -rf "$kept"; mkdir -p "$kept"; fi
  printf 'cores\t%s\ntorch\t%s\ndate\t%s\ncommit\t%s\nranks\t%s\nrepeats\t%s\n' "$(getconf _NPROCESSORS_ONLN)" \
    "$(python3 -c 'import torch; print(torch.__version__)')" "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD)" "$ranks" "$repeats" >"$raw/meta.tsv"
  for cfg in $ranks; do
    w=${cfg%ns}
    where=()
    [ "$cfg" != "$w" ] && where=(--netns --ranks-per-node 2)
    b=$(echo "$sizes" | awk '{print $1}'); e=$(echo "$sizes" | awk '{print $NF}')
    for rep in $(seq "$repeats"); do
      for backend in gradwire gloo; do
        s=$SIZES; [ "$backend" = gloo ] && [ "$rep" -gt 1 ] && s=""
        ifname=lo; [ "$cfg" != "$w" ] && ifname=eth0
        GLOO_SOCKET_IFNAME=$ifname SIZES=$s BACKEND=$backend target/release/gradwire launch -n "$w" "${where[@]}" -- python3 benches/torch_allreduce.py > "$raw/$backend-$cfg-$rep" 2>"$tmp/$backend-$cfg.err" \
          < /dev/null || { cat "$tmp/$backend-$cfg.err" >&2; exit 1; }
      done
      target/release/gradwire launch -n "$w" "${where[@]}" -- target/release/gradwire bench allreduce -b "$b" -e "$e" -f 4 --csv "$raw/bench-$cfg-$rep.csv" >/dev/null 2>&1
    done
  done
fi
meta() { awk -F'\t' -v k="$1" '$1 == k { print $2 }' "$raw/meta.tsv"; }
ranks=$(meta ranks); repeats=$(meta repeats)
{
  echo "## PyTorch: torch.distributed on the gradwire backend vs gloo"
  echo
  echo "Command: \`benches/torch_compare.sh --record\` ($(meta cores) cores, torch $(meta torch), $(meta date), commit $(meta commit); its raw outputs are kept in \`$kept/\`, from which \`--report\` rewrites this section). One host, ranks pinned by \`gradwire launch\`, float32 sum, private"
  echo "CPU tensors. busbw = 2(W-1)/W x bytes / time (nccl-tests), each time the slowest rank's mean;"
  echo "gradwire's figures and the DDP steps are medians of $repeats alternating runs (range in brackets)."
  echo "\`torch gradwire\` is \`dist.all_reduce\` after \`init_process_group(\"gradwire\")\`, \`gloo\` the same script"
  echo "with \`init_process_group(\"gloo\")\` (one backend per launch: gloo's threads beside gradwire's slow it),"
  echo "\`gradwire bench\` the CLI's allreduce of the same sizes"
  echo "(no Python). Goals (issue 29): torch gradwire >= 2x gloo's busbw from 1 MiB, and within 10 % of"
  echo "gradwire bench from 1 MiB; DDP steps <= 0.8x gloo's. The goals are set for one host; the namespace table is reported against them."
  for cfg in $ranks; do
    w=${cfg%ns}
    title="W = $w"
    [ "$cfg" != "$w" ] && title="W = 4 as 2 x 2 ranks in network namespaces (shm inside, tcp between; gloo over the namespaces' veth)"
    echo
    echo "### $title"
    echo
    echo "| bytes | torch gradwire busbw GB/s | gloo busbw GB/s | gradwire / gloo | gradwire bench busbw GB/s | torch gradwire / bench | torch gradwire µs | gloo µs |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
    python3 - "$raw" "$cfg" "$repeats" <<'PY'
import csv, statistics, sys
tmp, cfg, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
w = int(cfg.removesuffix("ns"))
def read(path):
    return [line.split() for line in open(path) if line.strip()]
def fig(values, fmt):
    m = statistics.median(values)
    return f"{fmt(m)} ({fmt(min(values))}–{fmt(max(values))})" if len(values) > 1 else fmt(m)
bench, torch_us, ddp_gw, ddp_gloo = {}, {}, [], []
for rep in range(1, repeats + 1):
    rows = list(csv.reader(open(f"{tmp}/bench-{cfg}-{rep}.csv")))
    for r in rows[1:]:
        d = dict(zip(rows[0], r))
        bench.setdefault(int(d["size_bytes"]), []).append(float(d["busbw_gbs"]))
    for f in read(f"{tmp}/gradwire-{cfg}-{rep}"):
        if f[0] == "allreduce":
            torch_us.setdefault(int(f[1]), []).append(float(f[2]))
        elif f[0] == "ddp":
            ddp_gw.append(float(f[2]))
            params = int(f[1])
    ddp_gloo += [float(f[2]) for f in read(f"{tmp}/gloo-{cfg}-{rep}") if f[0] == "ddp"]
gloo_us = {int(f[1]): float(f[2]) for f in read(f"{tmp}/gloo-{cfg}-1") if f[0] == "allreduce"}
for size, us in torch_us.items():
    bus = lambda t: 2 * (w - 1) / w * size / (t * 1e-6) / 1e9
    gl = gloo_us[size]
    gw = statistics.median(us)
    b = bench.get(size)
    ratio = fig([bus(t) / statistics.median(b) * 100 for t in us], lambda x: f"{x:.0f} %") if b else "—"
    bfig = fig(b, lambda x: f"{x:.2f}") if b else "—"
    print(f"| {size} | {fig([bus(t) for t in us], lambda x: f'{x:.2f}')} | {bus(gl):.2f} | {gl / gw:.1f}x | {bfig} | {ratio} | {gw:.1f} | {gl:.1f} |")
if ddp_gw and ddp_gloo:
    gw, gl = statistics.median(ddp_gw), statistics.median(ddp_gloo)
    print(f"\nDDP step (forward, backward, SGD step; {params / 1e6:.1f} M parameters, batch 16): gradwire {fig(ddp_gw, lambda x: f'{x:.1f}')} ms, "
          f"gloo {fig(ddp_gloo, lambda x: f'{x:.1f}')} ms: **{gw / gl:.2f}x gloo's** (goal <= 0.8x).")
PY
  done
} > "$tmp/section.md"
cat "$tmp/section.md"
[ -n "$mode" ] && python3 benches/record_section.py "$tmp/section.md"
exit 0

#!/usr/bin/env bash
# The cost model (gradwire model) against measured runs: allreduce over N network-namespace
# nodes of one rank each (gradwire launch --netns) on each kind of link: each node's egress
# shaped by tc tbf to a rate, or unshaped ("native": the veth pairs as they are), by the
# ring, recursive doubling and halving-doubling (GRADWIRE_ALGO). Every run is repeated,
# the repeats interleaved (repeat after repeat of every case) so that drift of the machine
# hits all alike. Per link the model's α, β, γ and σ are fitted to the median of the runs
# on FIT_NODES nodes and predict every run; the report gives each run's error, the median,
# and how often the model picks the faster of the two algorithms the automatic choice
# takes (ring, recursive doubling) where the repeats tell them apart; then the automatic
# choice itself runs, told the fitted network (GRADWIRE_NET_*).
#
#   benches/cost_model.sh --record   # run (about 10 minutes), keep the CSVs in
#                                    # benches/results/cost_model/, write docs/cost_model.md
#   benches/cost_model.sh --report   # rewrite docs/cost_model.md from the kept CSVs
#
# Environment: NODES (default "2 4 8"), RATES in Gbit/s or "native" (default "0.2 1
# native"), FIT_NODES (default "2 4"), REPEATS (default 3). Needs root (namespaces, tc).
# The links are shaped on an otherwise idle machine: run nothing else meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in --record|--report) ;; *) echo "usage: $0 --record|--report" >&2; exit 2 ;; esac
nodes=${NODES:-2 4 8}
rates=${RATES:-0.2 1 native}
fit_nodes=${FIT_NODES:-2 4}
repeats=${REPEATS:-3}
kept=benches/results/cost_model
cargo build --release --bin gradwire >&2
gw=target/release/gradwire
# A link's name in file names ("1g", "native") and its launch arguments.
name_of() { if [ "$1" = native ]; then echo native; else echo "${1}g"; fi; }
shape_of() { [ "$1" = native ] || echo "--link-gbit $1"; }
# One allreduce run into CSV $1 (small sizes, then large): the rest is the environment.
bench() {
  local csv=$1 n=$2 rate=$3; shift 3
  # Small sizes run many calls: tbf lets a burst (256 KiB) through at wire speed, so a few
  # calls would measure the burst, not the link.
  for part in "4K 64K 400 40" "256K 16M 5 1"; do
    set -- $part
    env "${envs[@]}" $gw launch -n "$n" --netns --ranks-per-node 1 $(shape_of "$rate") -- \
      $gw bench allreduce --transport tcp -b "$1" -e "$2" -f 4 -n "$3" -w "$4" --csv "$csv.$1" >/dev/null
  done
  { cat "$csv.4K"; tail -n +2 "$csv.256K"; } >"$csv" && rm -f "$csv.4K" "$csv.256K"
}
# The median repeat of every size (the row whose time is the median) of CSVs $2... into $1.
median_of() {
  python3 - "$@" <<'PY'
import csv, statistics, sys
out, runs = sys.argv[1], [list(csv.DictReader(open(p))) for p in sys.argv[2:]]
with open(out, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(runs[0][0].keys()), lineterminator="\n")
    w.writeheader()
    for rows in zip(*runs):
        mid = statistics.median_low(float(r["time_us"]) for r in rows)
        w.writerow(next(r for r in rows if float(r["time_us"]) == mid))
PY
}
if [ "$mode" = --record ]; then
  rm -rf "$kept" && mkdir -p "$kept"
  printf 'rate_gbit\tnodes\talgo\tcsv\tcommand\n' >"$kept/runs.tsv"
  for rep in $(seq 1 "$repeats"); do
    for rate in $rates; do
      for n in $nodes; do
        for algo in ring rd hd; do
          echo "[cost_model $(date +%T)] repeat $rep: $algo on $n nodes, link $(name_of "$rate")" >&2
          envs=(GRADWIRE_ALGO=$algo)
          bench "$kept/allreduce_$(name_of "$rate")_n${n}_${algo}.r$rep.csv" "$n" "$rate"
        done
      done
    done
  done
  for rate in $rates; do
    for n in $nodes; do
      for algo in ring rd hd; do
        base=allreduce_$(name_of "$rate")_n${n}_${algo}
        median_of "$kept/$base.csv" $(seq -f "$kept/$base.r%g.csv" 1 "$repeats")
        cmd="GRADWIRE_ALGO=$algo $gw launch -n $n --netns --ranks-per-node 1 $(shape_of "$rate") -- $gw bench allreduce --transport tcp -b 4K -e 64K -f 4 -n 400 -w 40 --csv SMALL; the same with -b 256K -e 16M -f 4 -n 5 -w 1 --csv LARGE; $repeats repeats ($base.rN.csv), the median of each size in $base.csv"
        printf '%s\t%s\t%s\t%s\t%s\n' "$rate" "$n" "$algo" "$base.csv" "$cmd" >>"$kept/runs.tsv"
      done
    done
  done
  { echo "date	$(date -u +%F)"; echo "commit	$(git rev-parse --short HEAD)"; echo "cpus	$(nproc)";
    echo "cpu	$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"; echo "kernel	$(uname -r)"; echo "repeats	$repeats"; } >"$kept/meta.tsv"
fi
# Per link: fit on FIT_NODES, predict everything (gradwire model --fit ... --check ...).
for rate in $(cut -f1 "$kept/runs.tsv" | tail -n +2 | sort -u); do
  fit=() check=()
  while IFS=$'\t' read -r r n algo csv _; do
    [ "$r" = "$rate" ] && [ "$algo" != auto ] || continue
    if [[ " $fit_nodes " == *" $n "* ]]; then fit+=("$algo:$n:$kept/$csv"); else check+=("$algo:$n:$kept/$csv"); fi
  done < <(tail -n +2 "$kept/runs.tsv")
  args=(--fit "$(IFS=,; echo "${fit[*]}")")
  [ ${#check[@]} -gt 0 ] && args+=(--check "$(IFS=,; echo "${check[*]}")")
  # Every node is a namespace of this one machine: its ranks share the recording host's cores.
  args+=(--cores "$(awk -F'\t' '$1 == "cpus" {print $2}' "$kept/meta.tsv")")
  model=$kept/model_$(name_of "$rate").csv
  $gw model "${args[@]}" >"$model"
  # The automatic choice, told the fitted network: every node count, the same sizes.
  if [ "$mode" = --record ]; then
    read -r alpha gamma gbit < <(head -1 "$model" | sed -E 's/.*alpha ([0-9.]+) us, beta [0-9.]+ ns\/B \(([0-9.]+) Gbit\/s\), gamma ([0-9.]+) ns\/B.*/\1 \3 \2/')
    for n in $nodes; do
      base=allreduce_$(name_of "$rate")_n${n}_auto
      echo "[cost_model $(date +%T)] auto on $n nodes, network $gbit Gbit/s, alpha $alpha us, gamma $gamma ns/B" >&2
      envs=(GRADWIRE_ALGO=auto GRADWIRE_NET_GBIT=$gbit GRADWIRE_NET_ALPHA_US=$alpha GRADWIRE_NET_GAMMA_NS=$gamma)
      bench "$kept/$base.csv" "$n" "$rate"
      printf '%s\t%s\t%s\t%s\t%s\n' "$rate" "$n" auto "$base.csv" "${envs[*]}, sizes as above, once" >>"$kept/runs.tsv"
    done
  fi
done
python3 benches/cost_model_report.py "$kept" docs/cost_model.md
echo "wrote docs/cost_model.md" >&2

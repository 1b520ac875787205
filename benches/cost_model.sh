#!/usr/bin/env bash
# The cost model (gradwire model) against measured runs: allreduce over N network-namespace
# nodes of one rank each (gradwire launch --netns, each node's egress shaped by tc tbf) at
# each link rate, by the ring, recursive doubling and halving-doubling (GRADWIRE_ALGO). Per
# rate the model's α, β, γ and σ are fitted to the runs on FIT_NODES nodes and predict every
# run; the report gives each run's error, the median, and how often the model picks the
# faster of the two algorithms the automatic choice takes (ring, recursive doubling); then
# the automatic choice itself runs, told the fitted network (GRADWIRE_NET_*).
#
#   benches/cost_model.sh --record   # run (about 7 minutes), keep the CSVs in
#                                    # benches/results/cost_model/, write docs/cost_model.md
#   benches/cost_model.sh --report   # rewrite docs/cost_model.md from the kept CSVs
#
# Environment: NODES (default "2 4 8"), RATES in Gbit/s (default "0.2 1"), FIT_NODES
# (default "2 4"). Needs root (namespaces, tc). The links are shaped on an otherwise idle
# machine: run nothing else meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in --record|--report) ;; *) echo "usage: $0 --record|--report" >&2; exit 2 ;; esac
nodes=${NODES:-2 4 8}
rates=${RATES:-0.2 1}
fit_nodes=${FIT_NODES:-2 4}
kept=benches/results/cost_model
cargo build --release --bin gradwire >&2
gw=target/release/gradwire
if [ "$mode" = --record ]; then
  rm -rf "$kept" && mkdir -p "$kept"
  printf 'rate_gbit\tnodes\talgo\tcsv\tcommand\n' >"$kept/runs.tsv"
  for rate in $rates; do
    for n in $nodes; do
      for algo in ring rd hd; do
        csv="$kept/allreduce_${rate}g_n${n}_${algo}.csv"
        # Small sizes run many calls: tbf lets a burst (256 KiB) through at wire speed, so
        # a few calls would measure the burst, not the link.
        cmd="GRADWIRE_ALGO=$algo $gw launch -n $n --netns --ranks-per-node 1 --link-gbit $rate -- $gw bench allreduce --transport tcp -b 4K -e 64K -f 4 -n 400 -w 40 --csv SMALL; the same with -b 256K -e 16M -f 4 -n 5 -w 1 --csv LARGE"
        echo "[cost_model $(date +%T)] $cmd" >&2
        for part in "4K 64K 400 40" "256K 16M 5 1"; do
          set -- $part
          GRADWIRE_ALGO=$algo $gw launch -n "$n" --netns --ranks-per-node 1 --link-gbit "$rate" -- \
            $gw bench allreduce --transport tcp -b "$1" -e "$2" -f 4 -n "$3" -w "$4" --csv "$csv.$1" >/dev/null
        done
        { cat "$csv.4K"; tail -n +2 "$csv.256K"; } >"$csv" && rm -f "$csv.4K" "$csv.256K"
        printf '%s\t%s\t%s\t%s\t%s\n' "$rate" "$n" "$algo" "$(basename "$csv")" "$cmd" >>"$kept/runs.tsv"
      done
    done
  done
  { echo "date	$(date -u +%F)"; echo "commit	$(git rev-parse --short HEAD)"; echo "cpus	$(nproc)";
    echo "cpu	$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"; echo "kernel	$(uname -r)"; } >"$kept/meta.tsv"
fi
# Per rate: fit on FIT_NODES, predict everything (gradwire model --fit ... --check ...).
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
  $gw model "${args[@]}" >"$kept/model_${rate}g.csv"
  # The automatic choice, told the fitted network: every node count, the same sizes.
  if [ "$mode" = --record ]; then
    read -r alpha gamma gbit < <(head -1 "$kept/model_${rate}g.csv" | sed -E 's/.*alpha ([0-9.]+) us, beta [0-9.]+ ns\/B \(([0-9.]+) Gbit\/s\), gamma ([0-9.]+) ns\/B.*/\1 \3 \2/')
    for n in $nodes; do
      csv="$kept/allreduce_${rate}g_n${n}_auto.csv"
      echo "[cost_model $(date +%T)] auto on $n nodes, network $gbit Gbit/s, alpha $alpha us, gamma $gamma ns/B" >&2
      for part in "4K 64K 400 40" "256K 16M 5 1"; do
        set -- $part
        GRADWIRE_ALGO=auto GRADWIRE_NET_GBIT=$gbit GRADWIRE_NET_ALPHA_US=$alpha GRADWIRE_NET_GAMMA_NS=$gamma \
          $gw launch -n "$n" --netns --ranks-per-node 1 --link-gbit "$rate" -- \
          $gw bench allreduce --transport tcp -b "$1" -e "$2" -f 4 -n "$3" -w "$4" --csv "$csv.$1" >/dev/null
      done
      { cat "$csv.4K"; tail -n +2 "$csv.256K"; } >"$csv" && rm -f "$csv.4K" "$csv.256K"
      printf '%s\t%s\t%s\t%s\t%s\n' "$rate" "$n" auto "$(basename "$csv")" "GRADWIRE_ALGO=auto GRADWIRE_NET_GBIT=$gbit GRADWIRE_NET_ALPHA_US=$alpha GRADWIRE_NET_GAMMA_NS=$gamma, sizes as above" >>"$kept/runs.tsv"
    done
  fi
done
python3 benches/cost_model_report.py "$kept" docs/cost_model.md
echo "wrote docs/cost_model.md" >&2

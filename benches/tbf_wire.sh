#!/bin/bash
# What a tbf-shaped link carries during a 4-namespace TCP allreduce, per rank: the bytes tbf
# charged (frames with their headers, and the ACKs of the other direction) against the
# allreduce payload the rank sent, and how busy that kept the link.
#
#   benches/tbf_wire.sh [--record|--report]    (needs root; GBIT=1 SIZES="16777216 67108864" ITERS=6)
#
# payload / charged is the most of the link rate any TCP allreduce's busbw can reach here
# (target 3b asks for 95 %); busy = bytes charged per call / (link rate x time per call).
# --record keeps the per-rank figures in benches/results/tbf_wire/ and replaces this script's
# section of docs/benchmarks.md (after the part compare.sh writes); --report rewrites the
# section from them without measuring.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/lib.sh
. benches/lib.sh
kept_run tbf_wire "${1:-}"
gbit=${GBIT:-1} sizes=${SIZES:-16777216 67108864} iters=${ITERS:-6} warmup=1 world=4
if [ "$mode" != --report ]; then
cargo build --release --bin gradwire >&2
if [ "$mode" = --record ]; then rm -rf "$kept"; mkdir -p "$kept"; fi
printf '%s %s %s %s\n' "$gbit" "$iters" "$warmup" "$world" >"$raw/setup"
for size in $sizes; do
  cat >"$tmp/rank.sh" <<SH
#!/bin/sh
out=\$("$PWD/target/release/gradwire" bench allreduce --transport tcp -b $size -e $size -n $iters -w $warmup 2>&1)
charged=\$(tc -s qdisc show dev eth0 | awk '/Sent/ { print \$2; exit }')
us=\$(echo "\$out" | awk '\$1 == $size { print \$5 }')
echo "rank \$RANK $size \$charged \$us"
SH
  chmod +x "$tmp/rank.sh"
  target/release/gradwire launch -n $world --netns --link-gbit "$gbit" -- "$tmp/rank.sh" >>"$raw/out"
done
fi
read -r gbit iters warmup world <"$raw/setup"
python3 - "$raw/out" "$gbit" "$iters" "$warmup" "$world" "$([ -n "$mode" ] && echo 1 || echo 0)" "$tmp/section.md" <<'PY'
import sys
path, gbit, iters, warmup, world, record = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
rows = [l.split() for l in open(path) if l.startswith("rank ")]
rate = gbit * 1e9 / 8
out = ["| size | rank | charged by tbf per call (B) | payload per call (B) | payload / charged | link busy | busbw / link rate |", "|---:|---:|---:|---:|---:|---:|---:|"]
for size in sorted({int(r[2]) for r in rows}):
    these = sorted((r for r in rows if int(r[2]) == size), key=lambda r: int(r[1]))
    payload = size * 2 * (world - 1) / world          # bytes a ring allreduce rank sends per call
    us = max(float(r[4]) for r in these if len(r) > 4)  # time per call, as rank 0's bench reports it
    for r in these:
        per_call = int(r[3]) / (iters + warmup)       # setup traffic (a few KB) ignored
        out.append(f"| {size} | {r[1]} | {per_call:,.0f} | {payload:,.0f} | {100 * payload / per_call:.1f} % | "
                   f"{100 * per_call / (rate * us / 1e6):.1f} % | {100 * payload / (us / 1e6) / rate:.1f} % |")
table = "\n".join(out)
print(table)
if record:
    head = f"## What a {gbit:g} Gbit/s tbf link carries (gradwire allreduce, W = 4 namespaces)"
    section = f"""{head}

Command: `benches/tbf_wire.sh --record` (per-rank figures kept in `benches/results/tbf_wire/`; {iters} timed + {warmup} warm-up calls per size). Per rank: the
bytes its namespace's tbf qdisc charged (`tc -s qdisc`: every frame with its headers, the
ACKs it sends for the other ring direction included) per call, against the payload a ring
allreduce rank sends per call (2(W-1)/W S). payload / charged is the most of the link rate
any TCP allreduce's busbw can reach on this link; link busy = charged bytes per call / (link
rate x the time per call that rank 0's bench reports). Target 3b (busbw >= 95 % of the link rate) thus
needs the link busy >= 95 / (payload / charged) of the time.

{table}
"""
    open(sys.argv[7], "w").write(section)
PY
[ -n "$mode" ] && python3 benches/record_section.py "$tmp/section.md"
true

#!/usr/bin/env bash
# gradwire over verbs against perftest's ib_write_bw on one soft-RoCE (rxe) device, inside
# the project's QEMU guest (tests/rxe/run-in-vm.sh): point-to-point write bandwidth and
# 2-rank allreduce busbw, same device, same sizes, medians of REPEATS turns.
#
#   benches/rxe_compare.sh            # print the table
#   benches/rxe_compare.sh --record   # also keep the guest's output in benches/results/rxe_compare/
#                                     # and write the table into docs/benchmarks.md (its verbs section)
#   benches/rxe_compare.sh --report   # run nothing: rewrite the section from the kept output
#
# Environment: SIZES (default "65536 1048576 4194304 16777216"), BYTES moved per size, tool
# and repeat (default 64 MiB), REPEATS (default 3); GRADWIRE_* variables are passed to the
# ranks in the guest. About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/lib.sh
. benches/lib.sh
kept_run rxe_compare "${1:-}"
if [ "$mode" != --report ]; then
sizes=${SIZES:-65536 1048576 4194304 16777216}
cargo build --release --bin gradwire >&2
if [ "$mode" = --record ]; then rm -rf "$kept"; mkdir -p "$kept"; fi
printf '%s\n%s\n' "$sizes" "${REPEATS:-3}" >"$raw/setup"
strip -o "$tmp/gradwire" target/release/gradwire 2>/dev/null || cp target/release/gradwire "$tmp/gradwire"
# GRADWIRE_* settings of this shell reach the ranks in the guest (to try ring sizes etc.).
passthrough=()
while IFS= read -r kv; do passthrough+=(-e "$kv"); done < <(env | grep '^GRADWIRE_' || true)
tests/rxe/run-in-vm.sh -t 1500 -e "SIZES=$sizes" -e "BYTES=${BYTES:-67108864}" -e "REPEATS=${REPEATS:-3}" "${passthrough[@]}" \
  -f "$tmp/gradwire" -- benches/rxe/in-guest.sh | tee "$raw/out"
grep -q '^| [0-9]' "$raw/out" || { echo "rxe_compare: no result rows" >&2; exit 1; }
fi
[ -n "$mode" ] || exit 0
{ read -r sizes; read -r repeats; } <"$raw/setup"

python3 - "$raw/out" "$sizes" "$repeats" "$tmp/section.md" <<'PY'
import re, sys
out, sizes, repeats = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
rows = [l for l in out.splitlines() if l.startswith("|")]
data = [l for l in rows if re.match(r"\| \d", l)]
def pct(cell):
    m = re.match(r"\s*(\d+) %", cell)
    return int(m.group(1)) if m else None
judge = []
for l in data:
    c = [x.strip() for x in l.strip("|").split("|")]
    size, w, a = int(c[0]), pct(c[3]), pct(c[5])
    judge.append(f"| {size} | write {w} % ({'met' if w is not None and w >= 90 else 'NOT met'}) | "
                 + (f"allreduce {a} % ({'met' if a is not None and a >= 80 else 'NOT met'})" if size >= 4 << 20 else f"allreduce {a} % (target applies from 4 MiB)")
                 + " |")
section = f"""## RDMA verbs on soft-RoCE (rxe), one QEMU guest

Command: `benches/rxe_compare.sh --record` (the guest's output kept in `benches/results/rxe_compare/`; sizes {sizes}; each cell the median of {repeats}
turns in which the tools take turns). Inside one guest of `tests/rxe/run-in-vm.sh` (TCG, 2
vCPUs on this 2-core host, rxe0 on the guest's eth0, active MTU 1024): perftest's
`ib_write_bw` (client and server on rxe0, to the guest's own address), `gradwire bench
write` (rank 0 RDMA-WRITEs from its registered window into rank 1's, one request in flight)
and `gradwire bench allreduce --transport verbs` with 2 ranks (busbw = algbw at W=2). The
next column is `ib_write_bw -b`, both directions at once: an allreduce moves data both ways,
busbw in each direction at once. The last column sets the allreduce against half of that:
what perftest itself gets per direction when both directions run at once on the guest's
2 vCPUs (context, not a target).
Absolute figures measure TCG-emulated soft-RoCE, not RDMA hardware; only the ratios count.

{chr(10).join(rows)}

Targets (issue: point-to-point >= 90 % of ib_write_bw; 2-rank allreduce busbw >= 80 % of it
at >= 4 MiB):

| size | point-to-point | allreduce |
|---:|---|---|
{chr(10).join(judge)}
"""
open(sys.argv[4], "w").write(section)
PY
python3 benches/record_section.py "$tmp/section.md"

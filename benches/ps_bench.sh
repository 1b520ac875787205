#!/usr/bin/env bash
# Parameter-server shards and the token ring (src/rma/) against the raw one-sided
# operations of the same transport: `gradwire bench ps` (push/pull vs write/read, same
# sizes, blocks of each taking turns within one run) and `gradwire bench token-ring` (round
# time per ring size), on shm and tcp here and on verbs inside the rxe guest.
#
#   benches/ps_bench.sh            # print the section
#   benches/ps_bench.sh --record   # also keep the raw outputs in benches/results/ps_bench/
#                                  # and write the section into docs/benchmarks.md
#   benches/ps_bench.sh --report   # run nothing: rewrite the section from the kept outputs
#
# Environment: REPEATS (default 3; each cell is the median), NO_VM=1 skips verbs. About
# 4 minutes on 2 cores (the guest boot included).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/lib.sh
. benches/lib.sh
kept_run ps_bench "${1:-}"
gw=target/release/gradwire
if [ "$mode" != --report ]; then
  repeats=${REPEATS:-3} vm=$([ "${NO_VM:-0}" = 1 ] && echo 0 || echo 1)
  cargo build --release --bin gradwire >&2
  if [ "$mode" = --record ]; then rm -rf "$kept"; mkdir -p "$kept"; fi
  echo "$repeats $vm" >"$raw/setup"
  ps_runs() { # $1 name, then the command that prints one bench ps run
    local name=$1; shift
    for r in $(seq "$repeats"); do "$@" >"$raw/ps-$name.$r" 2>&1 || { cat "$raw/ps-$name.$r" >&2; exit 1; }; done
  }
  ps_runs shm $gw launch -n 2 -- $gw bench ps --transport shm -b 64K -e 16M -f 4 -n 100 --check
  ps_runs tcp $gw launch -n 2 -- $gw bench ps --transport tcp -b 64K -e 16M -f 4 -n 100 --check
  ps_runs tcp-unbound $gw launch --bind none -n 2 -- $gw bench ps --transport tcp -b 64K -e 16M -f 4 -n 100 --check
  for t in shm tcp; do
    for n in 2 4 8; do
      for r in $(seq "$repeats"); do $gw launch -n "$n" -- $gw bench token-ring --transport "$t" -n 20 >"$raw/ring-$t-$n.$r"; done
    done
  done
  if [ "$vm" = 1 ]; then
    strip -o "$tmp/gradwire" $gw 2>/dev/null || cp $gw "$tmp/gradwire"
    cat >"$tmp/guest.sh" <<'G'
#!/bin/sh
for r in $(seq "$REPEATS"); do gradwire launch -n 2 -- gradwire bench ps --transport verbs -b 64K -e 16M -f 4 -n 10 --check > /tmp/ps.$r 2>&1; cat /tmp/ps.$r | sed "s/^/ps$r: /"; done
for n in 2 4; do for r in $(seq "$REPEATS"); do gradwire launch -n $n -- gradwire bench token-ring --transport verbs -n 4 | sed "s/^/ring$n: /"; done; done
G
    chmod +x "$tmp/guest.sh"
    tests/rxe/run-in-vm.sh -t 1500 -e "REPEATS=$repeats" -f "$tmp/gradwire" -- "$tmp/guest.sh" >"$raw/vm.out" 2>&1 || { cat "$raw/vm.out" >&2; exit 1; }
  fi
fi
read -r repeats vm <"$raw/setup"

# median_rows FILE...: per size, the median of each numeric column over the files.
median_rows() {
  python3 - "$@" <<'PY'
import statistics, sys
runs = [[l.split() for l in open(f) if l.strip() and l.split()[0].isdigit()] for f in sys.argv[1:]]
runs = [r for r in runs if r]
for i, row in enumerate(runs[0]):
    cols = [[float(r[i][c].rstrip('%')) for r in runs if i < len(r)] for c in range(1, 7)]
    m = [statistics.median(c) for c in cols]
    print(f"| {int(row[0])} | {m[0]:.2f} | {m[1]:.2f} | {100*m[1]/m[0]:.0f} % | {m[3]:.2f} | {m[4]:.2f} | {100*m[4]/m[3]:.0f} % |")
PY
}
ps_table() { # $1 title, $2 the runs' files, without the repeat suffix
  echo "### $1"
  echo
  echo "| size (B) | write GB/s | push GB/s | push / write | read GB/s | pull GB/s | pull / read |"
  echo "|---:|---:|---:|---:|---:|---:|---:|"
  median_rows $(seq -f "$2.%g" "$repeats")
  echo
}
ring_rows() { # $1 transport label, $2 its name in the kept files
  for n in 2 4 8; do
    t=$(for r in $(seq "$repeats"); do awk '/token round time/ { print $4 }' "$raw/ring-$2-$n.$r"; done | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    echo "| $1 | $n | $t | $(awk -v t="$t" -v n="$n" 'BEGIN { printf "%.1f", t / n }') |"
  done
}
{
  echo "## Parameter-server shards and token ring"
  echo
  echo "Written by \`benches/ps_bench.sh --record\` (raw outputs kept in \`$kept/\`; \`--report\` rewrites this section from them); medians of $repeats runs. A push is complete once"
  echo "applied (timed up to the flush): on shm the worker applies it in place under the shard lock;"
  echo "on tcp it is one accumulate request that the shard's one-sided service applies chunk by chunk"
  echo "as it arrives; on verbs one RDMA WRITE into the shard's inbox slot plus an atomic doorbell,"
  echo "applied by the shard's thread. A pull is a seqlock read (version, parameters, version; one"
  echo "round trip on tcp). The raw columns are \`Window::write\`/\`read\` of the same sizes at the"
  echo "same offset in the same run, blocks of ten of each kind taking turns."
  echo
  ps_table "shm, W=2 (ranks pinned)" "$raw/ps-shm"
  ps_table "tcp loopback, W=2 (ranks pinned: the shard's core also receives)" "$raw/ps-tcp"
  ps_table "tcp loopback, W=2, --bind none" "$raw/ps-tcp-unbound"
  if [ "$vm" = 1 ]; then
    for r in $(seq "$repeats"); do sed -n "s/^ps$r: //p" "$raw/vm.out" >"$tmp/vps.$r"; done
    echo "### verbs on soft-RoCE (rxe, one QEMU guest, 2 emulated cores), W=2"
    echo
    echo "| size (B) | write GB/s | push GB/s | push / write | read GB/s | pull GB/s | pull / read |"
    echo "|---:|---:|---:|---:|---:|---:|---:|"
    median_rows $(seq -f "$tmp/vps.%g" "$repeats")
    echo
  fi
  echo "### Token round time (one token, fixed ring order, take + pass per hand-off)"
  echo
  echo "| transport | ring size | round time (us) | per hand-off (us) |"
  echo "|---|---:|---:|---:|"
  ring_rows shm shm
  ring_rows tcp tcp
  if [ "$vm" = 1 ]; then
    for n in 2 4; do
      t=$(sed -n "s/^ring$n: //p" "$raw/vm.out" | awk '/token round time/ { print $4 }' | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
      echo "| verbs (rxe) | $n | $t | $(awk -v t="$t" -v n="$n" 'BEGIN { printf "%.1f", t / n }') |"
    done
  fi
  echo
  echo "Ring sizes above the core count (8 ranks on 2 cores) measure the scheduler as much as the ring."
  echo
  cat <<'NOTE'
Why a push can beat the raw write: on tcp the service receives a push into a small buffer
that stays in cache and adds it into the parameters from there, while a raw write lands
in memory; on shm the worker adds straight into the shard. Raw operations use the offset
of the shard's parameters: from a page-aligned source (offset 0) the kernel's tcp copy of
a read reply ran at about half the speed it reaches from the parameters' offset, which
earlier made pulls look faster than raw reads. On verbs a push is one RDMA WRITE plus a
doorbell and the shard's thread applies it (the one case with a second pass over the gradients), so
push/write stays near 100 %.

NOTE
} | tee "$tmp/section.md"
python3 benches/ps_verdict.py "$tmp/section.md" | tee -a "$tmp/section.md"
echo >> "$tmp/section.md"

[ -n "$mode" ] || exit 0
python3 benches/record_section.py "$tmp/section.md"

#!/bin/bash
# How close targets 1a/1b on private buffers are to what any allreduce of private buffers can
# do here. Alternating, per round, W and size: gradwire's one-host allreduce of private buffers
# (cross-memory attach), benches/peers/cma_probe.c doing the same copies and reduction in plain
# C (the algorithm without gradwire around it), cma_probe with the reduction left out (copies
# only: the kernel moving what a private-buffer allreduce must move between processes), and
# Open MPI's vader. Medians and ranges over the rounds. cma_probe pins its processes round
# robin to the online CPUs; gradwire's launcher pins only when ranks <= CPUs.
#
#   benches/cma_ceiling.sh [--record|--report]    (ROUNDS=5 RANKS="2 4" SIZES="16 64 256", MiB)
#
# A private buffer is reached from another process only through the kernel (cross-memory
# attach: one copy per byte moved) or through staging in shared memory (two copies, in user
# space). Through the kernel, each rank must fetch its part of every peer's buffer and put
# the result into every peer's: the copies-only figure. An allreduce also reduces, so it
# stays below that figure; gradwire's staged form measured lower still (docs/benchmarks.md).
# --record keeps the raw figures in benches/results/cma_ceiling/ and replaces this script's
# section of docs/benchmarks.md (after the part compare.sh writes); --report rewrites the
# section from the kept figures without measuring.
set -euo pipefail
cd "$(dirname "$0")/.."
PROG=cma_ceiling ROOT=$PWD
. benches/lib.sh   # Open MPI's mpirun and mpicc by their own names (MPIRUN, MPICC); kept_run
kept_run cma_ceiling "${1:-}"
rounds=${ROUNDS:-5} ranks=${RANKS:-2 4} sizes=${SIZES:-16 64 256}
if [ "$mode" != --report ]; then
  if [ "$mode" = --record ]; then rm -rf "$kept"; mkdir -p "$kept"; fi
  printf '%s\n' "$rounds" >"$raw/rounds"
  cargo build --release --bin gradwire >&2
  mkdir -p target/peers
  gcc -O3 -march=native benches/peers/cma_probe.c -o target/peers/cma_probe
  gcc -O3 -pthread benches/peers/copybw.c -o target/peers/copybw
  "$MPICC" -O2 benches/peers/mpi_collectives.c -o target/peers/mpi_collectives
  gw=target/release/gradwire
  iters() { case $1 in 16) echo 30 ;; 64) echo 15 ;; *) echo 6 ;; esac; }
  for _ in $(seq "$rounds"); do
    # Target 1b's memory bound comes from the single-thread memcpy figure, as in compare.sh.
    memcpy=$(target/peers/copybw -H | awk -F, 'NR == 2 { print $2 }')
    echo "copybw ${memcpy:?copybw gave no figure}" | tee -a "$raw/out" >&2
    for w in $ranks; do
      for mib in $sizes; do
        n=$(iters "$mib") bytes=$((mib << 20))
        g=$("$gw" launch -n "$w" -- "$gw" bench allreduce --transport shm -b "$bytes" -e "$bytes" -n "$n" -w 3 | awk -v s="$bytes" '$1 == s { print $7 }')
        c=$(target/peers/cma_probe "$w" "$mib" "$n" 256 | sed 's/.*busbw \([0-9.]*\).*/\1/')
        k=$(target/peers/cma_probe "$w" "$mib" "$n" 256 copy | sed 's/.*busbw \([0-9.]*\).*/\1/')
        m=$("$MPIRUN" --allow-run-as-root --oversubscribe -np "$w" --mca pml ob1 --mca btl self,vader target/peers/mpi_collectives -c allreduce \
          -b "$bytes" -e "$bytes" -n "$n" -w 3 -d float32 -o sum --inplace --csv /dev/stdout | awk -F, -v s="$bytes" '$1 == s { print $7 }')
        : "${g:?gradwire gave no figure}" "${c:?cma_probe gave no figure}" "${k:?cma_probe copy gave no figure}" "${m:?Open MPI gave no figure}"
        echo "$w $mib $g $c $k $m" | tee -a "$raw/out" >&2
      done
    done
  done
fi
rounds=$(cat "$raw/rounds")
python3 - "$raw/out" "$rounds" "$([ -n "$mode" ] && echo 1 || echo 0)" "$tmp/section.md" <<'PY'
import statistics, sys
path, rounds, record, out_path = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
rows, memcpy = {}, []
for line in open(path):
    if line.startswith("copybw "):
        memcpy.append(float(line.split()[1]))
        continue
    w, mib, *vals = line.split()
    rows.setdefault((int(w), int(mib)), []).append([float(v) for v in vals])
med = statistics.median
def cell(xs):
    return f"{med(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"
def share(target, xs):  # the target as a share of a figure: of its median (of its range)
    return f"{100 * target / med(xs):.0f} % ({100 * target / max(xs):.0f}–{100 * target / min(xs):.0f} %)"
out = ["| W | size | gradwire | cma_probe: copies and reduction | cma_probe: copies only | Open MPI (vader) | target | target / copies and reduction | target / copies only |",
       "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
for (w, mib), runs in sorted(rows.items()):
    g, c, k, m = (list(col) for col in zip(*runs))
    k_bytes = 2.5 if w == 2 else 2.75  # bytes a zero-copy allreduce moves per rank, in S (compare.sh's 1b)
    targets = [("1a: 2.5× Open MPI", 2.5 * med(m)), ("1b: 70 % of memory bound", 0.7 * med(memcpy) / k_bytes * 2 * (w - 1) / w)]
    for i, (name, t) in enumerate(targets):
        lead = f"| {w} | {mib} MiB | {cell(g)} | {cell(c)} | {cell(k)} | {cell(m)} |" if i == 0 else "| | | | | | |"
        out.append(f"{lead} {name}: {t:.2f} | {share(t, c)} | {share(t, k)} |")
table = "\n".join(out)
print(table)
if record:
    open(out_path, "w").write(f"""## Private buffers: what cross-memory attach allows (W = 2 and 4, shm)

Command: `benches/cma_ceiling.sh --record` (raw figures kept in `benches/results/cma_ceiling/`; {rounds} rounds; in each, per W and size, the four
runs one after another). busbw in GB/s, f32 sum, in place: median (range). gradwire: its
one-host allreduce of private buffers (cross-memory attach). `benches/peers/cma_probe.c`: the
same algorithm in plain C (rank r fetches part r of every peer's buffer through
`process_vm_readv`, block by block, reduces, and puts each block into every peer's buffer
with `process_vm_writev`), then the same with the reduction left out: the copies the kernel
must make for any allreduce of private buffers through cross-memory attach (no process can
map another's private memory; the other way, staging through shared memory, copies every
byte twice and measured slower here), so no such allreduce reaches that figure. The targets: 1a from Open MPI's median
here, 1b from the memcpy figure of `copybw` measured in each round (median {med(memcpy):.2f}
GB/s; bound as in the targets table). The last columns: what each target asks as a share of
the two cma_probe figures, of their median (over their range); above 100 % of copies only
the target is out of reach of cross-memory attach on this machine. cma_probe pins its
processes round robin to the CPUs (here W = 4 shares 2 cores); gradwire pins only when
ranks <= CPUs.

Registering the buffers in place (`gradwire_register`, `--buffers registered`) lifts this
ceiling: their pages become shared, and the allreduce reads and writes the peers' buffers
with no kernel copy (the targets table judges 1a and 1b on registered buffers too).

{table}
""")
PY
[ -n "$mode" ] && python3 benches/record_section.py "$tmp/section.md"
true

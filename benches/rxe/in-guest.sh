#!/bin/sh
# Runs inside the rxe guest (see benches/rxe_compare.sh): ib_write_bw, `gradwire bench write`
# and a 2-rank `gradwire bench allreduce` over verbs, on the same rxe device and sizes. The
# allreduce busbw comes from the time column (bytes/us = MB/s; busbw = algbw at W=2).
# Prints one markdown row per size (medians of REPEATS runs) with the ratios to ib_write_bw.
set -u
SIZES=${SIZES:-"65536 1048576 4194304 16777216"}
BYTES=${BYTES:-67108864}   # data moved per size, tool and repeat (iterations = BYTES / size)
REPEATS=${REPEATS:-3}
DEV=$RXE_DEV; GID=$RXE_GID_INDEX; IP=$RXE_IP
mbs() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.1f", b / s / 1e6 }'; }
echo "| size | ib_write_bw MB/s | gradwire write MB/s | write / ib_write_bw | allreduce busbw MB/s (W=2) | allreduce / ib_write_bw | ib_write_bw -b (both directions) MB/s | allreduce / half of -b |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
# ib_write_bw SIZE ITERS [extra flags]: average MB/s of the client's result row
# ("#bytes #iterations BW_peak BW_average MsgRate"); server in the background, the client
# retries until the server listens.
ibw() {
  timeout 300 ib_write_bw -d "$DEV" -x "$GID" -s "$1" -n "$2" -F $3 >/tmp/ibw.srv 2>&1 &
  srv=$!
  i=0
  while :; do
    timeout 300 ib_write_bw -d "$DEV" -x "$GID" -s "$1" -n "$2" -F $3 "$IP" >/tmp/ibw.cli 2>&1 && break
    i=$((i + 1)); [ $i -ge 40 ] && break; sleep 0.25
  done
  wait $srv
  awk -v s="$1" '$1 == s && NF >= 5 { print $4 }' /tmp/ibw.cli | tail -1
}
median() { printf '%s\n' "$@" | grep -v '^$' | sort -n | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0 && a != "") printf "%.0f %%", 100 * a / b; else print "n/a" }'; }
for s in $SIZES; do
  n=$((BYTES / s)); [ "$n" -lt 20 ] && n=20
  IB= BI= WR= AR=
  # The tools take turns, REPEATS times; each cell is the median (TCG timing is noisy).
  for r in $(seq "$REPEATS"); do
    IB="$IB $(ibw "$s" "$n" "")"
    BI="$BI $(ibw "$s" "$n" "-b")"
    WR="$WR $(gradwire launch -n 2 -- gradwire bench write --transport verbs -b "$s" -e "$s" -n "$n" 2>/dev/null | awk -v s="$s" '$1 == s { print $4 }')"
    AR="$AR $(gradwire launch -n 2 -- gradwire bench allreduce --transport verbs -b "$s" -e "$s" -n "$n" -w 3 2>/dev/null | awk -v s="$s" '$1 == s && $5 > 0 { printf "%.1f", s / $5 }')"
  done
  ib=$(median $IB); bi=$(median $BI); wr=$(median $WR); ar=$(median $AR)
  echo "| $s | ${ib:-n/a} | ${wr:-n/a} | $(ratio "$wr" "$ib") | ${ar:-n/a} | $(ratio "$ar" "$ib") | ${bi:-n/a} | $(ratio "$ar" "$(awk -v b="$bi" 'BEGIN { if (b != "") print b / 2 }')") |"
  [ -n "$ib" ] || { echo "ib_write_bw output:"; cat /tmp/ibw.cli /tmp/ibw.srv; } >&2
done

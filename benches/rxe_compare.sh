#!/usr/bin/env bash
# gradwire over verbs against perftest's ib_write_bw on one soft-RoCE (rxe) device, inside
# the project's QEMU guest (tests/rxe/run-in-vm.sh). Prints the markdown table recorded in
# BENCHMARKS.md. Usage: benches/rxe_compare.sh [SIZES] (default "65536 1048576 4194304 16777216").
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin gradwire >&2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
strip -o "$tmp/gradwire" target/release/gradwire 2>/dev/null || cp target/release/gradwire "$tmp/gradwire"
tests/rxe/run-in-vm.sh -t 1500 -e "SIZES=${1:-65536 1048576 4194304 16777216}" -e "BYTES=${BYTES:-67108864}" -e "REPEATS=${REPEATS:-3}" \
  -f "$tmp/gradwire" -- benches/rxe/in-guest.sh

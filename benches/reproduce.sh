#!/usr/bin/env bash
# The three papers' claims, reproduced on this machine (see REPRODUCTION.md): one command
# per claim, a table and a plot each. With `gradwire train` on the built-in MLP:
#
#   benches/reproduce.sh daso     # DASO vs ssgd: 3 namespace nodes x 2 ranks, 1 Gbit/s links
#   benches/reproduce.sh ddcgu    # ddcgu vs cyclic vs ssgd, rank 1 slowed 3x
#   benches/reproduce.sh bsp      # bsp (K = 4, 16) vs downpour vs eamsgd vs ssgd, 4 nodes at 1 Gbit/s
#
# On PyTorch models through gradwire.torch (benches/torch_reproduce.py; needs torch and
# scikit-learn, whose digits it trains on), against DDP on gloo and on gradwire:
#
#   benches/reproduce.sh torch-daso      # 4 nodes x 2 ranks, 1 Gbit/s, the 10.8 M-parameter MLP
#   benches/reproduce.sh torch-daso-10g  # the same at 10 Gbit/s
#   benches/reproduce.sh torch-bsp       # bsp vs downpour vs eamsgd, 4 nodes x 1 rank, 1 Gbit/s
#   benches/reproduce.sh torch-ddcgu     # ddcgu vs cyclic vs ssgd, conv net, 2 nodes, rank 1 slowed 3x
#
# REPEATS=N runs every scheme N times (torch claims: 3 by default); the table gives the
# median and the spread. Add --record to write the claim's section of REPRODUCTION.md
# (plots, of the first repeat, go to docs/reproduction/).
set -euo pipefail
cd "$(dirname "$0")/.."
claim=${1:?usage: benches/reproduce.sh daso|ddcgu|bsp|torch-daso|torch-daso-10g|torch-bsp|torch-ddcgu [--record]}
record=0
[ "${2:-}" = --record ] && record=1
cargo build --release --bin gradwire --lib >&2
gw=$PWD/target/release/gradwire
out=target/reproduce/$claim
mkdir -p "$out" docs/reproduction
rm -f "$out"/*.csv
case $claim in torch-*) repeats=${REPEATS:-3} ;; *) repeats=${REPEATS:-1} ;; esac
baseline=ssgd
run() { # label, launch args..., --, train args...
  local label=$1; shift
  local launch=() ; while [ "$1" != -- ]; do launch+=("$1"); shift; done; shift
  echo "== $label (repeat $rep): gradwire launch ${launch[*]} -- gradwire train $*" >&2
  "$gw" launch "${launch[@]}" -- "$gw" train --label "$label" --csv "$out/$label.r$rep.csv" "$@" >&2
}
runpy() { # label, launch args..., --, benches/torch_reproduce.py args...
  local label=$1; shift
  local launch=() ; while [ "$1" != -- ]; do launch+=("$1"); shift; done; shift
  echo "== $label (repeat $rep): gradwire launch ${launch[*]} -- python3 benches/torch_reproduce.py $*" >&2
  PYTHONPATH=$PWD/python GRADWIRE_LIB=$PWD/target/release/libgradwire.so GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
    "$gw" launch "${launch[@]}" -- python3 benches/torch_reproduce.py --label "$label" --csv "$out/$label.r$rep.csv" "$@" >&2
}
for rep in $(seq 1 "$repeats"); do
case $claim in
  daso)
    title="DASO vs ssgd: 3 namespace nodes x 2 ranks, links shaped to 1 Gbit/s, MLP 256-512-512-10 (0.4 M parameters) on synthetic:12000:256:10, 8 epochs, batch 16 per rank"
    common=(--data synthetic:12000:256:10 --hidden 512,512 --epochs 8 --batch 16 --lr 0.02)
    net=(-n 6 --netns --ranks-per-node 2 --link-gbit 1)
    run ssgd "${net[@]}" -- --strategy ssgd "${common[@]}"
    run daso "${net[@]}" -- --strategy daso "${common[@]}"
    ;;
  ddcgu)
    title="ddcgu vs cyclic vs ssgd, rank 1 computes 3x slower: 2 ranks (one per core) on shm, MLP 64-256-256-10 on the UCI digits, 12 epochs, batch 32 per rank"
    common=(--data digits --hidden 256,256 --epochs 12 --slow 1:3)
    # Plain SGD everywhere (the servers apply plain SGD steps): the schemes are compared,
    # not the optimizers.
    run ssgd -n 2 -- --strategy ssgd --lr 0.2 --momentum 0 "${common[@]}"
    run cyclic -n 2 -- --strategy cyclic --lr 0.2 "${common[@]}"
    run ddcgu -n 2 -- --strategy ddcgu --lr 0.2 "${common[@]}"
    ;;
  bsp)
    title="bsp vs downpour vs eamsgd vs ssgd: 4 namespace nodes x 1 rank, links shaped to 1 Gbit/s, MLP 64-256-256-10 on the UCI digits, 12 epochs, batch 32 per rank"
    common=(--data digits --hidden 256,256 --epochs 12)
    net=(-n 4 --netns --link-gbit 1)
    run ssgd "${net[@]}" -- --strategy ssgd --lr 0.05 "${common[@]}"
    run bsp-K4 "${net[@]}" -- --strategy bsp --interval 4 --lr 0.05 "${common[@]}"
    run bsp-K16 "${net[@]}" -- --strategy bsp --interval 16 --lr 0.05 "${common[@]}"
    run downpour "${net[@]}" -- --strategy downpour --lr 0.05 "${common[@]}"
    run eamsgd "${net[@]}" -- --strategy eamsgd --lr 0.01 --tau 4 "${common[@]}"
    ;;
  torch-daso|torch-daso-10g)
    gbit=1; [ $claim = torch-daso-10g ] && gbit=10
    epochs=${EPOCHS:-12}; [ $gbit = 10 ] && epochs=${EPOCHS:-24}
    title="PyTorch: DASO vs DDP (gloo, gradwire): 4 namespace nodes x 2 ranks, links shaped to $gbit Gbit/s, MLP 64-4096-2560-10 (10.8 M parameters) on the UCI digits, $epochs epochs, batch 16 per rank, SGD lr 0.02 momentum 0.9"
    baseline=ddp-gloo
    common=(--model wide --epochs "$epochs" --batch 16 --lr 0.02)
    net=(-n 8 --netns --ranks-per-node 2 --link-gbit $gbit)
    runpy ddp-gloo "${net[@]}" -- --scheme ddp --backend gloo "${common[@]}"
    runpy ddp-gradwire "${net[@]}" -- --scheme ddp --backend gradwire "${common[@]}"
    runpy daso "${net[@]}" -- --scheme daso --warmup 2 --cooldown 2 "${common[@]}"
    ;;
  torch-bsp)
    epochs=${EPOCHS:-12}
    title="PyTorch: BSP vs Downpour vs EAMSGD vs DDP (gloo, gradwire): 4 namespace nodes x 1 rank, links shaped to 1 Gbit/s, MLP 64-4096-2560-10 (10.8 M parameters) on the UCI digits, $epochs epochs, batch 32 per rank; every scheme communicates every 4 steps (K, fetch/push, tau)"
    baseline=ddp-gloo
    common=(--model wide --epochs "$epochs")
    net=(-n 4 --netns --link-gbit 1)
    runpy ddp-gloo "${net[@]}" -- --scheme ddp --backend gloo --lr 0.02 "${common[@]}"
    runpy ddp-gradwire "${net[@]}" -- --scheme ddp --backend gradwire --lr 0.02 "${common[@]}"
    runpy bsp-K4 "${net[@]}" -- --scheme bsp --interval 4 --lr 0.02 "${common[@]}"
    runpy downpour "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --lr 0.1 "${common[@]}"
    runpy eamsgd "${net[@]}" -- --scheme eamsgd --tau 4 --lr 0.002 "${common[@]}"
    ;;
  torch-ddcgu)
    epochs=${EPOCHS:-60}
    title="PyTorch: ddcgu vs cyclic vs synchronous SGD (DDP on gradwire), rank 1 computes 3x slower: 2 namespace nodes x 1 rank (one per core: with more ranks than cores the token waits for the scheduler), links shaped to 1 Gbit/s, conv net (0.3 M parameters) on the UCI digits, $epochs epochs, batch 32, plain SGD lr 0.1 everywhere, the servers applying each push's sum"
    common=(--model convnet --epochs "$epochs" --lr 0.1 --slow 1:3)
    net=(-n 2 --netns --link-gbit 1)
    runpy ssgd "${net[@]}" -- --scheme ddp --backend gradwire --momentum 0 "${common[@]}"
    runpy cyclic "${net[@]}" -- --scheme cyclic --rule sum "${common[@]}"
    runpy ddcgu "${net[@]}" -- --scheme ddcgu --rule sum "${common[@]}"
    ;;
  *) echo "unknown claim '$claim' (daso, ddcgu, bsp, torch-daso, torch-daso-10g, torch-bsp, torch-ddcgu)" >&2; exit 2 ;;
esac
done
"$gw" plot -o "docs/reproduction/$claim.svg" "$out"/*.r1.csv
python3 benches/reproduce_table.py "$claim" "$title" "$baseline" "docs/reproduction/$claim.svg" "$out"/*.csv | tee "$out/section.md"
[ $record = 1 ] || exit 0
python3 - "$claim" "$out/section.md" <<'PY'
import sys
claim, sec = sys.argv[1], open(sys.argv[2]).read()
doc = open("REPRODUCTION.md").read()
start, end = f"<!-- {claim}: begin -->", f"<!-- {claim}: end -->"
a, b = doc.index(start) + len(start), doc.index(end)
open("REPRODUCTION.md", "w").write(doc[:a] + "\n" + sec.strip() + "\n" + doc[b:])
PY
echo "reproduce: REPRODUCTION.md ($claim) updated" >&2

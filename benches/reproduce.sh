#!/usr/bin/env bash
# The three papers' claims, reproduced on this machine (see REPRODUCTION.md): one command
# per claim, a table and a plot each. With `gradwire train` on the built-in MLP:
#
#   benches/reproduce.sh daso     # DASO vs ssgd: 3 namespace nodes x 2 ranks, 1 Gbit/s links
#   benches/reproduce.sh ddcgu    # ddcgu vs cyclic vs ssgd, rank 1 slowed 3x
#   benches/reproduce.sh bsp      # bsp (K = 4, 16) vs downpour vs eamsgd vs ssgd, 4 nodes at 1 Gbit/s
#
# On PyTorch models through gradwire.torch (benches/torch_reproduce.py; it trains on the UCI
# digits scikit-learn ships, which this script installs where it is missing), each claim on
# the conv net and the 10.8 M-parameter MLP, against DDP on gloo and on gradwire:
#
#   benches/reproduce.sh torch-daso      # 4 nodes x 2 ranks, 1 Gbit/s: DASO as Heat runs it and tuned
#   benches/reproduce.sh torch-daso-10g  # the same at 10 Gbit/s
#   benches/reproduce.sh torch-bsp       # bsp (dense, top-k, K1=1 K2=4) vs downpour vs eamsgd, 2 nodes x 2 ranks, 1 Gbit/s
#   benches/reproduce.sh torch-bsp-grid  # torch-bsp's learning rates from half to 8x, one seed
#   benches/reproduce.sh torch-bsp-tuned # torch-bsp on the conv net at the grid's best rates
#   benches/reproduce.sh torch-ddcgu     # ddcgu vs cyclic vs DDP, 2 nodes, rank 1 slowed 3x
#
# Every run but DASO's trains on past its epochs until 60 s of training have passed (DASO's
# schedule is fixed by its epochs: they are chosen long enough, and the table flags a run
# shorter than 60 s). REPEATS=N runs every scheme N times (torch claims: 5 by default), repeat r with seed r
# (the model's initial weights and the data order; recorded in the CSVs), the schemes and
# models interleaved so that drift of the machine hits all alike; MODELS="convnet wide"
# chooses the models (convnet-bn, the conv net with BatchNorm, is run by naming it). The table gives the median and the spread. Add --record to keep the
# CSVs in benches/results/reproduction/CLAIM/ and write the claim's section of
# REPRODUCTION.md (plots, of the first repeat, go to docs/reproduction/); --tables
# regenerates the section from the kept CSVs without running anything. RESUME=1 continues a
# run that stopped: a torch run whose CSV is there is kept (remove a failed run's CSV first).
set -euo pipefail
cd "$(dirname "$0")/.."
claim=${1:?usage: benches/reproduce.sh daso|ddcgu|bsp|torch-daso|torch-daso-10g|torch-bsp|torch-bsp-grid|torch-bsp-tuned|torch-ddcgu [--record|--tables]}
record=0 tables_only=0
[ "${2:-}" = --record ] && record=1
[ "${2:-}" = --tables ] && tables_only=1 record=1
kept=benches/results/reproduction/$claim
out=target/reproduce/$claim
cargo build --release --bin gradwire --lib >&2
if [ $tables_only = 1 ]; then
  out=$kept
elif [ "${RESUME:-0}" != 1 ]; then
  rm -rf "$out"
fi
gw=$PWD/target/release/gradwire
mkdir -p "$out" docs/reproduction
case $claim in
  torch-*)
    repeats=${REPEATS:-5}
    python3 -c 'import sklearn' 2>/dev/null || python3 -m pip install --quiet scikit-learn >&2
    ;;
  *) repeats=${REPEATS:-1} ;;
esac
[ $tables_only = 1 ] && repeats=0
min_s=${MIN_SECONDS:-60}  # training time every run but DASO's reaches (a smoke test sets 0)
baseline=ssgd
run() { # label, launch args..., --, train args...
  local label=$1; shift
  local launch=() ; while [ "$1" != -- ]; do launch+=("$1"); shift; done; shift
  echo "== $label (repeat $rep): gradwire launch ${launch[*]} -- gradwire train $*" >&2
  "$gw" launch "${launch[@]}" -- "$gw" train --label "$label" --csv "$out/$label.r$rep.csv" "$@" >&2
}
runpy() { # label, launch args..., --, benches/torch_reproduce.py args... (for $model, seed $rep)
  local label=$1; shift
  local launch=() ; while [ "$1" != -- ]; do launch+=("$1"); shift; done; shift
  mkdir -p "$out/$model"
  if [ "${RESUME:-0}" = 1 ] && [ -s "$out/$model/$label.r$rep.csv" ]; then
    echo "== $label, $model, repeat $rep: kept from the run resumed" >&2
    return
  fi
  echo "== $label, $model, repeat $rep: gradwire launch ${launch[*]} -- python3 benches/torch_reproduce.py --model $model --seed $rep $*" >&2
  PYTHONPATH=$PWD/python GRADWIRE_LIB=$PWD/target/release/libgradwire.so GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
    "$gw" launch "${launch[@]}" -- python3 benches/torch_reproduce.py --model "$model" --seed "$rep" \
    --label "$label" --csv "$out/$model/$label.r$rep.csv" "$@" >&2
}
case $claim in torch-*) models=(${MODELS:-convnet wide}) ;; *) models=(builtin) ;; esac
describe() { # the model's words in a title
  case $1 in
    wide) echo "MLP 64-4096-2560-10 (10.8 M parameters)" ;;
    convnet) echo "conv net (two 3x3 convolutions, 0.3 M parameters)" ;;
    convnet-bn) echo "conv net with BatchNorm (two 3x3 convolutions, each followed by BatchNorm, 0.3 M parameters)" ;;
  esac
}
# Each claim: its title (for $model), baseline, and the schemes of one repeat (run_all).
case $claim in
  daso)
    title="DASO vs ssgd: 3 namespace nodes x 2 ranks, links shaped to 1 Gbit/s, MLP 256-512-512-10 (0.4 M parameters) on synthetic:12000:256:10, 8 epochs, batch 16 per rank"
    run_all() {
      local common=(--data synthetic:12000:256:10 --hidden 512,512 --epochs 8 --batch 16 --lr 0.02)
      local net=(-n 6 --netns --ranks-per-node 2 --link-gbit 1)
      run ssgd "${net[@]}" -- --strategy ssgd "${common[@]}"
      run daso "${net[@]}" -- --strategy daso "${common[@]}"
    }
    ;;
  ddcgu)
    title="ddcgu vs cyclic vs ssgd, rank 1 computes 3x slower: 2 ranks (one per core) on shm, MLP 64-256-256-10 on the UCI digits, 12 epochs, batch 32 per rank"
    run_all() {
      local common=(--data digits --hidden 256,256 --epochs 12 --slow 1:3)
      # Plain SGD everywhere (the servers apply plain SGD steps): the schemes are compared,
      # not the optimizers.
      run ssgd -n 2 -- --strategy ssgd --lr 0.2 --momentum 0 "${common[@]}"
      run cyclic -n 2 -- --strategy cyclic --lr 0.2 "${common[@]}"
      run ddcgu -n 2 -- --strategy ddcgu --lr 0.2 "${common[@]}"
    }
    ;;
  bsp)
    title="bsp vs downpour vs eamsgd vs ssgd: 4 namespace nodes x 1 rank, links shaped to 1 Gbit/s, MLP 64-256-256-10 on the UCI digits, 12 epochs, batch 32 per rank"
    run_all() {
      local common=(--data digits --hidden 256,256 --epochs 12)
      local net=(-n 4 --netns --link-gbit 1)
      run ssgd "${net[@]}" -- --strategy ssgd --lr 0.05 "${common[@]}"
      run bsp-K4 "${net[@]}" -- --strategy bsp --interval 4 --lr 0.05 "${common[@]}"
      run bsp-K16 "${net[@]}" -- --strategy bsp --interval 16 --lr 0.05 "${common[@]}"
      run downpour "${net[@]}" -- --strategy downpour --lr 0.05 "${common[@]}"
      run eamsgd "${net[@]}" -- --strategy eamsgd --lr 0.01 --tau 4 "${common[@]}"
    }
    ;;
  torch-daso|torch-daso-10g)
    gbit=1; [ $claim = torch-daso-10g ] && gbit=10
    # DASO's schedule is fixed by its epochs: enough for 60 s of training on each model.
    epochs_of() { case $1 in convnet*) echo "${EPOCHS:-40}" ;; *) echo "${EPOCHS:-16}" ;; esac; }
    # A DASO epoch of the conv net takes a fifth of DDP's: it needs its own count for 60 s;
    # at 10 Gbit/s DASO's epochs are shorter still, and both models need more of them.
    daso_conv=320 daso_wide=16; [ $gbit = 10 ] && daso_conv=360 daso_wide=20
    daso_epochs_of() { case $1 in convnet*) echo "${DASO_EPOCHS:-$daso_conv}" ;; *) echo "${DASO_EPOCHS:-$daso_wide}" ;; esac; }
    title="PyTorch: DASO vs DDP (gloo, gradwire): 4 namespace nodes x 2 ranks, links shaped to $gbit Gbit/s, MODEL on the UCI digits, EPOCHS epochs for DDP (more where 60 s of training need them), DASOEP for DASO, batch 16 per rank, SGD lr 0.02 momentum 0.9; daso-heat: Heat's defaults (4 warm-up and 4 cool-down epochs, its skips, bf16 parameter average); daso-tuned: 2 + 2 epochs, gradwire's variants (cap_phases, sync_average='change')"
    baseline=ddp-gloo
    run_all() {
      local common=(--epochs "$(epochs_of "$model")" --batch 16 --lr 0.02)
      local net=(-n 8 --netns --ranks-per-node 2 --link-gbit $gbit)
      runpy ddp-gloo "${net[@]}" -- --scheme ddp --backend gloo --min-seconds "$min_s" "${common[@]}"
      runpy ddp-gradwire "${net[@]}" -- --scheme ddp --backend gradwire --min-seconds "$min_s" "${common[@]}"
      local daso=(--epochs "$(daso_epochs_of "$model")" --batch 16 --lr 0.02)
      runpy daso-heat "${net[@]}" -- --scheme daso "${daso[@]}"
      runpy daso-tuned "${net[@]}" -- --scheme daso --warmup 2 --cooldown 2 --daso-variants "${daso[@]}"
    }
    ;;
  torch-bsp)
    epochs_of() { echo "${EPOCHS:-12}"; }
    title="PyTorch: BSP vs Downpour vs EAMSGD vs DDP (gloo, gradwire): 2 namespace nodes x 2 ranks, links shaped to 1 Gbit/s, MODEL on the UCI digits, EPOCHS epochs or more (to 60 s of training), batch 32 per rank; every scheme communicates across the ranks every 4 steps (K2, fetch/push, tau); bsp-K4: the average over all ranks every 4 steps; bsp-K4-topk: the largest 1 % of the change; bsp-K1-K4: also the average inside the node every step; downpour-blocking: Downpour blocking the worker on its fetches and pushes; downpour-async: fetching and pushing on a thread of its own, as Dean et al. run it. Learning rates, one per scheme (torch-bsp-grid runs each at half and twice it): DDP and BSP SGD 0.02 with momentum 0.9 (DDP averages the ranks' gradients, BSP their changes), Downpour 0.1 plain SGD on the servers, EAMSGD 0.002 (its local Nesterov momentum 0.9)"
    baseline=ddp-gloo
    run_all() {
      local common=(--epochs "$(epochs_of "$model")" --min-seconds "$min_s")
      local net=(-n 4 --netns --ranks-per-node 2 --link-gbit 1)
      runpy ddp-gloo "${net[@]}" -- --scheme ddp --backend gloo --lr 0.02 "${common[@]}"
      runpy ddp-gradwire "${net[@]}" -- --scheme ddp --backend gradwire --lr 0.02 "${common[@]}"
      runpy bsp-K4 "${net[@]}" -- --scheme bsp --interval 4 --lr 0.02 "${common[@]}"
      runpy bsp-K4-topk "${net[@]}" -- --scheme bsp --interval 4 --topk 0.01 --lr 0.02 "${common[@]}"
      runpy bsp-K1-K4 "${net[@]}" -- --scheme bsp --interval 4 --node-interval 1 --lr 0.02 "${common[@]}"
      runpy downpour-blocking "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --lr 0.1 "${common[@]}"
      runpy downpour-async "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --background --lr 0.1 "${common[@]}"
      runpy eamsgd "${net[@]}" -- --scheme eamsgd --tau 4 --lr 0.002 "${common[@]}"
    }
    ;;
  torch-bsp-grid)
    # The learning rates torch-bsp uses, tuned: every scheme from half to sixteen times its
    # rate there (Downpour, fastest near the bottom, from a quarter to twice), on seed 0
    # (not one of the recorded repeats), 20 s of training each; asynchronous Downpour 60 s,
    # as it needs about three times the epochs of the blocking form.
    epochs_of() { echo "${EPOCHS:-12}"; }
    min_s=${MIN_SECONDS:-20}
    [ $tables_only = 1 ] || repeats=${REPEATS:-1}
    title="PyTorch: the learning-rate grid of torch-bsp (its setting: 2 namespace nodes x 2 ranks, links shaped to 1 Gbit/s, MODEL on the UCI digits, batch 32 per rank): every scheme from half to sixteen times the rate torch-bsp runs it at (labels end in @lr; Downpour from a quarter to twice), one run each (seed 0, not a recorded repeat), EPOCHS epochs or more to $min_s s of training (asynchronous Downpour to ${ASYNC_MIN_SECONDS:-60} s); ddp-gloo at 0.02 sets the target"
    baseline=ddp-gloo@0.02
    plot_rep=0
    run_all() {
      local rep=0 lr
      local common=(--epochs "$(epochs_of "$model")" --min-seconds "$min_s")
      local slow=(--epochs "$(epochs_of "$model")" --min-seconds "${ASYNC_MIN_SECONDS:-60}")
      local net=(-n 4 --netns --ranks-per-node 2 --link-gbit 1)
      runpy ddp-gloo@0.02 "${net[@]}" -- --scheme ddp --backend gloo --lr 0.02 "${common[@]}"
      for lr in 0.01 0.02 0.04 0.08 0.16 0.32; do
        runpy ddp-gradwire@$lr "${net[@]}" -- --scheme ddp --backend gradwire --lr $lr "${common[@]}"
        runpy bsp-K4@$lr "${net[@]}" -- --scheme bsp --interval 4 --lr $lr "${common[@]}"
        runpy bsp-K4-topk@$lr "${net[@]}" -- --scheme bsp --interval 4 --topk 0.01 --lr $lr "${common[@]}"
        runpy bsp-K1-K4@$lr "${net[@]}" -- --scheme bsp --interval 4 --node-interval 1 --lr $lr "${common[@]}"
      done
      for lr in 0.025 0.05 0.1 0.2; do
        runpy downpour-blocking@$lr "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --lr $lr "${common[@]}"
        runpy downpour-async@$lr "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --background --lr $lr "${slow[@]}"
      done
      for lr in 0.001 0.002 0.004 0.008 0.016 0.032; do
        runpy eamsgd@$lr "${net[@]}" -- --scheme eamsgd --tau 4 --lr $lr "${common[@]}"
      done
    }
    ;;
  torch-bsp-tuned)
    # torch-bsp on the conv net, every scheme at the rate torch-bsp-grid found fastest to
    # its target there among the rates whose run still held the target at its end (at
    # sixteen times torch-bsp's rate DDP, BSP and EAMSGD diverge after touching it); on the
    # MLP no rate of that grid changes which scheme is ahead.
    epochs_of() { echo "${EPOCHS:-12}"; }
    models=(${MODELS:-convnet})
    tuned_ddp=0.08 tuned_bsp=0.16 tuned_downpour=0.1 tuned_eamsgd=0.016
    title="PyTorch: torch-bsp with the learning rates of torch-bsp-grid: 2 namespace nodes x 2 ranks, links shaped to 1 Gbit/s, MODEL on the UCI digits, EPOCHS epochs or more (to 60 s of training), batch 32 per rank; every scheme at the rate of torch-bsp-grid that reached the grid's target first and still held it at the run's end (labels end in @lr): DDP (gloo and gradwire) SGD $tuned_ddp and BSP SGD $tuned_bsp, with momentum 0.9, blocking and asynchronous Downpour $tuned_downpour plain SGD on the servers, EAMSGD $tuned_eamsgd"
    baseline=ddp-gloo@$tuned_ddp
    run_all() {
      local common=(--epochs "$(epochs_of "$model")" --min-seconds "$min_s")
      local net=(-n 4 --netns --ranks-per-node 2 --link-gbit 1)
      local d=$tuned_ddp b=$tuned_bsp p=$tuned_downpour e=$tuned_eamsgd
      runpy ddp-gloo@$d "${net[@]}" -- --scheme ddp --backend gloo --lr $d "${common[@]}"
      runpy ddp-gradwire@$d "${net[@]}" -- --scheme ddp --backend gradwire --lr $d "${common[@]}"
      runpy bsp-K4@$b "${net[@]}" -- --scheme bsp --interval 4 --lr $b "${common[@]}"
      runpy bsp-K4-topk@$b "${net[@]}" -- --scheme bsp --interval 4 --topk 0.01 --lr $b "${common[@]}"
      runpy bsp-K1-K4@$b "${net[@]}" -- --scheme bsp --interval 4 --node-interval 1 --lr $b "${common[@]}"
      runpy downpour-blocking@$p "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --lr $p "${common[@]}"
      runpy downpour-async@$p "${net[@]}" -- --scheme downpour --fetch 4 --push 4 --background --lr $p "${common[@]}"
      runpy eamsgd@$e "${net[@]}" -- --scheme eamsgd --tau 4 --lr $e "${common[@]}"
    }
    ;;
  torch-ddcgu)
    # An epoch of the MLP under DDP takes about 30 s here (43 MB a step over 1 Gbit/s, the
    # slowed rank): 3 of them pass 60 s, and every run trains at least that long anyway.
    epochs_of() { case $1 in wide) echo "${EPOCHS:-3}" ;; *) echo "${EPOCHS:-60}" ;; esac; }
    title="PyTorch: ddcgu vs cyclic vs synchronous SGD (DDP on gloo and on gradwire), rank 1 computes 3x slower: 2 namespace nodes x 1 rank (one per core: with more ranks than cores the token waits for the scheduler), links shaped to 1 Gbit/s, MODEL on the UCI digits, EPOCHS epochs or more (to 60 s of training), batch 32, plain SGD; the servers apply each push's sum at lr 0.1 (one step per minibatch, as sequential SGD takes), DDP averages 2 ranks' gradients at the scaled rate 0.2, so every scheme moves the same distance per minibatch"
    baseline=ddp-gloo
    run_all() {
      local common=(--epochs "$(epochs_of "$model")" --min-seconds "$min_s" --slow 1:3)
      local net=(-n 2 --netns --link-gbit 1)
      runpy ddp-gloo "${net[@]}" -- --scheme ddp --backend gloo --momentum 0 --lr 0.2 "${common[@]}"
      runpy ddp-gradwire "${net[@]}" -- --scheme ddp --backend gradwire --momentum 0 --lr 0.2 "${common[@]}"
      runpy cyclic "${net[@]}" -- --scheme cyclic --rule sum --lr 0.1 "${common[@]}"
      runpy ddcgu "${net[@]}" -- --scheme ddcgu --rule sum --lr 0.1 "${common[@]}"
    }
    ;;
  *) echo "unknown claim '$claim' (daso, ddcgu, bsp, torch-daso, torch-daso-10g, torch-bsp, torch-bsp-grid, torch-bsp-tuned, torch-ddcgu)" >&2; exit 2 ;;
esac
# Interleaved: every scheme and model once per repeat, repeat after repeat.
for rep in $(seq 1 "$repeats"); do
  for model in "${models[@]}"; do run_all; done
done
if [ $record = 1 ] && [ $tables_only = 0 ]; then
  # The runs of the models run now replace those kept; other models' kept runs stay.
  mkdir -p "$kept"
  if [ "${models[*]}" = builtin ]; then
    rm -f "$kept"/*.csv && cp "$out"/*.csv "$kept"/
  else
    for model in "${models[@]}"; do rm -rf "${kept:?}/$model" && cp -r "$out/$model" "$kept/"; done
  fi
  out=$kept
fi
if [ $record = 1 ] && [ "${models[*]}" != builtin ]; then
  # The section covers every model with kept runs.
  models=()
  for d in "$out"/*/; do [ -d "$d" ] && models+=("$(basename "$d")"); done
fi
sections=()
for model in "${models[@]}"; do
  dir=$out; name=$claim; t=$title
  if [ "$model" != builtin ]; then
    dir=$out/$model; name=$claim-$model; t=${title/MODEL/$(describe "$model")}; t=${t/EPOCHS/$(epochs_of "$model")}
    declare -F daso_epochs_of >/dev/null && t=${t/DASOEP/$(daso_epochs_of "$model")}
  fi
  ls "$dir"/*.csv >/dev/null 2>&1 || { echo "reproduce: no runs in $dir" >&2; exit 1; }
  "$gw" plot -o "docs/reproduction/$name.svg" "$dir"/*.r"${plot_rep:-1}".csv
  python3 benches/reproduce_table.py "$name" "$t" "$baseline" "docs/reproduction/$name.svg" "$dir"/*.r*.csv > "target/reproduce-$name.md"
  sections+=("target/reproduce-$name.md")
done
cat "${sections[@]}" | tee "target/reproduce-$claim.section.md"
[ $record = 1 ] || exit 0
python3 - "$claim" "target/reproduce-$claim.section.md" <<'PY'
import sys
claim, sec = sys.argv[1], open(sys.argv[2]).read()
doc = open("REPRODUCTION.md").read()
start, end = f"<!-- {claim}: begin -->", f"<!-- {claim}: end -->"
a, b = doc.index(start) + len(start), doc.index(end)
open("REPRODUCTION.md", "w").write(doc[:a] + "\n" + sec.strip() + "\n" + doc[b:])
PY
echo "reproduce: REPRODUCTION.md ($claim) updated" >&2

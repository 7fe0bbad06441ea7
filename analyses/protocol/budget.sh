#!/usr/bin/env bash
# Issue 43, part 2: a 4x budget at block 15 of SmolLM2-135M-Instruct. The five methods of the protocol
# (study.sh's four and the standardised gate), parameter-matched, K = 32, at the rates the sweep chose at
# block 15 (every method 2e-3), trained for 8,192 steps of 512 tokens: 2 epochs over a 2,097,152-token
# cache of block 15 (64 shards), checkpoints every 1,024 steps, all kept. Then every checkpoint is
# evaluated on BBC News (out of domain; the final layers on the held-out mix too, by `train`), and KL
# against training tokens is drawn.
# One step per call, each resumable (rerun the same command):
#   bash analyses/protocol/budget.sh cache   # the cache (results/cache-mix7-l15-2m): ~95 min on 2 cores
#                                            # (study.sh's cache, 552,704 tokens to block 25, took 40)
#   bash analyses/protocol/budget.sh train   # ~2.5 h on 2 cores: resumable, but only within a session here
#   bash analyses/protocol/budget.sh curve   # each checkpoint on BBC (~5 min each) -> the table and plot
# Results: docs/results/protocol/budget/ (keep.sh budget commits the frontier files as they come).
# The whole 4x run (~5 h) does not fit one 3-hour session of this machine, whose results/ is wiped between
# sessions. SCALE=1x runs the protocol's own budget (2,048 steps over the 524,288-token block-15 cache, 1.9
# epochs: study.sh's rows) with a checkpoint every 256 steps: KL against training tokens up to the budget the
# headline uses, ~2 h at 1 thread beside another job (results/protocol-budget-1x, docs/results/protocol/budget-1x).
# CURVE_STEPS="256 512 1024" evaluates only those checkpoints (default: all); the final layers are evaluated
# by `train` on both texts and join the curve at the last step.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEP=${1:?give cache, train or curve}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
case ${SCALE:=4x} in
  4x) TOKENS=2097152 EVERY=1024 CACHE=${CACHE:-results/cache-mix7-l15-2m} OUT=results/protocol-budget ;;
  1x) TOKENS=524288 EVERY=256 CACHE=${CACHE:-results/cache-mix7-l15} OUT=results/protocol-budget-1x ;;
  *) echo "SCALE=$SCALE: give 4x or 1x" >&2; exit 2 ;;
esac
DEST=docs/results/protocol/${OUT#results/protocol-}
STD=mxd:gate=topk,gate_standardize=0.1
ARCHS=(mxd mxd:gate=topk $STD transcoder skip_transcoder)
COMMON=(--progress false --text results/data/mix7.txt.xz --eval-fraction 0.05 --train-tokens $TOKENS
        --cache-dtype float16 --cache "$CACHE" --blocks 15 --ks 32)
case $STEP in
  cache) exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --out $OUT --cache-only true ;;
  train)
    exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --epochs 2 --checkpoint-every $EVERY --keep-checkpoints 8 \
        --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz --ood-eval-tokens 32768 \
        --archs "${ARCHS[@]}" --arch-lr $(printf '%s=0.002 ' "${ARCHS[@]}") --out $OUT ;;
  curve)
    mkdir -p $DEST
    for ckpt in $OUT/runs/L15.seed0/checkpoints/step_*/; do
      [ -f $ckpt/evaluated ] && continue  # done before (the results are in its layers' cfg.json)
      step=$(basename $ckpt); step=$((10#${step#step_}))
      [ -z "${CURVE_STEPS:-}" ] || [[ " $CURVE_STEPS " == *" $step "* ]] || continue
      .venv/bin/mxd-lens eval $ckpt --text $DATA/probing/topic_bbc_news.jsonl.xz --split all --eval-tokens 32768
      touch $ckpt/evaluated
    done
    .venv/bin/python analyses/protocol/budget_curve.py $DEST --run $OUT/runs/L15.seed0 ;;
  *) echo "unknown step $STEP: give cache, train or curve" >&2; exit 2 ;;
esac

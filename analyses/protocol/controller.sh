#!/usr/bin/env bash
# The usage controller on the study's setting (block 15, K = 32, seed 0, lr 2e-3, 2,048 steps, the same
# evaluation as study.sh): does balance_rate = 1e-3 turn the plain gate's always-on experts back into
# token-specific ones, and at what cost in fit? Resumable; results in results/protocol-A2.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
exec .venv/bin/mxd-lens frontier --progress false --text results/data/mix7.txt.xz \
    --eval-fraction 0.05 --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz \
    --ood-eval-tokens 32768 --train-tokens 524288 --epochs 2 --cache-dtype float16 \
    --cache results/cache-mix7 --blocks 15 --ks 32 \
    --archs mxd:balance_rate=0.001,gate=topk mxd:balance_rate=0.001 --lr 0.002 --out results/protocol-A2

#!/usr/bin/env bash
# MxD with the standardised gate (gate_standardize, mxd_lens/layers/mxd.py) at study A's point (block 15,
# K = 32, seed 0, 2,048 steps, the protocol's evaluation in and out of domain): does the TopK over z-scores
# break the always-on core that the plain TopK gate keeps (30 of 32 experts on > 50% of tokens)?
# Compare with docs/results/protocol/A's L15.seed0 rows. Resumable: rerun the same command.
#   bash docs/results/protocol/standardize.sh    # results/protocol-A3 (needs cache.sh's cache)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
exec .venv/bin/python analyses/frontier.py --progress false --text results/data/mix7.txt.xz \
    --eval-fraction 0.05 --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz \
    --ood-eval-tokens 32768 --train-tokens 524288 --epochs 2 --cache-dtype float16 \
    --cache results/cache-mix7 --blocks 15 --ks 32 \
    --archs mxd:gate=topk,gate_standardize=0.1 mxd:gate=topk,gate_standardize=0.01 --lr 0.002 \
    --out results/protocol-A3

#!/usr/bin/env bash
# The two-book frontier (docs/results.md, "The earlier frontier"): block 15 at K = 8-128, block 15 K = 32
# seed 1 and blocks 5 and 25 at K = 32, the three methods parameter-matched, 6,287 steps of 512 tokens
# (3 epochs), trained before gradient clipping existed (--grad-clip none); then the K = 8 MxD point again
# with clipping (results/frontier-v2-clip). ~4 hours of training and ~60 min of evaluation here.
# Text: text.sh; its own cache of blocks 5, 15, 25 (the later runs share results/cache-frontier). Raw
# rows copied to docs/results/frontier-v2 and -v2-clip; report.sh draws the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
COMMON=(--progress false --text results/data/austen_bible_mixed.txt.xz --eval-fraction 0.05 --eval-tokens 51200
        --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 --cache results/cache-frontier-v2)
.venv/bin/mxd-lens frontier "${COMMON[@]}" --blocks 15 --ks 8 16 32 64 128 --grid 15:32@1 5:32 25:32 \
    --out results/frontier-v2 --grad-clip none
.venv/bin/mxd-lens frontier "${COMMON[@]}" --blocks 15 --ks 8 --archs mxd --out results/frontier-v2-clip

#!/usr/bin/env bash
# issue 11 (started session 9): block 15, K=16 and 64, seed 0, clipped: the other probing layers.
# Same cache and recipe as frontier-v4; resumable (checkpoints under OUT/runs; rerun this script).
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec nice -n 5 .venv/bin/mxd-lens frontier --progress false --text results/data/austen_bible_mixed.txt.xz \
    --eval-fraction 0.05 --eval-tokens 51200 --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 \
    --blocks 15 --ks 16 64 --out results/frontier-v5 --cache results/cache-frontier

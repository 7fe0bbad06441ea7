#!/usr/bin/env bash
# issue 11 (session 10): block 25 at K = 32, seed 0, clipped (the headline's third block). Same text,
# recipe and evaluation as frontier-v3/v4; the cache holds blocks 15 and 25 (one forward through 25
# blocks writes both; block 15's serves benchmarks/stability.py). Resumable (checkpoints under OUT/runs).
# THREADS (default 1) torch threads.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-1}
exec nice -n 5 .venv/bin/mxd-lens frontier --progress false --text results/data/austen_bible_mixed.txt.xz \
    --eval-fraction 0.05 --eval-tokens 51200 --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 \
    --blocks 25 --ks 32 --out results/frontier-v6 --cache results/cache-frontier "$@"

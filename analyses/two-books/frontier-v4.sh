#!/usr/bin/env bash
# issue 11 (session 9): block 15, K=32, seed 0, clipped (the layers the probing and steering rerun uses;
# its evaluation replaces the unclipped seed-0 row of frontier-v2). One torch thread: the SPD trend run
# shares the machine. Resumable (checkpoints under OUT/runs).
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
exec nice -n 5 .venv/bin/mxd-lens frontier --progress false --text results/data/austen_bible_mixed.txt.xz \
    --eval-fraction 0.05 --eval-tokens 51200 --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 \
    --blocks 15 --ks 32 --out results/frontier-v4 --cache results/cache-frontier

#!/usr/bin/env bash
# issue 11 (session 10): the activation cache of blocks 15 and 25 (one forward through 25 blocks),
# shared by frontier-v6 (block 25) and benchmarks/stability.py (block 15). Two torch threads.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
exec .venv/bin/mxd-lens frontier --progress false --text results/data/austen_bible_mixed.txt.xz \
    --eval-fraction 0.05 --eval-tokens 51200 --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 \
    --blocks 15 25 --ks 32 --out results/frontier-v6 --cache results/cache-frontier --cache-only true

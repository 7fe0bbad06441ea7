#!/usr/bin/env bash
# issue 11 remainder (session 8): layer 5 at K=32, then layer 15 seed 1 (layer 25 next session); resumable.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
exec nice -n 5 .venv/bin/mxd-lens frontier --progress false --text results/data/austen_bible_mixed.txt.xz \
    --eval-fraction 0.05 --eval-tokens 51200 --train-tokens 1048576 --epochs 3.07 --cache-dtype float16 \
    --blocks 5 --ks 32 --grid 15:32@1 --out results/frontier-v3 --cache results/cache-frontier

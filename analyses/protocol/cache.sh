#!/usr/bin/env bash
# The protocol's activation cache: blocks 5, 15, 25 of SmolLM2-135M-Instruct (one forward through 26 blocks
# writes all three) on 524,288 tokens of the train side of results/data/mix7.txt.xz (data.sh), float16
# (~3.6 GB). Resumable: rerun to finish or check it. THREADS (default 2) torch threads.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
# jemalloc keeps freed buffers (glibc returns those over 32 MB to the kernel and page-faults them back)
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
exec .venv/bin/mxd-lens frontier --progress false --text results/data/mix7.txt.xz \
    --eval-fraction 0.05 --train-tokens 524288 --cache-dtype float16 \
    --blocks 5 15 25 --ks 32 --out results/protocol --cache results/cache-mix7 --cache-only true

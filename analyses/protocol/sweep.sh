#!/usr/bin/env bash
# The lr / gate sweep (sweep.py's docstring), resumable; then its tables are copied here for the commit.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
.venv/bin/python analyses/protocol/sweep.py results/protocol-sweep results/cache-mix7 && \
    cp results/protocol-sweep/sweep.csv results/protocol-sweep/sweep.md docs/results/protocol/

#!/usr/bin/env bash
# Everything issue 27's study still needs, in order, in the background, resumable (rerun the same command
# after a reset: each step skips or resumes what is done). About 3-4 hours on 2 CPU cores.
#   nohup bash docs/results/protocol/rest.sh > results/rest.log 2>&1 &
# 1. the text and the cache (data.sh, cache.sh; ~40 min on a new machine)
# 2. A3: the standardised gate at study A's point; A0: study A's seed-0 layers again (for probing)
# 3. probing of those layers under both protocols with the neuron baseline (probe.sh)
# 4. C: block 15 at K = 16 and 64; the independent check of the A3 layers
# 5. the steering sweep on the A0 layers and the standardised-gate MxD (steer.sh)
# 6. D: the standardised gate at blocks 5 and 25 and block 15's second seed
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p ../../../results
[ -f ../../../results/data/mix7.txt.xz ] || bash data.sh
bash cache.sh
bash chain.sh A3 A0
bash probe.sh
bash chain.sh C
# the independent check of the A3 layers (skipped once it holds both texts)
grep -q "^BBC News" A3/check-L15.seed0.txt 2>/dev/null || (cd ../../.. && HF_HUB_OFFLINE=1 \
    .venv/bin/python docs/results/protocol/check.py results/protocol-A3/runs/L15.seed0/final \
    > docs/results/protocol/A3/check-L15.seed0.txt)
bash steer.sh
bash chain.sh D

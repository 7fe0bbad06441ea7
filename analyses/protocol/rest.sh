#!/usr/bin/env bash
# What issue 27's study still needs after a reset, in order, in the background, resumable (rerun the same
# command: each step skips or resumes what is done). About 2-3 hours on 2 CPU cores.
#   nohup bash analyses/protocol/rest.sh > results/rest.log 2>&1 &
# 1. the text and the cache (data.sh, cache.sh; ~40 min on a new machine)
# 2. S: study A's seed-0 layers and the standardised-gate MxD at block 15, K = 32 (what steer.sh reads)
# 3. the steering sweep on them (steer.sh)
# Parts A0, A3, C, D, the probing (probe.sh) and the independent check (check.py) ran before; their
# results are committed under docs/results/protocol/ and each is rerun by the command its script names.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p ../../results
[ -f ../../results/data/mix7.txt.xz ] || bash data.sh
bash cache.sh
bash chain.sh S
bash steer.sh

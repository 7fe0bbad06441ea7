#!/usr/bin/env bash
# The steering sweep (docs/results.md, "Steering with these layers") on study A's block-15 K = 32 seed-0 layers
# and the standardised-gate MxD, all five trained by `study.sh S` (results/protocol-S; the same configs as
# A0 and A3): each task's top probing feature per layer, steered at 0-128x its largest activation, scored
# offline; reuses probe.sh's pooled activations when they are there. The small outputs are committed into
# docs/results/protocol/A-steer. THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
RUN=${RUN_TREE:-$PWD/../study-run}; [ -d "$RUN" ] && export PYTHONPATH=$RUN
LAYERS=results/protocol-S/runs/L15.seed0/final
.venv/bin/mxd-lens steer --layers $LAYERS --k 32 \
    --tasks language_id/fr code_language/python bbc_news/sports fortunes_set2/startrek \
    --data ${DATA:-../shared/data}/probing --probing results/protocol-A-probe/probing/pooled \
    --threads ${THREADS:-2} --out results/protocol-A-steer
DEST=docs/results/protocol/A-steer
mkdir -p $DEST
cp results/protocol-A-steer/steering/*.csv results/protocol-A-steer/steering/*.json \
   results/protocol-A-steer/steering/*.png $DEST/ 2>/dev/null || true
git add $DEST && git commit -q -m "protocol study: steering sweep on study A's layers" -- $DEST || true

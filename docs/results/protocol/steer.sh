#!/usr/bin/env bash
# The steering sweep (docs/results.md, "Steering with one feature") on study A's block-15 K = 32 seed-0 layers
# (results/protocol-A0) and the standardised-gate MxD of results/protocol-A3 (gathered as links in
# results/protocol-A-steer-layers): each task's top probing feature per layer, steered at 0-128x its largest activation,
# scored offline; reuses probe.sh's pooled activations. The small outputs are committed into
# docs/results/protocol/A-steer. THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1
RUN=${RUN_TREE:-$PWD/../study-run}; [ -d "$RUN" ] && export PYTHONPATH=$RUN
LAYERS=results/protocol-A-steer-layers
mkdir -p $LAYERS
for L in results/protocol-A0/runs/L15.seed0/final/L15.* \
         results/protocol-A3/runs/L15.seed0/final/L15.mxd-gate=topk-gate_standardize=0.1.*; do
  [ -d "$L" ] && ln -sfn "$PWD/$L" "$LAYERS/$(basename "$L")"
done
.venv/bin/mxd-lens steer --layers $LAYERS --k 32 \
    --tasks language_id/fr code_language/python bbc_news/sports fortunes_set2/startrek \
    --data ${DATA:-../shared/data}/probing --probing results/protocol-A-probe/probing/pooled \
    --threads ${THREADS:-2} --out results/protocol-A-steer
DEST=docs/results/protocol/A-steer
mkdir -p $DEST
cp results/protocol-A-steer/steering/*.csv results/protocol-A-steer/steering/*.json \
   results/protocol-A-steer/steering/*.png $DEST/ 2>/dev/null || true
git add $DEST && git commit -q -m "protocol study: steering sweep on study A's layers" -- $DEST || true

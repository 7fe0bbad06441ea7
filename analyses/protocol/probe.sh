#!/usr/bin/env bash
# Probing of study A's block-15 K = 32 layers (seed 0: results/protocol-A0, and the standardised-gate MxD
# of results/protocol-A3) on the 38 offline tasks, under both protocols (SAEBench's k in {1, 2, 5} chosen
# on train; the paper's k = 1 best-of-100 chosen on test, and the same chosen on validation), with the
# host MLP's hidden neurons as a baseline. The small outputs are committed into docs/results/protocol/A-probe.
# Resumable (the pooled activations are cached). THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
RUN=${RUN_TREE:-$PWD/../study-run}; [ -d "$RUN" ] && export PYTHONPATH=$RUN
LAYERS=(results/protocol-A0/runs/L15.seed0/final)
[ -d results/protocol-A3/runs/L15.seed0/final ] && LAYERS+=(results/protocol-A3/runs/L15.seed0/final)
.venv/bin/mxd-lens probe --layers "${LAYERS[@]}" --data ${DATA:-../shared/data}/probing --ks 1 2 5 \
    --protocols saebench paper paper_val --neurons true --threads ${THREADS:-2} --out results/protocol-A-probe
DEST=docs/results/protocol/A-probe
mkdir -p $DEST
cp results/protocol-A-probe/probing/*.csv results/protocol-A-probe/probing/*.json \
   results/protocol-A-probe/probing/*.png $DEST/ 2>/dev/null || true
git add $DEST && git commit -q -m "protocol study: probing of study A's layers under both protocols, neurons as a baseline" -- $DEST || true

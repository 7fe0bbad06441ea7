#!/usr/bin/env bash
# The SVD-basis control on SmolLM2-135M-Instruct's blocks.27.mlp.W_out (docs/results.md, "SVD basis +
# learned CI"): C = 576 rank-1 components from the SVD, 400 steps, the top concept component ablated
# against norm-matched random ones. One torch thread. Outputs in results/spd-ablation/, copied to
# docs/results/spd/spd-ablation* (spd/metrics.json as spd-ablation-train-metrics.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
OUT=results/spd-ablation DEST=docs/results/spd
.venv/bin/mxd-lens spd-ablation --data ${DATA:-../shared/data} --threads 1 --out $OUT
for f in decomposition scores ablation by_ci; do cp $OUT/$f.json $DEST/spd-ablation-$f.json; done
cp $OUT/ablation.png $DEST/spd-ablation.png
cp $OUT/spd/metrics.json $DEST/spd-ablation-train-metrics.json

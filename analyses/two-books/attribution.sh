#!/usr/bin/env bash
# Attribution through the spliced layers (docs/results.md, "Attribution"): each method's K = 32 layers of
# the two-book frontier (frontier-v3.sh: block 5 seed 0, block 15 seed 1) spliced at blocks 5 and 15, six
# prompts. 33 s here. The table (CSV/JSON) and per method the first prompt's graph.png and report.html are
# copied to docs/results/attribution-study/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
.venv/bin/mxd-lens attribution --layers results/frontier-v3/runs/L5.seed0/final \
    results/frontier-v3/runs/L15.seed1/final --k 32 --blocks 5 15 --out results/attribution-study
DEST=docs/results/attribution-study
mkdir -p $DEST
cp results/attribution-study/attribution_study.csv results/attribution-study/attribution_study.json $DEST/
for m in mxd skip_transcoder transcoder; do
  mkdir -p $DEST/$m && cp results/attribution-study/$m/graph.png results/attribution-study/$m/report.html $DEST/$m/
done

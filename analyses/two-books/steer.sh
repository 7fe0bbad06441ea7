#!/usr/bin/env bash
# Steering with one feature (docs/results.md, "Steering with one feature"): the probing layers (probe.sh's
# pooled activations pick each task's feature) at K = 32 (29 min, one thread), 16 and 64 (34 and 35 min,
# two threads); then the top-activating contexts of the MxD experts steered at K = 32. Outputs copied to
# docs/results/steering, steering-k16, steering-k64 and inspect. $DATA: default ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
DATA=${DATA:-../shared/data}
D=$DATA/probing
TASKS=(language_id/fr code_language/python bbc_news/sports fortunes_set2/startrek)
.venv/bin/mxd-lens steer --layers results/frontier-v4/runs/L15.seed0/final --k 32 --tasks "${TASKS[@]}" \
    --data $D --probing results/v2/probing/pooled --threads 1 --out results/v2
cp results/v2/steering/steering.* docs/results/steering/
for K in 16 64; do
  .venv/bin/mxd-lens steer --layers results/frontier-v5/runs/L15.seed0/final --k $K --tasks "${TASKS[@]}" \
      --data $D --probing results/v3/probing/pooled --threads 2 --out results/v3-k$K
  cp -r results/v3-k$K/steering/. docs/results/steering-k$K/
done
.venv/bin/mxd-lens inspect --layer results/frontier-v4/runs/L15.seed0/final/L15.mxd.k32.m8 \
    --from-steering results/v2/steering/steering.csv --text $D/language_id.jsonl.xz $D/code_language.jsonl.xz \
    $D/topic_bbc_news.jsonl.xz $D/topic_fortunes_en.jsonl.xz $DATA/corpus --tokens 40960 --n 12 \
    --threads 1 --out results/v2
cp results/v2/inspect/L15.mxd.k32.m8.* docs/results/inspect/

#!/usr/bin/env bash
# Sparse probing on 38 offline tasks (docs/results.md, "Sparse probing on 38 offline tasks"): the two-book
# frontier's block-15 layers at K = 32 (frontier-v4.sh) and K = 16, 64 (frontier-v5.sh), SAEBench's
# protocol, k = 1, 2, 5; the runs joined and copied to docs/results/probing/; then the independent check
# (check_probing.py, 5-fold CV) into docs/results/probing-v2/. $DATA: default ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
DATA=${DATA:-../shared/data}
.venv/bin/mxd-lens probe --layers results/frontier-v4/runs/L15.seed0/final --data $DATA/probing --ks 1 2 5 \
    --threads 1 --out results/v2
.venv/bin/mxd-lens probe --layers results/frontier-v5/runs/L15.seed0/final --data $DATA/probing --ks 1 2 5 \
    --threads 2 --out results/v3
# (the first run merged the K = 32 copy then in docs/results/probing)
.venv/bin/mxd-lens probe-merge results/v2/probing results/v3/probing --out results/v3/merged
cp results/v3/merged/*.csv results/v3/merged/*.json results/v3/merged/*.png docs/results/probing/
PY=.venv/bin/python
$PY analyses/two-books/check_probing.py results/v2/probing/pooled $DATA/probing > docs/results/probing-v2/check_probing.txt
{ $PY analyses/two-books/check_probing.py results/v3/probing/pooled $DATA/probing 16
  $PY analyses/two-books/check_probing.py results/v3/probing/pooled $DATA/probing 64; } \
    > docs/results/probing-v2/check_probing-k16-k64.txt

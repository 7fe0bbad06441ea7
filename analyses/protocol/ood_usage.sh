#!/usr/bin/env bash
# Issue 43, part 4: fit and usage (always on, effective, silent) of a part's layers on a second text far
# from the training mix: source code (the probing data's code_language: C, Go, Python, ...; none of the
# seven corpora is code), every document held out, 32,768 tokens. The table goes to
# docs/results/protocol/PART/ood-code.txt (the layers' cfg.json also record it).
#   bash analyses/protocol/ood_usage.sh R5 R25
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
DATA=${DATA:-../shared/data}
for PART in "$@"; do
  mkdir -p docs/results/protocol/$PART
  .venv/bin/mxd-lens eval results/protocol-$PART/runs/*/final --text $DATA/probing/code_language.jsonl.xz \
      --split all --eval-tokens 32768 | tee docs/results/protocol/$PART/ood-code.txt
done

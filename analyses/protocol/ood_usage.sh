#!/usr/bin/env bash
# Issue 43, part 4: fit and usage (always on, effective, silent) of a part's layers on a second text far
# from the training mix: source code (the probing data's code_language: C, Go, Python, ...; none of the
# seven corpora is code), every document held out, 32,768 tokens. The table goes to
# docs/results/protocol/PART/ood-code.txt (the layers' cfg.json also record it).
#   bash analyses/protocol/ood_usage.sh R5 R25
# Gemma's parts by their folder (results/gemma-G9 -> docs/results/protocol/gemma/G9); RUNS picks the groups
# (default every one; RUNS=L9.seed0 for one seed: ~15 min for five Gemma layers):
#   RUNS=L9.seed0 bash analyses/protocol/ood_usage.sh gemma/G9
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
DATA=${DATA:-../shared/data}
for PART in "$@"; do
  case $PART in gemma/*) SRC=results/gemma-${PART#gemma/} ;; *) SRC=results/protocol-$PART ;; esac
  mkdir -p docs/results/protocol/$PART
  .venv/bin/mxd-lens eval $SRC/runs/${RUNS:-*}/final --text $DATA/probing/code_language.jsonl.xz \
      --split all --eval-tokens 32768 | tee docs/results/protocol/$PART/ood-code.txt
done

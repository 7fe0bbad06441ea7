#!/usr/bin/env bash
# One short call on a GPU machine (the `device` tool; never needed: everything runs on CPU too): the
# reference recipe's SPD of the toy induction model at CI hidden 128 (the paper's), ref-token-subset, for
# WALL seconds (default 420), keeping its resumable state every 1,000 steps in
# results/spd-ref-kept/ref-token-subset-gpu/ (copied to $OUT when set, to bring back; binary state is never
# committed). It decomposes the toy model the CPU run trains (results/spd-ref/model/model.pt), so both share it.
# A second call resumes from the kept state (on a GPU: the mask generator's state is per device type).
#   bash benchmarks/spd_gpu.sh            # then: bash analyses/spd/ref-report.sh reports a kept run
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
PY=${PY:-.venv/bin/python}; [ -x "$PY" ] || PY=python
MODEL=results/spd-ref/model/model.pt
KEEP=results/spd-ref-kept/ref-token-subset-gpu
"$PY" - <<'PY' || { echo "no CUDA device: this script is for a GPU machine" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
[ -f $MODEL ] || { echo "$MODEL is missing: run analyses/spd/ref-run.sh first (it trains the model)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
timeout "${WALL:-420}" "$PY" -m mxd_lens.cli spd-induction train --variant ref-token-subset --steps 100000 \
    --trend-every 1000 --keep-in $KEEP --model $MODEL --device cuda --out results/spd-gpu
echo "exit $? (124: the wall time ran out, as planned); kept step:"
cat $KEEP/checkpoint/trainer_state.json 2>/dev/null | head -3
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp -r $KEEP "$OUT/"; fi

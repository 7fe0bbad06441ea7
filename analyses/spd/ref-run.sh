#!/usr/bin/env bash
# The reference-recipe SPD run of the toy induction model (docs/results.md, "SPD of the reference toy
# model"): ref-token-subset at CI hidden 16, scheduled for STEPS (default 100,000) steps, trained in
# sittings of SITTING (default 5,000) steps. After every 1,000 steps the resumable state (checkpoint,
# model, trend, logs; a few MB) is kept in KEEP (default results/spd-ref-kept/VARIANT-h16/; binary state is
# never committed, so point KEEP at storage that outlives the machine if the machine may vanish). Rerun
# the same command to resume. On a fresh clone it first trains the toy model (~45 min), then the run from
# step 0 (a sitting took 11-16 min here). ref-report.sh reports the kept run into docs/results/spd/.
#   nohup bash analyses/spd/ref-run.sh > results/spd-ref-run.log 2>&1 &
# THREADS (default 1) torch threads; VARIANT (default ref-token-subset) another recipe, e.g.
# VARIANT=ref-token-stoch (the same without the subset term, as the reference's current ih config), kept
# in its own KEEP; every variant decomposes the same toy model (results/spd-ref/model).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
VARIANT=${VARIANT:-ref-token-subset}
KEEP=${KEEP:-results/spd-ref-kept/$VARIANT-h16}
MODEL=results/spd-ref/model/model.pt
STEPS=${STEPS:-100000} SITTING=${SITTING:-5000} THREADS=${THREADS:-1}
if [ ! -f $KEEP/model.pt ] && [ ! -f $MODEL ]; then
  .venv/bin/mxd-lens spd-induction-model --positional after_projection --target-accuracy --stop-window 3000 \
      --steps 8000 --threads "$THREADS" --out results/spd-ref/model
fi
kept_step() {
  .venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" \
      $KEEP/checkpoint/trainer_state.json 2>/dev/null || echo 0
}
while :; do
  done_step=$(kept_step)
  [ "$done_step" -ge "$STEPS" ] && break
  next=$(( (done_step / SITTING + 1) * SITTING )); [ $next -gt "$STEPS" ] && next=$STEPS
  first=(); [ -f $KEEP/run_config.json ] || first=(--model $MODEL)  # later sittings: the run's own
  .venv/bin/mxd-lens spd-induction train --variant "$VARIANT" --ci-hidden 16 --steps "$STEPS" \
      --until $next --trend-every 1000 --keep-in $KEEP --out results/spd-ref --threads "$THREADS" "${first[@]}"
done

#!/usr/bin/env bash
# The reference-recipe SPD run of the toy induction model (docs/results.md, "SPD of the reference toy
# model"): ref-token-subset at CI hidden 16, scheduled for STEPS (default 100,000) steps, trained in
# sittings of SITTING (default 5,000) steps. After every 1,000 steps the resumable state (checkpoint,
# model, trend, logs; ~3 MB) is kept in docs/results/spd/ref-token-subset-h16-run/, and after every
# sitting that folder is committed: the run outlives the machine. On a fresh clone the same command
# resumes from the committed state (bit-exactly on the same machine and thread count, tests/test_spd_induction.py;
# elsewhere to ~1e-7) and first trains the toy
# model if neither it nor a kept copy exists (~45 min).
#   nohup bash docs/results/spd/ref-run.sh > results/spd-ref-run.log 2>&1 &
# THREADS (default 1) torch threads; COMMIT=0 keeps the state without committing; VARIANT (default
# ref-token-subset) another recipe, e.g. VARIANT=ref-token-stoch (the same without the subset term, as the
# reference's current ih config), kept in docs/results/spd/VARIANT-h16-run/; every variant decomposes the
# same toy model (results/spd-ref/model, or the copy the first run keeps).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1
VARIANT=${VARIANT:-ref-token-subset}
KEEP=docs/results/spd/$VARIANT-h16-run
MODEL=results/spd-ref/model/model.pt
[ -f $MODEL ] || MODEL=docs/results/spd/ref-token-subset-h16-run/model.pt
STEPS=${STEPS:-100000} SITTING=${SITTING:-5000} THREADS=${THREADS:-1}
if [ ! -f $KEEP/model.pt ] && [ ! -f $MODEL ]; then
  MODEL=results/spd-ref/model/model.pt
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
  if [ "${COMMIT:-1}" = 1 ]; then
    git add $KEEP && git commit -q -m "SPD reference run ($VARIANT, CI hidden 16): kept state at step $(kept_step)" -- $KEEP || true
  fi
done

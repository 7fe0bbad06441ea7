#!/usr/bin/env bash
# SPD of the toy induction model, four variants (docs/results.md, "SPD of the toy induction model"):
# speed, then 8,000 steps of each variant two at a time (token-subset + sequence-subset, then token-stoch
# + sequence-stoch; 0.10-0.13 s/step here at batch 16), the per-variant reports and the combined tables
# (results/spd-induction: summary.json, comparison.md, modules.md); the stronger-minimality supplement;
# then the two subset variants for 30,000 steps on MODEL (default results/spd-induction/model-long/model.pt,
# docs/results/spd-induction.md, "Setup"). Each SPD process on one torch thread, at most two at once.
# Reports and figures are copied to docs/results/spd/induction-*.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
SPD=(nice -n 5 .venv/bin/mxd-lens spd-induction) OUT=results/spd-induction LONG=results/spd-induction-long
MODEL=${MODEL:-results/spd-induction/model-long/model.pt}
mkdir -p $OUT/logs docs/results/spd
for v in sequence-subset token-stoch; do "${SPD[@]}" time --variant $v --steps 40 --out $OUT --threads 1; done
for pair in "token-subset sequence-subset" "token-stoch sequence-stoch"; do
  for v in $pair; do
    "${SPD[@]}" train --variant $v --steps 8000 --batch-size 16 --out $OUT --threads 1 > $OUT/logs/train-$v.log 2>&1 &
  done; wait
done
for v in token-subset token-stoch sequence-subset sequence-stoch; do
  "${SPD[@]}" report --variant $v --out $OUT --threads 1
  cp $OUT/$v/report.json docs/results/spd/induction-report-$v.json
  cp $OUT/$v/ci_by_position.png docs/results/spd/induction-ci-$v.png
done
"${SPD[@]}" summary --out $OUT && cp $OUT/summary.json docs/results/spd/induction-summary.json
for m in 0.1 0.5; do  # supplementary: stronger minimality (writes sequence-subset-min0.1/, -min0.5/)
  "${SPD[@]}" train --variant sequence-subset --minimality $m --steps 8000 --batch-size 16 --out $OUT --threads 1 \
      > $OUT/logs/train-sequence-subset-min$m.log 2>&1
  "${SPD[@]}" report --variant sequence-subset --minimality $m --out $OUT --threads 1
  cp $OUT/sequence-subset-min$m/report.json docs/results/spd/induction-report-sequence-subset-min$m.json
  cp $OUT/sequence-subset-min$m/ci_by_position.png docs/results/spd/induction-ci-sequence-subset-min$m.png
done
for v in sequence-subset token-subset; do  # 30,000 steps, side by side
  "${SPD[@]}" train --variant $v --out $LONG --model $MODEL --steps 30000 --batch-size 16 --threads 1 &
done; wait
for v in sequence-subset token-subset; do
  "${SPD[@]}" report --variant $v --out $LONG --model $MODEL --threads 1
  cp $LONG/$v/ci_by_position.png docs/results/spd/induction-30k-ci-$v.png
done
"${SPD[@]}" summary --out $LONG && cp $LONG/summary.json docs/results/spd/induction-30k-summary.json

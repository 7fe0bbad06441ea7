#!/usr/bin/env bash
# The reports of the reference runs (docs/results.md, "SPD of the reference toy model"): for each
# VARIANT (default: ref-token-subset ref-token-stoch) whose state ref-run.sh keeps in
# results/spd-ref-kept/VARIANT-h16/ (KEEP_ROOT), the report at the kept step (CI by position,
# diagnostics, losses and the adversarial PGD check; ~30 s each), the pruning check (what switching the
# extra components of the modules above one component off would cost the training objective; ~1 min
# each) and the trend table, written to docs/results/spd/ (~2 min in all):
#   VARIANT-h16-report.json, -modules.md, -adversarial.md, -pruning.md, -trend.md (with when each module
# would reach CI-L0 1.5 at the rate of the run's second half), -ci-by-position.png, and the run's small
# record (run_config.json, trend.jsonl, trend.png, train_log.jsonl) in VARIANT-h16-run/. Nothing is committed.
#   bash analyses/spd/ref-report.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
DEST=docs/results/spd
for VARIANT in ${VARIANTS:-ref-token-subset ref-token-stoch}; do
  KEEP=${KEEP_ROOT:-results/spd-ref-kept}/$VARIANT-h16
  [ -f $KEEP/checkpoint/trainer_state.json ] || { echo "$VARIANT: nothing kept in $KEEP (ref-run.sh)" >&2; continue; }
  mkdir -p $DEST/$VARIANT-h16-run
  for f in run_config.json trend.jsonl trend.png train_log.jsonl faithfulness_warmup.json; do
    [ ! -f $KEEP/$f ] || cp $KEEP/$f $DEST/$VARIANT-h16-run/
  done
  .venv/bin/mxd-lens spd-induction report --variant "$VARIANT" --ci-hidden 16 --keep-in $KEEP \
      --out results/spd-ref --threads "${THREADS:-1}" --pruning-draws "${PRUNING_DRAWS:-8}" > /dev/null
  .venv/bin/python - "$VARIANT" "$DEST" <<'PY'
import json, shutil, sys
from pathlib import Path

from mxd_lens.spd.pruning import pruning_table
from mxd_lens.spd.report import adversarial_table, module_table, reach_table, trend_table

variant, dest = sys.argv[1], Path(sys.argv[2])
run, name = Path("results/spd-ref") / f"{variant}-h16", f"{variant}-h16"
report = json.loads((run / "report.json").read_text())
shutil.copyfile(run / "report.json", dest / f"{name}-report.json")
shutil.copyfile(run / "ci_by_position.png", dest / f"{name}-ci-by-position.png")
step = report["training"]["steps"]
(dest / f"{name}-modules.md").write_text(f"### {name}, step {step:,}\n\n{module_table(report)}\n")
(dest / f"{name}-adversarial.md").write_text(f"### {name}, step {step:,}\n\n{adversarial_table(report)}\n")
if report.get("pruning"):
    (dest / f"{name}-pruning.md").write_text(f"### {name}, step {step:,}\n\n{pruning_table(report['pruning'], 'at')}\n")
points = [json.loads(line) for line in (dest / f"{name}-run" / "trend.jsonl").read_text().splitlines()]
since = points[-1]["step"] // 2  # the rate of the run's second half
reach = f"When each reaches CI-L0 1.5 at the rate of steps {since:,}-{points[-1]['step']:,}:\n\n{reach_table(points, 1.5, since)}"
(dest / f"{name}-trend.md").write_text(f"### {name}\n\n{trend_table(points, every=5000)}\n\n{reach}\n")
print(f"{name}: step {step:,}; wrote {dest}/{name}-{{report.json,modules.md,adversarial.md,pruning.md,trend.md,ci-by-position.png}}")
PY
done

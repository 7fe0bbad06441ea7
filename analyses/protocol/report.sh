#!/usr/bin/env bash
# The protocol's tables and plots (docs/results.md, "Headline"): frontier-report on the rows keep.sh
# copied into docs/results/protocol/PART/, writing each part's summary.md and frontier-*.png beside them
# (nothing is trained; seconds). Later folders' rows replace earlier ones at the same point.
#   bash analyses/protocol/report.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
R=docs/results/protocol
report() { .venv/bin/mxd-lens frontier-report --threads "${THREADS:-1}" "$@"; }
report --out $R/A                            # block 15, K = 32, the four methods, seeds 0 and 1
report --out $R/A3                           # the standardised gate at A's point
report --out $R/B                            # blocks 5 and 25
report --out $R/C --override $R/A $R/A3      # K = 16 and 64, with A's and A3's K = 32 rows
report --out $R/D --override $R/B $R/A $R/A3 # blocks 5, 15 and 25 with the standardised gate
for part in G3 G9 G15; do                    # Gemma-3-270m (gemma.sh), each block as far as it has run
  if [ -f $R/gemma/$part/frontier.json ]; then report --out $R/gemma/$part; fi
done

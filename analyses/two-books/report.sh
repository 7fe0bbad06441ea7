#!/usr/bin/env bash
# The two-book frontier's table and plot: frontier-v2's rows with the later runs' in place of earlier ones
# at the same point (v2-clip, v3, v4, v5, v6), written to docs/results/frontier-v2/summary.md. Seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=docs/results
HF_HUB_OFFLINE=1 exec .venv/bin/mxd-lens frontier-report --out $R/frontier-v2 --override $R/frontier-v2-clip \
    $R/frontier-v3 $R/frontier-v4 $R/frontier-v5 $R/frontier-v6

#!/usr/bin/env bash
# Issue 43, part 1: the protocol's lr / gate sweep (sweep.py) at blocks 5 and 25, each on the training split
# of their cache (CACHE, default results/cache-mix7-l5-25: `study.sh I2`'s, or cache.sh's with all three
# blocks): the five methods at lr 1e-3, 2e-3, 4e-3, 8e-3, and the standardised gate's r = 0.03 and 0.3 at
# 2e-3 and 4e-3 (r = 0.1 is among the five). One block at a time, resumable; each block's table is copied
# to docs/results/protocol/sweep-lBLOCK/ when it is done. THREADS (default 2) torch threads.
#   nohup bash analyses/protocol/sweep_depth.sh > results/sweep-depth.log 2>&1 &
# `low`: the grid's bottom edge, where every MxD was best: the three MxDs at 5e-4 beside 1e-3 again (the
# same stream and seed, so its 1e-3 rows must repeat the sweep's), into sweep-lBLOCK-low/ (~12 min a block measured at 1 thread beside an evaluation).
#   bash analyses/protocol/sweep_depth.sh low
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
CACHE=${CACHE:-results/cache-mix7-l5-25}
STD=mxd:gate=topk,gate_standardize
if [ "${1:-}" = low ]; then
  GRID=(--lrs 5e-4 1e-3 --archs mxd mxd:gate=topk $STD=0.1 --extra) SUFFIX=-low
else
  GRID=(--lrs 1e-3 2e-3 4e-3 8e-3 --archs mxd mxd:gate=topk $STD=0.1 transcoder skip_transcoder
        --extra $STD=0.03 $STD=0.3 --extra-lrs 2e-3 4e-3) SUFFIX=
fi
for BLOCK in ${BLOCKS:-5 25}; do
  .venv/bin/python analyses/protocol/sweep.py results/protocol-sweep-l$BLOCK$SUFFIX --cache "$CACHE" \
      --block $BLOCK "${GRID[@]}"
  mkdir -p docs/results/protocol/sweep-l$BLOCK$SUFFIX
  cp results/protocol-sweep-l$BLOCK$SUFFIX/sweep.{csv,md} docs/results/protocol/sweep-l$BLOCK$SUFFIX/
done

#!/usr/bin/env bash
# Commit a study part's small results as they come (the machine can be reset at any time): every 2 minutes,
# copy results/protocol-PART/{frontier.json,frontier.csv,frontier.png} and each finished group's eval.json
# and training history into docs/results/protocol/PART/ and commit that folder alone when it changed.
cd "$(dirname "$0")/../.."
PART=${1:?give A, A0, A3, B, C or D}
SRC=${SRC:-results/protocol-$PART} DEST=${DEST:-docs/results/protocol/$PART}  # other studies: SRC=results/gemma-G9 DEST=docs/results/protocol/gemma/G9
ONCE=${2:-}  # --once: copy and commit now, then stop (chain.sh's last copy after a part ends)
while [ -n "$ONCE" ] || sleep 120; do
  [ -f $SRC/frontier.json ] || { [ -n "$ONCE" ] && break; continue; }  # nothing yet (--once: stop)
  mkdir -p $DEST
  cp $SRC/frontier.json $SRC/frontier.csv $SRC/frontier.png $DEST/ 2>/dev/null
  for group in $SRC/runs/*/; do
    g=$(basename $group)
    [ -f $group/eval.json ] && cp $group/eval.json $DEST/$g-eval.json
    [ -f $group/final/metrics.json ] && cp $group/final/metrics.json $DEST/$g-training-history.json
  done
  git add $DEST && git diff --cached --quiet -- $DEST || \
    git commit -q -m "protocol study part $PART: results so far ($(ls $DEST/*-eval.json 2>/dev/null | wc -l) groups evaluated)" -- $DEST
  [ -n "$ONCE" ] && break
done

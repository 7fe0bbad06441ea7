#!/usr/bin/env bash
# Run study parts one after another, in the background, from a frozen copy of the code: a git worktree
# at the current commit (../study-run), so that editing this checkout meanwhile cannot change a running
# study; keep.sh commits each part's results into docs/results/protocol/PART as they come.
#   nohup bash analyses/protocol/chain.sh A B C > results/chain.log 2>&1 &
# Resumable: run the same command again (each part resumes from its checkpoints under results/).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD RUN=${RUN_TREE:-$PWD/../study-run}
if [ ! -d "$RUN" ]; then
  git worktree add -f --detach "$RUN" HEAD
  ln -s "$ROOT/results" "$RUN/results"
  ln -s "$ROOT/.venv" "$RUN/.venv"
fi
echo "study code: $(git -C "$RUN" rev-parse --short HEAD)"
for PART in "$@"; do
  bash analyses/protocol/keep.sh "$PART" &
  KEEP=$!
  STUDY=$RUN/analyses/protocol/study.sh; [ -f "$STUDY" ] || STUDY=$RUN/docs/results/protocol/study.sh  # older trees
  PYTHONPATH="$RUN" bash "$STUDY" "$PART" >> "results/protocol-$PART.log" 2>&1
  echo "part $PART ended with status $? at $(date)"
  kill $KEEP
  bash analyses/protocol/keep.sh "$PART" --once  # the last copy and commit, whatever keep.sh was doing
done

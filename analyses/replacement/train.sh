#!/usr/bin/env bash
# The replacement model of SmolLM2-135M-Instruct: one layer at each of its 30 blocks, for one method at a
# time, parameter-matched at m = 8, K = 32, seed 0, trained from one live stream of the protocol's text
# (results/data/mix7.txt.xz's train side, analyses/protocol/data.sh; eval_fraction 0.05, split_seed 0,
# 128-token rows with BOS, position 0 left to the MLP): 524,288 tokens, 1,024 steps of 512 tokens, one pass,
# lr 2e-3 (the protocol's rate for every method), the library's recipe otherwise, but --norm-tokens 8192: the
# tokens that estimate the normalisation scales are held in memory for every block until the first step
# (the default 65,536 tokens x 30 blocks is ~9 GB, and minutes before the first step).
#   bash analyses/replacement/train.sh METHOD     METHOD: mxd (the recommended gate), skip or topk
# Every block's layer is a learner of one `mxd-lens train` run (one forward of the model feeds all 30).
# The run goes in parts of MINUTES (default 100) minutes: each part ends with a checkpoint (exit status 3),
# and running the same command again continues it, bit for bit; a kill loses the steps since the last
# checkpoint (every 64 steps). Once whole, the 30 layers are in results/replacement/METHOD/final.
# THREADS (default 2) torch threads. Cost here, alone on the 2 cores: see docs/results.md, "The replacement model".
set -euo pipefail
cd "$(dirname "$0")/../.."
METHOD=${1:?give mxd, skip or topk}
case $METHOD in
  mxd) ARCH=mxd:gate=topk,gate_standardize=0.1 ;;
  skip) ARCH=skip_transcoder ;;
  topk) ARCH=transcoder ;;
  *) echo "METHOD=$METHOD: give mxd, skip or topk" >&2; exit 2 ;;
esac
TEXT=results/data/mix7.txt.xz
[ -f $TEXT ] || { echo "no $TEXT: make it with 'bash analyses/protocol/data.sh' first" >&2; exit 1; }
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
mkdir -p results/replacement/$METHOD  # each part's wall time and peak memory: train-time.txt (eval.sh reports it)
exec /usr/bin/time -v -a -o results/replacement/$METHOD/train-time.txt .venv/bin/mxd-lens train --text $TEXT --eval-fraction 0.05 --blocks all --arch $ARCH --k 32 \
    --tokens 524288 --batch-tokens 512 --lr 2e-3 --rows-per-shard 64 --norm-tokens 8192 \
    --checkpoint-every 64 --keep-checkpoints 1 --log-every 32 --no-progress \
    --resume --max-minutes "${MINUTES:-100}" --out results/replacement/$METHOD

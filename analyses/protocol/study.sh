#!/usr/bin/env bash
# The review protocol's study (docs/results.md, "Headline"), one part per call:
#   bash analyses/protocol/study.sh A   # block 15, K = 32, seeds 0 and 1
#   bash analyses/protocol/study.sh B   # blocks 5 and 25, K = 32, seed 0; block 25 seed 1
#   bash analyses/protocol/study.sh C   # block 15, K = 16 and 64, seed 0
#   bash analyses/protocol/study.sh A0  # A's seed 0 alone (rebuilds the layers probe.sh reads)
#   bash analyses/protocol/study.sh A3  # A's point, MxD with the standardised gate (gate_standardize
#                                           # 0.1 and 0.01): does it break the topk gate's always-on core?
#   bash analyses/protocol/study.sh D   # the standardised gate (r = 0.1) where A3 did not run: blocks 5
#                                           # and 25, and block 15's second seed
#   bash analyses/protocol/study.sh I   # block 15, K = 32, seed 0: the paper's and the standardised MxD
#                                           # started from the MLP (--init mlp: E, b_E, D copied), beside
#                                           # A's and A3's default-init rows (issue 43, part 5)
#   CACHE=results/cache-mix7-l5-25 bash analyses/protocol/study.sh I2  # part I at blocks 5 and 25
#   CACHE=results/cache-mix7-l5-25 bash analyses/protocol/study.sh R5   # B/D at block 5 at the rates
#                                           # sweep_depth.sh chose there (issue 43, part 1); R25: block 25
#   bash analyses/protocol/study.sh S   # A0's four layers and the standardised-gate MxD in one run, the
#                                           # layers steer.sh reads (rebuilt after a reset; ~1 hour)
# Methods: MxD with the paper's gate, MxD with the new variant the sweep chose (sweep.md), the TopK and
# skip transcoders, parameter-matched at m = 8, each at the rate the sweep chose for it. Training: 2 epochs
# over the 16-shard cache (cache.sh; 524,288 tokens, 2,048 steps of 512). Evaluation: 32,768 held-out
# tokens of the mix's eval documents and 32,768 tokens of BBC News (out of domain, never trained on).
# Resumable: rerun the same command (checkpoints under results/protocol-PART/runs). THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?give A, A0, A3, B, C, D, I, I2, R5, R25 or S}
CACHE=${CACHE:-results/cache-mix7}  # any cache of the same text holding the part's blocks (cache.sh)
EXTRA=()
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
# chosen by sweep.py on the training split (docs/results/protocol/sweep.md)
NEW_MXD=${NEW_MXD:-mxd:gate=topk}
# the standardised gate (part A3: it breaks the plain gate's always-on core at equal or better fit)
STD_MXD=${STD_MXD:-mxd:gate=topk,gate_standardize=0.1}
ARCH_LR=${ARCH_LR:-"mxd=0.002 mxd:gate=topk=0.002 transcoder=0.002 skip_transcoder=0.002"}
ARCHS=(mxd $NEW_MXD transcoder skip_transcoder)
case $PART in
  A) POINTS=(--blocks 15 --ks 32 --grid 15:32@1) ;;
  A0) POINTS=(--blocks 15 --ks 32) ;;
  A3) POINTS=(--blocks 15 --ks 32)
      ARCHS=(mxd:gate=topk,gate_standardize=0.1 mxd:gate=topk,gate_standardize=0.01)
      ARCH_LR="${ARCHS[0]}=0.002 ${ARCHS[1]}=0.002" ;;
  B) POINTS=(--blocks 5 25 --ks 32 --grid 25:32@1) ;;
  C) POINTS=(--blocks 15 --ks 16 64)
     ARCHS+=("$STD_MXD"); ARCH_LR+=" $STD_MXD=0.002" ;;
  S) POINTS=(--blocks 15 --ks 32)
     ARCHS+=("$STD_MXD"); ARCH_LR+=" $STD_MXD=0.002" ;;
  D) POINTS=(--blocks 5 25 --ks 32 --grid 15:32@1)
     ARCHS=("$STD_MXD"); ARCH_LR="$STD_MXD=0.002" ;;
  I) POINTS=(--blocks 15 --ks 32)
     ARCHS=(mxd "$STD_MXD"); ARCH_LR="mxd=0.002 $STD_MXD=0.002"; EXTRA=(--init mlp) ;;
  I2) POINTS=(--blocks 5 25 --ks 32)  # part I at blocks 5 and 25 (CACHE=results/cache-mix7-l5-25)
      ARCHS=(mxd "$STD_MXD"); ARCH_LR="mxd=0.002 $STD_MXD=0.002"; EXTRA=(--init mlp) ;;
  R5|R25) POINTS=(--blocks ${PART#R} --ks 32)  # the rates sweep_depth.sh chose at blocks 5 and 25 (the
      # same at both: every MxD 1e-3, the TopK transcoder 4e-3; the skip transcoder kept 2e-3, so B's row stands)
      ARCHS=(mxd "$NEW_MXD" "$STD_MXD" transcoder)
      ARCH_LR="mxd=0.001 $NEW_MXD=0.001 $STD_MXD=0.001 transcoder=0.004" ;;
  *) echo "unknown part $PART: give A, A0, A3, B, C, D, I, I2, R5, R25 or S" >&2; exit 2 ;;
esac
exec .venv/bin/mxd-lens frontier --progress false --text results/data/mix7.txt.xz \
    --eval-fraction 0.05 --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz \
    --ood-eval-tokens 32768 --train-tokens 524288 --epochs 2 --cache-dtype float16 \
    --cache "$CACHE" "${POINTS[@]}" --archs "${ARCHS[@]}" \
    --arch-lr $ARCH_LR "${EXTRA[@]}" --out results/protocol-$PART

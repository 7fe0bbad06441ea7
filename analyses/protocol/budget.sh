#!/usr/bin/env bash
# Issue 43, part 2: a 4x budget at block 15 of SmolLM2-135M-Instruct. The five methods of the protocol
# (study.sh's four and the standardised gate), parameter-matched, K = 32, at the rates the sweep chose at
# block 15 (every method 2e-3), trained for 8,192 steps of 512 tokens: 2 epochs over a 2,097,152-token
# cache of block 15 (64 shards), checkpoints every 1,024 steps, all kept. Then every checkpoint is
# evaluated on BBC News (out of domain; the final layers on the held-out mix too, by `train`), and KL
# against training tokens is drawn.
# One step per call, each resumable (rerun the same command) within a session; results/ does not outlive one:
#   SIZE=2m bash analyses/protocol/data.sh   # the 4x run's text, mix7's sources at 340k tokens each: mix7's
#                                            # own ~1.07M training tokens cannot fill the cache (~40 s)
#   bash analyses/protocol/budget.sh cache   # the cache (results/cache-mix7-l15-2m): 65 shards at ~1.4 min
#                                            # a shard (1 thread beside another job; SCALE=1x's 17 took 24 min)
#   bash analyses/protocol/budget.sh train   # 8,192 steps: ~2.6 h for the five at 1 thread beside a job
#                                            # (SCALE=1x: 2,048 steps in ~40 min)
#   bash analyses/protocol/budget.sh curve   # each checkpoint on BBC -> DEST/curve.csv, curve.png, curve.md
#                                            # (KL tables; the 1x run's curve beside the 4x's)
# The five together (~4.5 h) do not fit one 3-hour session of this machine. SET splits them: SET=core trains
# the headline's pair, the recommended MxD and the skip transcoder (2/5 of the training; with the cache, one
# session), SET=rest the paper's and plain gates and the TopK transcoder (another session, the cache
# rebuilt if results/ was lost; training 82 min for the three). Each set has its own run and results folder
# (results/protocol-budget-core -> docs/results/protocol/budget-core; `keep.sh budget-core` commits its rows);
# the curve of one set joins the other's committed curve.csv when it is there.
# SCALE=1x runs the protocol's own budget (2,048 steps over the 524,288-token block-15 cache, 1.9 epochs:
# study.sh's rows) with a checkpoint every 256 steps: KL against training tokens up to the budget the headline
# uses (results/protocol-budget-1x, docs/results/protocol/budget-1x).
# CURVE_STEPS="256 512 1024" evaluates only those checkpoints (default: all); the final layers are evaluated
# by `train` on both texts and join the curve at the last step.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEP=${1:?give cache, train or curve}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DATA=${DATA:-../shared/data}
case ${SCALE:=4x} in
  4x) TOKENS=2097152 EVERY=1024 CACHE=${CACHE:-results/cache-mix7-l15-2m} OUT=results/protocol-budget
      TEXT=results/data/mix7-2m.txt.xz MAKE="SIZE=2m bash analyses/protocol/data.sh" ;;
  1x) TOKENS=524288 EVERY=256 CACHE=${CACHE:-results/cache-mix7-l15} OUT=results/protocol-budget-1x
      TEXT=results/data/mix7.txt.xz MAKE="bash analyses/protocol/data.sh" ;;
  *) echo "SCALE=$SCALE: give 4x or 1x" >&2; exit 2 ;;
esac
STD=mxd:gate=topk,gate_standardize=0.1
case ${SET:=all} in
  all) ARCHS=(mxd mxd:gate=topk $STD transcoder skip_transcoder) ;;
  core) ARCHS=($STD skip_transcoder); OUT=$OUT-core ;;
  rest) ARCHS=(mxd mxd:gate=topk transcoder); OUT=$OUT-rest ;;
  *) echo "SET=$SET: give all, core or rest" >&2; exit 2 ;;
esac
DEST=docs/results/protocol/${OUT#results/protocol-}
[ -f $TEXT ] || { echo "no $TEXT: make it with '$MAKE'" >&2; exit 1; }
COMMON=(--progress false --text $TEXT --eval-fraction 0.05 --train-tokens $TOKENS
        --cache-dtype float16 --cache "$CACHE" --blocks 15 --ks 32)
case $STEP in
  cache) exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --out $OUT --cache-only true ;;
  train)
    exec .venv/bin/mxd-lens frontier "${COMMON[@]}" --epochs 2 --checkpoint-every $EVERY --keep-checkpoints 8 \
        --eval-tokens 32768 --ood-text $DATA/probing/topic_bbc_news.jsonl.xz --ood-eval-tokens 32768 \
        --archs "${ARCHS[@]}" --arch-lr $(printf '%s=0.002 ' "${ARCHS[@]}") --out $OUT ;;
  curve)
    mkdir -p $DEST
    for ckpt in $OUT/runs/L15.seed0/checkpoints/step_*/; do
      [ -f $ckpt/evaluated ] && continue  # done before (the results are in its layers' cfg.json)
      step=$(basename $ckpt); step=$((10#${step#step_}))
      [ -z "${CURVE_STEPS:-}" ] || [[ " $CURVE_STEPS " == *" $step "* ]] || continue
      .venv/bin/mxd-lens eval $ckpt --text $DATA/probing/topic_bbc_news.jsonl.xz --split all --eval-tokens 32768
      touch $ckpt/evaluated
    done
    OTHER=(); case $SET in core) OTHER=(${DEST%-core}-rest/curve.csv) ;; rest) OTHER=(${DEST%-rest}-core/curve.csv) ;; esac
    [ $SCALE = 4x ] && OTHER+=(docs/results/protocol/budget-1x/curve.csv)  # the protocol's budget beside
    .venv/bin/python analyses/protocol/budget_curve.py $DEST --run $OUT/runs/L15.seed0 --also "${OTHER[@]}" \
        | tee $DEST/curve.md ;;
  *) echo "unknown step $STEP: give cache, train or curve" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# How faithful is one method's replacement model (train.sh's 30 layers), and its attribution graphs:
#   bash analyses/replacement/eval.sh METHOD     METHOD: mxd, skip or topk (train.sh first)
# 1. `mxd-lens replacement`: every block spliced at once, the compounding curve (the first n blocks, n = 1..30)
#    and each block alone, on 4,096 held-out tokens of the protocol's text and 4,096 of BBC News (never trained
#    on; 8 batches of 4 rows of 128 each, for the standard errors), with the sanity row (every layer with its
#    error term: exact). TOKENS sets the tokens per text.
# 2. `mxd-lens graphs`: attribution graphs through all 30 blocks for the default suite of 11 prompts, pruned at
#    node threshold 0.8 and edge threshold 0.98; scores, one HTML page per graph, circuit-tracer's graph files.
# The small outputs (CSV, JSON, PNG, a picture of graph 03) are copied to docs/results/replacement/METHOD; report.py joins
# the methods. THREADS (default 2) torch threads. Training's time (train.sh's parts) is in time.txt too.
set -euo pipefail
cd "$(dirname "$0")/../.."
METHOD=${1:?give mxd, skip or topk}
RUN=results/replacement/$METHOD
[ -f $RUN/final/metrics.json ] || { echo "no $RUN/final: train it first with 'bash analyses/replacement/train.sh $METHOD'" >&2; exit 1; }
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${THREADS:-2}
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; [ -f $JE ] && export LD_PRELOAD=$JE
DEST=docs/results/replacement/$METHOD
mkdir -p $DEST
/usr/bin/time -v .venv/bin/mxd-lens replacement $RUN/final --label $METHOD --eval-tokens ${TOKENS:-4096} \
    --rows-per-forward 4 \
    --ood-text ${DATA:-../shared/data}/probing/topic_bbc_news.jsonl.xz --out $RUN 2> $RUN/replacement-time.txt
/usr/bin/time -v .venv/bin/mxd-lens graphs $RUN/final --label $METHOD --out $RUN 2> $RUN/graphs-time.txt
cp $RUN/replacement/*.csv $RUN/replacement/*.json $RUN/replacement/*.png $DEST/
# the graphs' table; the pages and circuit-tracer files (10-100 MB each at 30 blocks) stay in $RUN/graphs
mkdir -p $DEST/graphs && cp $RUN/graphs/graphs.csv $RUN/graphs/graphs.json $DEST/graphs/
.venv/bin/python analyses/replacement/picture.py $RUN/graphs/graph-03.html --top 40 --out $DEST/graph-03.png || \
    echo "no picture of graph 03 (picture.py needs Playwright and Chromium)" >&2
{ for part in train replacement graphs; do
    if [ -f $RUN/$part-time.txt ]; then grep -h "Elapsed\|Maximum resident" $RUN/$part-time.txt | sed "s/^/$part: /"; fi
  done; } > $DEST/time.txt
echo "wrote $DEST"

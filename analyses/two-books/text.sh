#!/usr/bin/env bash
# The two-book text of the earlier frontier (docs/results.md, "The earlier frontier"): Jane Austen's novels
# and the World English Bible from $DATA/corpus (default ../shared/data), interleaved by volume so both
# books are on both sides of the document split. Seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data}/corpus
mkdir -p results/data
HF_HUB_OFFLINE=1 exec .venv/bin/mxd-lens mix $D/jane_austen_novels.txt.xz $D/bible_web.txt.xz \
    --out results/data/austen_bible_mixed.txt.xz

#!/usr/bin/env bash
# The review protocol's text (docs/results.md, "The protocol"): the seven offline corpora of ../shared/data/corpus
# in equal SmolLM2-token shares (160k tokens each, ~1.14M in all; by volume the dictionary alone would be
# half), interleaved so that every prefix is balanced. Documents are split train/eval by the trainer's
# per-document hash (eval_fraction 0.05, split_seed 0). Out-of-domain text: the BBC News articles of the
# probing data, never trained on. ~15 s.
# SIZE=2m: 340k tokens a source (2.4M in all, ~2.28M on the train side), for budget.sh's 4x cache of
# 2,097,152 tokens, which mix7's ~1.07M training tokens cannot fill (~40 s): results/data/mix7-2m.txt.xz.
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data}/corpus
mkdir -p results/data
case ${SIZE:-1m} in
  1m) PER=160000 OUT=results/data/mix7.txt.xz ;;
  2m) PER=340000 OUT=results/data/mix7-2m.txt.xz ;;
  *) echo "SIZE=$SIZE: give 1m or 2m" >&2; exit 2 ;;
esac
HF_HUB_OFFLINE=1 exec .venv/bin/mxd-lens mix $D/jane_austen_novels.txt.xz $D/bible_web.txt.xz \
    $D/matthew_henry_concise_commentary.txt.xz $D/spurgeon_treasury_of_david.txt.xz \
    $D/debian_package_descriptions.txt.xz $D/fortunes_en.txt.xz $D/gcide_webster1913_dictionary.txt.xz \
    --tokenizer default --per-source $PER --out $OUT

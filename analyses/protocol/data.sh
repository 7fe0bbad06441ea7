#!/usr/bin/env bash
# The review protocol's text (docs/results.md, "The protocol"): the seven offline corpora of ../shared/data/corpus
# in equal SmolLM2-token shares (160k tokens each, ~1.14M in all; by volume the dictionary alone would be
# half), interleaved so that every prefix is balanced. Documents are split train/eval by the trainer's
# per-document hash (eval_fraction 0.05, split_seed 0). Out-of-domain text: the BBC News articles of the
# probing data, never trained on. ~15 s.
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data}/corpus
mkdir -p results/data
HF_HUB_OFFLINE=1 exec .venv/bin/mxd-lens mix $D/jane_austen_novels.txt.xz $D/bible_web.txt.xz \
    $D/matthew_henry_concise_commentary.txt.xz $D/spurgeon_treasury_of_david.txt.xz \
    $D/debian_package_descriptions.txt.xz $D/fortunes_en.txt.xz $D/gcide_webster1913_dictionary.txt.xz \
    --tokenizer default --per-source 160000 --out results/data/mix7.txt.xz

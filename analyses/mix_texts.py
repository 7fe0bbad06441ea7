r"""Interleave the documents of several texts into one .txt.xz (``mxd_lens.data.mix_texts``): the next
document always comes from the source that has given the least so far, so that any prefix of the result
holds about as much of each source, whatever the length of their documents (a Bible chapter against an
Austen paragraph). By characters, or with ``--tokenizer`` by that tokenizer's tokens; ``--per-source N``
stops at N per source (equal shares, refused if a source holds less).

    python analyses/mix_texts.py corpus/jane_austen_novels.txt.xz corpus/bible_web.txt.xz \
        --out data/austen_bible_mixed.txt.xz
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from simple_parsing import field

from mxd_lens.cli import parse_config
from mxd_lens.data import mix_texts


@dataclass
class Mix:
    """What to mix and where to write it."""

    sources: list[str] = field(positional=True)
    """files, folders or datasets, as iter_texts reads them"""
    out: str
    """the .txt.xz to write"""
    tokenizer: str | None = None
    """count volume in this tokenizer's tokens (a Hugging Face folder, or 'default' for the default model's)"""
    per_source: int | None = None
    """stop after this volume (characters, or tokens with --tokenizer) from each source"""


def main(argv: list[str] | None = None) -> int:
    (mix,) = parse_config(__doc__, argv, mix=Mix)
    measure = None
    if mix.tokenizer is not None:
        from transformers import AutoTokenizer

        from mxd_lens.models import DEFAULT_MODEL, hf_folder

        folder = hf_folder(DEFAULT_MODEL if mix.tokenizer == "default" else mix.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)

        def measure(doc: str) -> int:
            return len(tokenizer(doc, add_special_tokens=False).input_ids)

    n, given = mix_texts(mix.sources, mix.out, measure=measure, per_source=mix.per_source)
    unit = "tokens" if measure else "characters"
    print(f"{mix.out}: {n:,} documents, {unit} per source {given}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

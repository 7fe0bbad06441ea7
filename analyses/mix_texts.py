r"""Interleave the documents of several texts into one .txt.xz, balanced by volume
(``mxd_lens.data.mix_texts``): the next document always comes from the source that has given the
fewest characters so far, so that any prefix of the result holds about as much of each source,
whatever the length of their documents (a Bible chapter against an Austen paragraph).

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


def main(argv: list[str] | None = None) -> int:
    (mix,) = parse_config(__doc__, argv, mix=Mix)
    n, given = mix_texts(mix.sources, mix.out)
    print(f"{mix.out}: {n:,} documents, characters per source {given}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

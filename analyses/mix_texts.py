"""Interleave the documents of several texts into one .txt.xz, balanced by volume: the next document
always comes from the source that has given the fewest characters so far (while it has documents
left), so that any prefix of the result holds about as much of each source, whatever the length of
their documents (a Bible chapter against an Austen paragraph).

    python analyses/mix_texts.py ../shared/data/corpus/{jane_austen_novels,bible_web}.txt.xz \
        --out data/austen_bible_mixed.txt.xz

Documents are what ``mxd_lens.data.iter_texts`` yields (blank-line separated paragraphs for text
files); the output holds them separated by blank lines, so it reads back as the same documents.
"""

from __future__ import annotations

import argparse
import lzma
import sys

from mxd_lens import data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sources", nargs="+", help="files, folders or datasets, as iter_texts reads them")
    parser.add_argument("--out", required=True, help="the .txt.xz to write")
    args = parser.parse_args(argv)
    streams = {i: data.iter_texts(source) for i, source in enumerate(args.sources)}
    given = dict.fromkeys(streams, 0)
    n = 0
    with lzma.open(args.out, "wt", encoding="utf-8") as f:
        while streams:
            i = min(streams, key=lambda j: given[j])
            doc = next(streams[i], None)
            if doc is None:
                del streams[i]
                continue
            f.write(("\n\n" if n else "") + doc)
            given[i] += len(doc)
            n += 1
    print(f"{args.out}: {n:,} documents, characters per source {list(given.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""One probing report from several studies of the same suite (``mxd_lens.analysis.probing.merge_probing``):
e.g. the K = 32 layers probed in one session and the K = 16 and 64 layers in another.

    python analyses/merge_probing.py results/v2/probing results/v3/probing --out results/merged/probing

Writes OUT/probing.csv and .json, summary.csv, paired.csv and probing.png as ``mxd-lens probe`` does.
Rows both studies hold (the dense ceiling) must be equal, or the merge is refused.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from simple_parsing import field

from mxd_lens.analysis.probing import format_probing, merge_probing
from mxd_lens.cli import parse_config


@dataclass
class Merge:
    """What to merge and where to write it."""

    studies: list[str] = field(positional=True)
    """probing folders (each holds the probing.csv that mxd-lens probe wrote)"""
    out: str
    """the folder to write"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    (merge,) = parse_config(__doc__, args, merge=Merge)
    command = shlex.join(["python", "analyses/merge_probing.py", *args])
    try:
        results = merge_probing(merge.studies, merge.out, command=command)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"merge_probing: {err}") from None
    print(format_probing(results))
    print(f"\nwrote {merge.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""Sparse probing of MxD / transcoder / skip-transcoder codes on the offline task suite (38 one-vs-rest
tasks over 8 datasets, mxd_lens.analysis.tasks.OFFLINE_SETS) or SAEBench's datasets (--suite saebench,
needs the hub). The options are the fields of ``mxd_lens.analysis.probing.ProbingStudy``.

    python analyses/sparse_probing.py --layers results/frontier-v2/runs/L15.seed0/final --out results/probing

(``--data DIR``: a folder of the suite's files; default: the sets bundled with mxd-lens.)

Writes OUT/probing.csv and .json, OUT/summary.csv, OUT/paired.csv and OUT/probing.png
(``run_probing_study``); prints the summary and the paired comparisons.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from mxd_lens.analysis.probing import ProbingStudy, run_probing_study
from mxd_lens.cli import parse_config
from mxd_lens.models import DEFAULT_MODEL, load_model


@dataclass
class Script:
    """The model and where to write."""

    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str = "results/probing"
    """output folder"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=ProbingStudy, script=Script)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    results = run_probing_study(load_model(script.model), study, script.out, command=command)
    print(results["summary"].round(3).to_markdown())
    if len(results["paired"]):
        print("\nPaired differences in test accuracy (same task), mean over tasks:")
        print(results["paired"].round(3).to_markdown(index=False))
    print(f"\nwrote {script.out}/probing.csv, summary.csv, paired.csv, probing.json, probing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

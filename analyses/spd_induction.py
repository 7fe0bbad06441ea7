"""SPD of the toy induction model's 8 attention projections (Q, K, V, O x 2 layers), four variants
(``mxd_lens.spd.induction_study``; the options are the fields of its ``InductionSPDStudy``):

    python analyses/spd_induction.py time  --variant sequence-subset --steps 40
    python analyses/spd_induction.py train --variant token-subset --steps 8000   # resumes from checkpoints
    python analyses/spd_induction.py train --variant ref-token-subset --steps 100000 --trend-every 2000 \
        --out results/spd-ref                                                    # the reference recipe
    python analyses/spd_induction.py report --variant token-subset
    python analyses/spd_induction.py summary                                       # all variants found
    python analyses/spd_induction.py train --variant sequence-subset --minimality 0.1   # supplementary:
        # writes OUT/sequence-subset-min0.1/ (any --minimality other than 1e-2 gets such a suffix)

Writes OUT/VARIANT/{checkpoints/, metrics.json, run_config.json, train_log.jsonl, report.json,
ci_by_position.png} (with --trend-every also trend.jsonl, trend.png) and OUT/summary.json,
OUT/comparison.md, OUT/modules.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Literal

import torch
from simple_parsing import field

from mxd_lens.cli import parse_config
from mxd_lens.spd import induction_study as study_lib
from mxd_lens.spd.induction_study import InductionSPDStudy


@dataclass
class Script:
    """What to do, where, and how."""

    command: Literal["time", "train", "report", "summary"] = field(positional=True)
    """time: s/step in a scratch folder; train (resumes); report; summary over every variant"""
    out: str = "results/spd-induction"
    """results root"""
    threads: int = 1
    """torch CPU threads"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=InductionSPDStudy, script=Script)
    torch.set_num_threads(script.threads)
    try:
        if script.command == "time":
            rate = study_lib.time_variant(study, script.out, study.steps)
            print(json.dumps({"variant": study.variant, "batch_size": study.batch_size, "s_per_step": rate}))
        elif script.command == "train":
            print(json.dumps(study_lib.train_variant(study, script.out, progress=False)))
        elif script.command == "report":
            report = study_lib.report_variant(study, script.out)
            print(json.dumps({k: v for k, v in report.items() if k not in ("modules", "training")}, indent=1))
            print(f"wrote {script.out}/{study.name}/report.json and ci_by_position.png")
        else:
            print(study_lib.summarize_variants(script.out))
            print(f"wrote {script.out}/summary.json, comparison.md, modules.md")
    except ValueError as err:
        raise SystemExit(f"spd_induction {script.command}: {err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

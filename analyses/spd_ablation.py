"""SPD component ablation on the real offline model (SmolLM2-135M-Instruct): decompose one late weight
matrix, find the component most specific to a concept, ablate it, and compare the damage on held-out
concept text with the damage elsewhere and with norm-matched random components
(``mxd_lens.spd.real_model``; the options are the fields of its ``RealModelStudy``).

    nice -n 5 python analyses/spd_ablation.py --threads 1 --out results/spd-ablation

Writes OUT/spd/ (checkpoints, metrics.json), OUT/decomposition.json, OUT/scores.json, OUT/ablation.json,
OUT/by_ci.json, OUT/ablation.png and OUT/RESULTS.md (every number and the command); a killed run resumes.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

import torch

from mxd_lens.cli import parse_config
from mxd_lens.models import DEFAULT_MODEL, load_model
from mxd_lens.spd.real_model import RealModelStudy, run_real_model_study


@dataclass
class Script:
    """The model, where to write, and how."""

    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str = "results/spd-ablation"
    """output folder"""
    threads: int = 1
    """torch CPU threads"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=RealModelStudy, script=Script)
    torch.set_num_threads(script.threads)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    run_real_model_study(load_model(script.model), study, script.out, command=command)
    print(
        f"wrote {script.out}/decomposition.json, scores.json, ablation.json, by_ci.json, ablation.png, RESULTS.md"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""Steer with the top feature of several probing tasks, for each layer type, and score each generation
offline (``mxd_lens.analysis.steering.SteeringStudy``, whose fields are the options).

    python analyses/steering.py --layers results/frontier-v2/runs/L15.seed0/final --k 32 \
        --probing results/probing/pooled --out results/steering

For each task and layer: the feature ranked first on the task's training split (as in sparse probing),
its largest activation on the task's positive training texts (the unit of alpha), and generations from
"Let's talk about" at alpha = multiple x that unit (add mode, error term on, so multiple 0 is the clean
model). Writes OUT/steering.csv, .json, steering.png and OUT/contexts/NAME.csv|html (the top contexts
of the features used).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mxd_lens.analysis.steering import SteeringStudy, plot_sweep, run_steering_study
from mxd_lens.cli import parse_config
from mxd_lens.models import DEFAULT_MODEL, load_model


@dataclass
class Script:
    """The model, where to write, and how."""

    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str = "results/steering"
    """output folder"""
    threads: int | None = None
    """torch threads (1 when the CPU is shared)"""
    plot_only: bool = False
    """redraw OUT/steering.png from OUT/steering.csv"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=SteeringStudy, script=Script)
    if script.plot_only:
        import pandas as pd

        plot_sweep(pd.read_csv(Path(script.out) / "steering.csv"), Path(script.out) / "steering.png")
        return 0
    if script.threads:
        torch.set_num_threads(script.threads)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    try:
        table = run_steering_study(load_model(script.model), study, script.out, command=command)
    except ValueError as err:
        raise SystemExit(f"steering: {err}") from None
    print(table.drop(columns=["example"]).round(3).to_markdown(index=False))
    print(f"\nwrote {script.out}/steering.csv, steering.json, steering.png, contexts/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""Top-activating contexts of chosen experts / latents, as a CSV table and a self-contained HTML page.

    python analyses/inspect_features.py --layer results/frontier-v2/runs/L15.seed0/final/L15.mxd.k32.m8 \
        --features 12 345 --tokens 200000 --out results/inspect      # --text: default the bundled English text

The options are the fields of ``mxd_lens.analysis.inspect.InspectStudy``. ``--from-steering
results/steering/steering.csv`` takes the features the steering study chose for this layer. The texts
are packed into rows of ``--context-size`` tokens starting with the model's BOS and read once, up to
``--tokens`` tokens in all (an equal share from each). Writes OUT/NAME.csv and OUT/NAME.html.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mxd_lens.analysis.inspect import InspectStudy, run_inspect_study
from mxd_lens.cli import parse_config
from mxd_lens.models import DEFAULT_MODEL, load_model


@dataclass
class Script:
    """The model and where to write."""

    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str = "results/inspect"
    """output folder"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=InspectStudy, script=Script)
    try:
        table = run_inspect_study(load_model(script.model), study, script.out)
    except ValueError as err:
        raise SystemExit(f"inspect_features: {err}") from None
    print(table.groupby("feature").head(3).to_markdown(index=False))
    print(f"\nwrote {script.out}/ (CSV and HTML named after the layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

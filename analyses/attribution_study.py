r"""How much of a prediction a few units carry, MxD against the transcoders at equal K: each method's
layers spliced together at the same blocks, attribution of a logit difference on a handful of
factual and syntactic prompts (``mxd_lens.attribution.run_attribution_study``; the options are the
fields of ``mxd_lens.config.AttributionStudy``, plus ``--model`` and ``--out``).

    python analyses/attribution_study.py --layers results/frontier-v2/runs/*/final --k 32 \
        --blocks 5 15 25 --out results/attribution-study

Writes OUT/attribution_study.csv and .json (one row per prompt and method: the target, the spliced
blocks' share of it, the fraction the top units carry, the error term's fraction, completeness) and
OUT/METHOD/report.html for the first prompt; prints the table and the mean per method.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mxd_lens.cli import parse_config
from mxd_lens.config import DEFAULT_MODEL, AttributionStudy


@dataclass
class Script:
    """The model and where to write."""

    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str = "results/attribution-study"
    """output folder"""


def main(argv: list[str] | None = None) -> int:
    study, script = parse_config(__doc__, argv, study=AttributionStudy, script=Script)
    from mxd_lens.attribution import run_attribution_study
    from mxd_lens.models import load_model

    try:
        table = run_attribution_study(load_model(script.model), study, script.out)
    except ValueError as err:
        raise SystemExit(f"attribution_study: {err}") from None
    print(table.drop(columns=["blocks"]).round(4).to_markdown(index=False))
    columns = ["top_abs_share", "error_abs_share", "top_fraction", "error_fraction"]
    stats = table.groupby("method")[columns].agg(["mean", "median"]).round(3)
    stats.columns = [f"{column} {stat}" for column, stat in stats.columns]
    print("\nover prompts (the signed fractions divide by the spliced total, which can be near zero):")
    print(stats.T.to_markdown())
    print(f"\nwrote {script.out}/attribution_study.csv, .json, METHOD/report.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())

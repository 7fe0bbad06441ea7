"""The sparsity–accuracy frontier on a real model: parameter-matched MxD, TopK transcoder and skip
transcoder at several K, from one cached activation stream, spliced on held-out text.

    python analyses/frontier.py --blocks 15 --ks 16 32 64 --train-tokens 1000000 --out results/frontier

The options are the fields of ``mxd_lens.analysis.frontier.FrontierConfig`` (``--help`` lists them with
their defaults), plus ``--model`` and ``--out``. Writes OUT/frontier.json (config, command, results),
OUT/frontier.csv and OUT/frontier.png; the cache and the trained weights stay under OUT for later
studies (probing, steering). ``--report`` redraws them from OUT/frontier.json and writes OUT/summary.md;
``--override DIR`` puts another study's rows (e.g. one point rerun with other settings) in place of OUT's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from mxd_lens.analysis.frontier import (
    FrontierConfig,
    load_results,
    plot_frontier,
    run_frontier,
    summarize,
    summary_markdown,
    usage_markdown,
    write_frontier_cache,
)
from mxd_lens.cli import parse_config
from mxd_lens.models import DEFAULT_MODEL, load_model

COLUMNS = [
    "method",
    "block",
    "k",
    "seed",
    "params",
    "delta_ce",
    "kl",
    "fvu",
    "l0",
    "dead_fraction",
    "ce_recovered_zero",
]


@dataclass
class Script:
    """The model, where to write, and how."""

    model: str = DEFAULT_MODEL  # model name (TransformerLens) or path, or an offline default
    out: str = "results/frontier"  # output folder
    cache_only: bool = False  # write (or check) the activation cache, then stop
    progress: bool = True  # progress bars; off: text log lines (for logs of background runs)
    report: bool = False  # only read OUT/frontier.json: write OUT/summary.md and redraw OUT/frontier.png
    override: list[str] = field(default_factory=list)
    """with --report: other studies' folders whose rows replace OUT's at the same (block, K, method, seed)"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--report" in args:  # reads OUT only: no study settings to give
        (script,) = parse_config(__doc__, args, script=Script)
    else:
        script, config = parse_config(__doc__, args, script=Script, config=FrontierConfig)
    if script.report:
        table = load_results(script.out, script.override)
        summary = summarize(table)
        text = summary_markdown(summary)
        usage = usage_markdown(summary)
        if usage:  # studies with the usage diagnostics and an out-of-domain text
            text += "\n\nHow the units are used, and the out-of-domain text:\n\n" + usage
            plot_frontier(table, Path(script.out) / "frontier-l0.png", x="l0")
            plot_frontier(table, Path(script.out) / "frontier-l0-ood.png", x="l0", prefix="ood_")
        (Path(script.out) / "summary.md").write_text(text + "\n", encoding="utf-8")
        plot_frontier(table, Path(script.out) / "frontier.png")
        print(text)
        print(f"\nwrote {script.out}/summary.md and frontier.png")
        return 0
    model = load_model(script.model)
    if script.cache_only:
        cache, _, n_blocks = write_frontier_cache(model, config, script.out, script.progress)
        print(f"cache: {cache} ({n_blocks} blocks)")
        return 0
    rows = run_frontier(model, config, script.out, progress=script.progress)
    table = pd.DataFrame(rows)[COLUMNS].sort_values(["block", "k", "method", "seed"])
    print(table.to_markdown(index=False, floatfmt=".4f"))
    print(f"\nresults in {script.out}/frontier.json|csv|png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KL against training tokens, from the evaluations budget.sh's `curve` step records in every checkpoint's
layers and `train` in the final ones (issue 43 part 2). Reads RUN/checkpoints/step_*/*/cfg.json and
RUN/final/*/cfg.json (metadata.evaluations: one record per text; the step from metadata.training) and writes
DEST/curve.csv (one row per step, method and text) and DEST/curve.png (KL on each text against training
tokens, one line per method and run: --also joins other runs' curve.csv, the 1x run's beside the 4x).
Checkpoints before the rate's decay (the last 20% of the steps) are
mid-schedule: a point there is the run on its way, not a run of that length.

    .venv/bin/python analyses/protocol/budget_curve.py docs/results/protocol/budget
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from mxd_lens.layers import arch_label, format_arch
from mxd_lens.records import EvaluationRecord

RUN = Path("results/protocol-budget/runs/L15.seed0")


def rows(run: Path) -> list[dict]:
    out = []
    seen = set()
    # the final layers first: a checkpoint at the last step holds the same layer, evaluated by `curve` or not
    for cfg in sorted(run.glob("final/*/cfg.json")) + sorted(run.glob("checkpoints/step_*/*/cfg.json")):
        metadata = json.loads(cfg.read_text())["metadata"]
        training = metadata.get("training") or {}
        learner, step = training.get("learner") or {}, training.get("steps")
        if step is None or (step, cfg.parent.name) in seen:  # a last checkpoint is also the final layer
            continue
        seen.add((step, cfg.parent.name))
        for record in EvaluationRecord.all_of(metadata):
            text = Path(record.text.text or "?").name.split(".")[0]
            out.append({
                **record.metrics, "eval_tokens": record.tokens, "step": step,
                "tokens": training.get("tokens", step * 512),
                "arch": format_arch(learner["arch"], learner.get("options") or {}),
                "text": f"{text} ({record.text.split})",
            })  # fmt: skip
    return out


def with_run_steps(table: pd.DataFrame) -> pd.DataFrame:
    """The run's length (its schedule: a 1x and a 4x run differ) as a column, where a table lacks it."""
    if "run_steps" not in table:
        table["run_steps"] = table["step"].max()
    return table


def plot(table: pd.DataFrame, path: Path) -> None:
    """KL against training tokens on each text measured at more than one step (a text evaluated only on the
    final layers has one point a method: it is in the printed table, not drawn). Colour: the method; line
    style: the run's length (solid the longest), so a short run's end and a long run's middle, at different
    points of their schedules, are not joined."""
    steps = table.groupby("text")["step"].nunique()
    texts = sorted(steps[steps > 1].index) or sorted(steps.index)
    runs = sorted(table["run_steps"].unique(), reverse=True)
    colours = {arch: f"C{i}" for i, arch in enumerate(sorted(table["arch"].unique()))}
    fig, axes = plt.subplots(1, len(texts), figsize=(6.5 * len(texts), 4.5), squeeze=False)
    for ax, text in zip(axes[0], texts, strict=True):
        for (arch, run_steps), part in table[table["text"] == text].groupby(["arch", "run_steps"]):
            style = ("-", "--", ":", "-.")[runs.index(run_steps) % 4]
            ax.plot(part["tokens"] / 1e6, part["kl"], style, marker="o", color=colours[arch],
                    label=f"{arch_label(arch)}, {run_steps:,} steps")  # fmt: skip
        ax.set(xlabel="training tokens (millions)", ylabel="KL (nats/token)", title=f"KL on {text}")
        ax.set(xscale="log", yscale="log")
        ticks = sorted(table.loc[table["text"] == text, "tokens"].unique() / 1e6)
        ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--run", type=Path, default=RUN)
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="curve.csv files of other runs (another SET) to draw beside; absent ones are skipped")  # fmt: skip
    args = parser.parse_args(argv)
    # results/ gone with the machine: draw the committed rows again
    if not args.run.is_dir() and (args.dest / "curve.csv").is_file():
        print(f"{args.run} is not here: drawing {args.dest / 'curve.csv'} again", file=sys.stderr)
        table = pd.read_csv(args.dest / "curve.csv")
    else:
        table = pd.DataFrame(rows(args.run))
    if table.empty:
        sys.exit(f"no evaluated checkpoints under {args.run}: run `bash analyses/protocol/budget.sh curve`")
    with_run_steps(table)
    table = table.sort_values(["text", "arch", "step"])
    args.dest.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.dest / "curve.csv", index=False)  # this run's rows only
    others = [with_run_steps(pd.read_csv(path)) for path in args.also if path.is_file()]
    table = pd.concat([table, *others], ignore_index=True).sort_values(["text", "arch", "run_steps", "step"])
    plot(table, args.dest / "curve.png")
    pivot = table.pivot_table(index=["text", "run_steps", "step"], columns="arch", values="kl")
    print(pivot.rename(columns=arch_label).round(4).to_markdown())
    if "skip_transcoder" in pivot:  # does the lead grow or shrink: each KL over the skip transcoder's
        print("\nKL / the skip transcoder's KL, same text, run and step:\n")
        print(pivot.div(pivot["skip_transcoder"], axis=0).rename(columns=arch_label).round(3).to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

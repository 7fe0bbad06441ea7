"""The replacement-model study: saved layers at every block of the model, spliced at once, on held-out text
and on a text they never saw (:mod:`mxd_lens.replacement`, :func:`mxd_lens.evaluation.evaluate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.replacement import ReplacementOptions

BLOCK_COLUMNS = ("kl", "delta_ce", "fvu", "l0", "always_on", "dead_fraction", "effective_units")


def run(
    model: Any, options: ReplacementOptions, out: Path | None = None, progress: bool = True
) -> StudyResult:
    import pandas as pd

    from mxd_lens.evaluation import evaluate
    from mxd_lens.layers.registry import layer_arch
    from mxd_lens.replacement import by_block, compounding, compounding_figure, exactness
    from mxd_lens.studies.common import recorded_options
    from mxd_lens.studies.eval import EvalOptions
    from mxd_lens.studies.eval.run import saved_layers_on_held_out

    if options.eval_tokens <= 0:
        raise ValueError(f"--eval-tokens {options.eval_tokens}: evaluate at least one row of tokens")
    texts = [("held-out", options.text, "eval")] + (
        [("ood", options.ood_text, "all")] if options.ood_text else []
    )
    whole, blocks, curves, record = [], [], {}, {"options": recorded_options(options), "texts": {}}
    label = options.label
    for kind, text, split in texts:
        config = EvalOptions(layers=options.layers, text=text, split=split, eval_tokens=options.eval_tokens,
                             context_size=options.context_size, rows_per_forward=options.rows_per_forward,
                             write=False)  # fmt: skip
        _, layers, batches, eval_info = saved_layers_on_held_out(model, config)
        placed = by_block(layers, model, every=True)
        arch = sorted({layer_arch(layer) for layer in placed.values()})
        label = label or "+".join(arch)
        rows = evaluate(
            model, layers, batches, together=True, baselines=False, jacobian_tokens=0, progress=progress
        )
        together = rows[-1]
        exact = exactness(model, placed, batches)
        whole.append({"method": label, "text": kind, "tokens": together["tokens"], "blocks": len(placed),
                      "kl": together["kl"], "delta_ce": together["delta_ce"], "ce_clean": together["ce_clean"],
                      "ce_spliced": together["ce_spliced"], "kl_se": together.get("kl_se"),
                      "delta_ce_se": together.get("delta_ce_se"), "exact_kl": exact["kl"],
                      "exact_max_abs_logprob_diff": exact["max_abs_logprob_diff"]})  # fmt: skip
        for row in rows[:-1]:
            blocks.append({"method": label, "text": kind, "block": int(row["block"]),
                           **{c: row.get(c) for c in BLOCK_COLUMNS}, "tokens": row["tokens"]})  # fmt: skip
        if options.compounding:
            curve = compounding(model, placed, batches, progress=progress)
            curves[f"{label}, {kind}"] = curve
            record["texts"][kind] = {"text": eval_info, "compounding": curve}
        else:
            record["texts"][kind] = {"text": eval_info}
    table = pd.DataFrame(whole)
    block_table = pd.DataFrame(blocks).sort_values(["text", "block"]).reset_index(drop=True)
    tables = {"blocks.csv": block_table}
    figures = {"blocks.png": blocks_figure(block_table, label)}
    if curves:
        tables["compounding.csv"] = pd.DataFrame(
            [
                {"method": label, "text": key.rpartition(", ")[2], **row}
                for key, rows in curves.items()
                for row in rows
            ]
        )
        figures["compounding.png"] = compounding_figure(
            curves, title=f"{label}: the first n blocks spliced at once"
        )
    text = (
        f"{label} at all {len(placed)} blocks, spliced at once; exact_*: every layer spliced with its error "
        "term (must be ~0). Per block (each alone): blocks.csv; the first n blocks spliced: compounding.csv"
    )
    return StudyResult(
        name="replacement", table=table, record=record, tables=tables, figures=figures, text=text
    )


def blocks_figure(table: Any, label: str) -> Any:
    """Each block alone: KL (log) and FVU against the block, one line per text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for kind, part in table.groupby("text"):
        axes[0].plot(part["block"], part["kl"], marker="o", markersize=3, label=kind)
        axes[1].plot(part["block"], part["fvu"], marker="o", markersize=3, label=kind)
        axes[2].plot(part["block"], part["always_on"], marker="o", markersize=3, label=kind)
    axes[0].set_yscale("log")
    for ax, name in zip(axes, ("KL, this block alone", "FVU", "always-on units"), strict=True):
        ax.set_xlabel("block")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{label}: each block's layer spliced alone")
    fig.tight_layout()
    return fig

"""The frontier study: parameter-matched MxD, TopK transcoder and skip transcoder at several K,
trained from one cached activation stream and spliced into the model on held-out text.

``run_frontier`` does it all and writes, under ``out``: ``cache/`` (activations, reusable; or the
folder ``cache``), ``runs/`` (checkpoints and SAELens-format weights; ``runs-seed{S}/`` for other
seeds), ``frontier.json`` (config, command, one record per layer), ``frontier.csv`` and
``frontier.png`` (ΔCE and FVU against K, one panel per block, one line per method, error bars over
seeds, as in the paper).

What is trained is a grid: ``blocks`` × ``ks`` × ``archs`` at ``seed``, plus any ``grid`` entries
``"BLOCK:K,K,...[@SEED,SEED,...]"`` (e.g. ``"25:32"``, ``"15:32@1"``). The learners of one (block,
seed) train together from one stream (one Trainer) and are evaluated together as soon as they finish
(one clean forward and one set of ablation baselines per group, on the same held-out batches for all
groups), so the first block's results exist before the others are trained.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mxd_lens import data
from mxd_lens.activations import (
    MANIFEST,
    CachedActivations,
    ModelActivations,
    StreamConfig,
    StreamInfo,
    read_manifest,
    write_cache,
)
from mxd_lens.evaluation import check_disjoint, evaluate, held_out_batches
from mxd_lens.fileio import atomic_write_text
from mxd_lens.layers import arch_label
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.records import loadable_name
from mxd_lens.studies import StudyResult
from mxd_lens.studies.common import recorded_options
from mxd_lens.studies.eval.run import record_evaluation
from mxd_lens.studies.frontier import FrontierConfig, FrontierOptions, ReportOptions, budget_words
from mxd_lens.training import Trainer

log = logging.getLogger(__name__)


def eval_batches(model: Any, config: FrontierConfig) -> list[torch.Tensor]:
    """Held-out [rows, context] token batches: the 'eval' side of the split, ``eval_tokens`` in all."""
    if config.eval_text is not None:
        return held_out_batches(model, config.eval_text, "all", config.eval_tokens, config.context_size,
                                config.eval_rows_per_forward)  # fmt: skip
    return held_out_batches(model, config.text, "eval", config.eval_tokens, config.context_size,
                            config.eval_rows_per_forward, config.eval_fraction, config.split_seed)  # fmt: skip


def check_texts(model: Any, config: FrontierConfig) -> None:
    """Read every text the study reads (the training text's train side; the held-out text, or the
    training text's eval side; the out-of-domain text) until it fills one row of ``context_size``
    tokens, so an empty, short, undecodable or mis-fielded text is refused, naming it, before anything
    is cached or trained (the held-out ones would otherwise fail only once training is done)."""
    rows = data.TokenRows.for_model(model, config.context_size)
    held_out = (config.eval_text, "all") if config.eval_text is not None else (config.text, "eval")
    for text, split in ((config.text, "train"), held_out, (config.ood_text, "all")):
        if text is None:
            continue
        texts = data.iter_texts(text)
        if split != "all":
            texts = data.split_texts(texts, split, config.eval_fraction, config.split_seed)
        name = data.text_name(text) + ("" if split == "all" else f" (its {split} side)")
        next(rows.rows(texts, name=name))  # a ValueError naming the text when it fills no row


def write_frontier_cache(
    model: Any, config: FrontierConfig, out: str | Path, progress: bool = True
) -> tuple[Path, dict[str, Any], int]:
    """Write (or check, repair, extend) the study's activation cache; (folder, text info, shards)."""
    out = Path(out)
    cache = Path(config.cache) if config.cache else out / "cache"
    blocks = config.all_blocks
    if (cache / MANIFEST).is_file():  # a shared cache may hold more blocks than this study needs
        blocks = sorted(set(blocks) | set(StreamInfo.from_dict(read_manifest(cache)["stream"]).blocks))
    stream_config = StreamConfig(
        text=config.text,
        **{k: getattr(config, k) for k in ("context_size", "rows_per_shard", "eval_fraction", "split_seed")},
    )
    stream = ModelActivations.from_config(model, blocks, stream_config)
    n_shards = math.ceil(config.train_tokens / stream.info.tokens_per_shard)
    write_cache(
        stream,
        cache,
        n_shards=n_shards,
        dtype=config.cache_dtype,
        progress=progress,
        text_info=stream.text_info,
    )
    return cache, stream.text_info, n_shards


def run_frontier(
    model: Any, config: FrontierConfig, out: str | Path, progress: bool = True
) -> list[dict[str, Any]]:
    """Cache, train every (arch, K) at every layer from the one stream, evaluate, write results."""
    out = Path(out)
    check_texts(model, config)  # a wrong or short text fails now, not after the cache and training
    out.mkdir(parents=True, exist_ok=True)
    cache, text_info, n_shards = write_frontier_cache(model, config, out, progress)
    if config.eval_text is not None:
        eval_info = {
            "text": data.text_name(config.eval_text),
            "split": "all",
            "digests": data.source_digests(config.eval_text),
        }
    else:
        eval_info = {**text_info, "split": "eval"}
    eval_key = {
        "model": model.cfg.model_name,
        **{k: getattr(config, k) for k in ("eval_text", "eval_tokens", "context_size")},
        "eval_batch_rows": config.eval_rows_per_forward,  # its recorded name: earlier evaluations still match
        # rows spliced at every position, BOS too (before hooks.first_position), are evaluated again
        "splice": "trained positions",
        **(
            {"ood_text": config.ood_text, "ood_eval_tokens": config.ood_eval_tokens}
            if config.ood_text
            else {}
        ),
        **({} if config.eval_text else {k: text_info[k] for k in ("text", "eval_fraction", "split_seed")}),
    }
    batches: list[torch.Tensor] | None = None
    ood_batches: list[torch.Tensor] | None = None
    rows_out: list[dict[str, Any]] = []
    # One Trainer per (block, seed), in the order the config names them (so the first block's layers
    # are trained and evaluated first); each group's evaluation is kept beside its weights.
    groups = list(dict.fromkeys((block, seed) for block, _, seed in config.learners()))
    budget_said = False
    for block, seed in groups:
        specs = [
            LearnerSpec(
                arch, block, k, config.width_multiplier, lr=config.lr_of(arch), init=_init(arch, config)
            )
            for b, k, s in config.learners()
            if (b, s) == (block, seed)
            for arch in config.archs
        ]
        folder = out / "runs" / f"L{block}.seed{seed}"
        evaluated = folder / "eval.json"
        if evaluated.is_file() and (record := json.loads(evaluated.read_text()))["key"] == eval_key:
            # rows written before the block index's column was renamed from "layer"
            rows_out += [
                {("block" if k == "layer" else k): v for k, v in row.items()} for row in record["rows"]
            ]
            write_results(rows_out, config, out)
            continue
        source = CachedActivations(
            cache, blocks=[block], expect={"model_name": loadable_name(model)}, max_shards=n_shards
        )
        train_config = config.train_config(seed)
        if not budget_said:  # the trainer's own note counts epochs over the cache; this says why not --epochs
            log.info("frontier: each layer trains on %s", budget_words(
                train_config.total_tokens, source.epoch_tokens, config.train.epochs, config.train_tokens))  # fmt: skip
            budget_said = True
        trainer = Trainer(
            specs, source, train_config, folder, model=model, progress=progress, data_info=text_info
        )
        train_metrics = trainer.fit(resume=True)
        layers = {name: layer.eval() for name, layer in trainer.trained_layers().items()}
        for layer in layers.values():
            check_disjoint(layer.cfg.metadata.training["data"], eval_info)
        # the held-out rows are kept on their own until the group ends: a failure on the out-of-domain
        # text resumes there, not with the held-out evaluation again (17 minutes on Gemma's vocabulary)
        held_out = folder / "eval-held-out.json"
        held_key = json.loads(json.dumps({
            **{k: v for k, v in eval_key.items() if not k.startswith("ood_")},
            "train_config": asdict(train_config), "tokens_seen": trainer.tokens_seen, "layers": sorted(layers),
        }))  # fmt: skip
        if held_out.is_file() and (record := json.loads(held_out.read_text()))["key"] == held_key:
            rows = record["rows"]
        else:
            if batches is None:
                batches = eval_batches(model, config)
            rows = evaluate(model, layers, batches, progress=progress)
            for row in rows:  # in each layer's cfg.json too, as `mxd-lens eval` records it (`mxd-lens info`)
                record_evaluation(
                    folder / "final" / row["name"], row, eval_info, config.context_size, 0, model
                )
            atomic_write_text(held_out, json.dumps({"key": held_key, "rows": rows}, indent=1))
        if config.ood_text is not None:
            if ood_batches is None:
                ood_batches = held_out_batches(model, config.ood_text, "all",
                                               config.ood_eval_tokens or config.eval_tokens,
                                               config.context_size, config.eval_rows_per_forward)  # fmt: skip
            ood_info = {"text": data.text_name(config.ood_text), "split": "all", "eval_fraction": 1.0,
                        "digests": data.source_digests(config.ood_text)}  # fmt: skip
            for row, ood in zip(rows, evaluate(model, layers, ood_batches, progress=progress), strict=True):
                row.update({f"ood_{key}": value for key, value in ood.items() if key not in _IDENTITY})
                record_evaluation(
                    folder / "final" / row["name"], ood, ood_info, config.context_size, 0, model
                )
        for row in rows:
            spec = trainer.learners[row["name"]].spec
            row.update(
                arch=spec.method,  # the architecture key with its options: "mxd", "mxd:gate=topk"
                seed=seed,
                width_multiplier=spec.width_multiplier,
                init=spec.init,
                train_tokens=trainer.tokens_seen,
                epochs=trainer.tokens_seen / trainer.epoch_tokens if trainer.epoch_tokens else None,
                train_fvu=train_metrics[row["name"]]["fvu"],
                train_dead_fraction=train_metrics[row["name"]].get("dead_fraction"),
                lr=spec.lr if spec.lr is not None else train_config.lr,
                grad_clip=train_config.grad_clip,
                weights=str(folder / "final" / row["name"]),
                model=model.cfg.model_name,
            )
        atomic_write_text(
            evaluated,
            json.dumps({"key": eval_key, "train_config": asdict(train_config), "rows": rows}, indent=1),
        )
        held_out.unlink()
        rows_out += rows
        write_results(rows_out, config, out)
    return rows_out


_IDENTITY = ("name", "architecture", "block", "k", "d_sae", "params")  # not metrics: not repeated as ood_*


def write_results(rows: list[dict[str, Any]], config: FrontierConfig, out: Path) -> None:
    """frontier.json (command, config, the trainer's settings, rows), frontier.csv, frontier.png (after
    each group, so a long study's results so far are on disk)."""
    from mxd_lens.studies.report import write_result

    write_result(frontier_result(rows, config), out)


def frontier_result(rows: list[dict[str, Any]], config: FrontierConfig) -> StudyResult:
    """The study's rows as a result: frontier.csv, frontier.json, frontier.png; the printed table."""
    import pandas as pd

    from mxd_lens.studies.report import columns

    record = {
        "command": shlex.join(sys.argv),
        "config": recorded_options(config),
        "train_config": asdict(config.train_config(config.seed)),
        "results": rows,
    }
    table = pd.DataFrame(rows)
    return StudyResult(
        name="frontier",
        table=table,
        record=record,
        figures={"frontier.png": plot_frontier(table)},
        columns=columns(
            "arch",
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
        ),  # fmt: skip
        value=rows,
    )


def load_results(path: str | Path, overrides: Sequence[str | Path] = ()) -> Any:
    """The rows of a frontier.json (``path``: the file or its folder) as a DataFrame; results written
    before the block/layer rename (a ``layer`` column) are read with it named ``block``. Each of
    ``overrides`` (another study's frontier.json or folder, e.g. a rerun of one point with other
    settings) replaces the rows of the same (block, K, arch, seed) and adds its others. Every row
    has ``grad_clip``: the trainer's gradient clipping (None: off, as before it existed) and
    ``study``: the folder it came from."""
    import pandas as pd

    tables = [_read_results(Path(p)) for p in (path, *overrides)]
    keys = ["block", "k", "arch", "seed"]
    table = tables[0]
    for other in tables[1:]:
        replaced = table.set_index(keys).index.isin(other.set_index(keys).index)
        table = pd.concat([table[~replaced], other], ignore_index=True)
    return table


def _read_results(path: Path) -> Any:
    import pandas as pd

    if path.is_dir():
        path = path / "frontier.json"
    if not path.is_file():
        raise FileNotFoundError(f"no frontier results at {path}: run mxd-lens frontier first")
    record = json.loads(path.read_text())
    table = pd.DataFrame(record["results"])
    if "block" not in table and "layer" in table:
        table = table.rename(columns={"layer": "block"})
    if "seed" not in table:
        table["seed"] = 0
    # rows name the architecture by its key ("mxd", "mxd:gate=topk") in ``arch``; rows written before
    # it have ``method``, holding the key or, older still, the label ("MxD")
    from mxd_lens.layers import ARCHITECTURES

    if "arch" not in table and "method" in table:
        table = table.rename(columns={"method": "arch"})
    table = table.drop(columns=["label"], errors="ignore")  # rendered from the key where shown
    keys = {cls.label: key for key, cls in ARCHITECTURES.items()}
    table["arch"] = table["arch"].map(lambda m: keys.get(m, m))
    if "grad_clip" not in table:  # rows written before it was recorded per row: the study's setting
        table["grad_clip"] = (record.get("train_config") or {}).get("grad_clip")
    table["study"] = str(path.parent)
    return table


SUMMARY_METRICS = ("delta_ce", "kl", "fvu", "l0", "dead_fraction", "ce_recovered_zero")
# what each unit does and the out-of-domain evaluation, where the rows have them (studies since the
# review protocol): averaged over seeds like the metrics above
USAGE_METRICS = ("always_on", "effective_units", "top1_fvu", "jacobian_cos", "ood_delta_ce", "ood_kl", "ood_fvu",
                 "ood_l0", "ood_dead_fraction")  # fmt: skip


def summarize(table: Any) -> Any:
    """One row per (block, K, arch): the mean over seeds of each metric, ``seeds``, the ΔCE range
    over seeds (``delta_ce_min``, ``delta_ce_max``), and ``delta_ce_vs_transcoder``: the method's mean
    ΔCE over the TopK transcoder's at the same block and K (NaN where there is none, or where the
    transcoder's ΔCE is not positive), and ``kl_vs_transcoder`` likewise for KL (always defined: KL >= 0)."""
    keys = ["block", "k", "arch"]
    grouped = table.groupby(keys)
    extra = [m for m in USAGE_METRICS if m in table and table[m].notna().any()]
    summary = grouped[list(SUMMARY_METRICS) + extra].mean()
    for metric in ("kl", "ood_kl", "l0"):
        if metric in table:
            summary[f"{metric}_min"], summary[f"{metric}_max"] = grouped[metric].min(), grouped[metric].max()
    summary["seeds"] = grouped["seed"].nunique() if "seed" in table else 1
    summary["delta_ce_min"] = grouped["delta_ce"].min()
    summary["delta_ce_max"] = grouped["delta_ce"].max()
    if "grad_clip" in table:
        # the seeds' common setting; "mixed" where they differ (their mean mixes two recipes)
        summary["grad_clip"] = grouped["grad_clip"].agg(_common_clip)
    summary = summary.reset_index()
    reference = summary[summary["arch"] == "transcoder"].set_index(["block", "k"])["delta_ce"]
    ratio = summary.set_index(["block", "k"]).index.map(lambda key: reference.get(key, float("nan")))
    reference = ratio.to_numpy(dtype=float)
    # a ratio of ΔCE means something only over a positive reference (a layer can lower the CE)
    summary["delta_ce_vs_transcoder"] = summary["delta_ce"].to_numpy() / np.where(
        reference > 0, reference, np.nan
    )
    kl = summary[summary["arch"] == "transcoder"].set_index(["block", "k"])["kl"]
    kl_ref = summary.set_index(["block", "k"]).index.map(lambda key: kl.get(key, float("nan")))
    summary["kl_vs_transcoder"] = summary["kl"].to_numpy() / kl_ref.to_numpy(dtype=float)
    return summary.sort_values(keys, key=lambda c: c.map(_METHOD_ORDER) if c.name == "arch" else c)


def _common_clip(values: Any) -> Any:
    settings = {None if _missing(v) else float(v) for v in values}
    return settings.pop() if len(settings) == 1 else "mixed"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


_METHOD_ORDER = {"mxd": 0, "skip_transcoder": 1, "transcoder": 2, "batchtopk_transcoder": 3}


def usage_markdown(summary: Any) -> str:
    """The review protocol's table: per (block, K, arch) the L0 each layer measured, how its units are
    used, its fidelity in domain (KL, ΔCE, FVU, Jacobian cosine) and on the out-of-domain text, with the
    min–max over seeds where there are several. Empty when the rows lack these metrics."""
    import pandas as pd

    from mxd_lens.layers import arch_label

    if "always_on" not in summary or "ood_kl" not in summary:
        return ""

    def spread(r, metric, fmt):
        value = format(r[metric], fmt)
        if r.seeds > 1 and f"{metric}_min" in r:
            value += f" [{format(r[f'{metric}_min'], fmt)}, {format(r[f'{metric}_max'], fmt)}]"
        return value

    rows = [
        {
            "block": int(r.block), "K": int(r.k), "method": arch_label(r.arch), "seeds": int(r.seeds),
            "L0": spread(r, "l0", ".1f"), "always on": f"{r.always_on:.0f}",
            "effective": f"{r.effective_units:.1f}", "top-1 FVU": f"{r.top1_fvu:.2f}",
            "silent": f"{100 * r.dead_fraction:.0f}%", "KL": spread(r, "kl", ".4f"), "ΔCE": f"{r.delta_ce:+.4f}",
            "FVU": f"{r.fvu:.3f}", "Jacobian cos": f"{r.jacobian_cos:.2f}",
            "KL (OOD)": spread(r, "ood_kl", ".4f"), "ΔCE (OOD)": f"{r.ood_delta_ce:+.4f}", "FVU (OOD)": f"{r.ood_fvu:.3f}",
        }
        for _, r in summary.iterrows()
    ]  # fmt: skip
    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)


def summary_markdown(summary: Any) -> str:
    """``summarize``'s table as markdown, as a reader cites it: ΔCE with its seed range, KL, FVU, L0,
    dead %, CE recovered and the ΔCE ratio to the transcoder."""
    clips = summary["grad_clip"] if "grad_clip" in summary else None
    show_clip = clips is not None and clips.map(str).nunique() > 1  # only when the rows differ
    rows = []
    for _, r in summary.iterrows():
        spread = f" [{r.delta_ce_min:+.4f}, {r.delta_ce_max:+.4f}]" if r.seeds > 1 else ""
        rows.append(
            {
                "block": int(r.block),
                "K": int(r.k),
                "arch": r.arch,
                "seeds": int(r.seeds),
                "ΔCE": f"{r.delta_ce:+.4f}{spread}",
                "ΔCE / transcoder's": ""
                if math.isnan(r.delta_ce_vs_transcoder)
                else f"{r.delta_ce_vs_transcoder:.2f}",
                "KL": f"{r.kl:.4f}",
                "KL / transcoder's": "" if math.isnan(r.kl_vs_transcoder) else f"{r.kl_vs_transcoder:.2f}",
                "FVU": f"{r.fvu:.3f}",
                "L0": f"{r.l0:.1f}",
                "dead": f"{100 * r.dead_fraction:.1f}%",
                "CE recovered": f"{r.ce_recovered_zero:.3f}",
            }
        )
        if show_clip:
            clip = r.grad_clip
            rows[-1]["grad clip"] = (
                "off" if _missing(clip) else clip if isinstance(clip, str) else f"{clip:g}"
            )
    import pandas as pd

    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)


def plot_frontier(table: Any, path: Path | None = None, x: str = "k", prefix: str = "") -> Any:
    """ΔCE, KL and FVU against K (``x="k"``) or against the L0 each layer measured (``x="l0"``: where a
    method that asked for K uses fewer codes, its points sit left of K, and methods compare at matched
    L0, as transcoder papers plot it): one column of panels per block, one line per method, the mean over
    seeds with error bars (min to max) where there are several; KL and FVU on log scales (they span
    decades; a diverged layer would flatten a linear axis). ``prefix="ood_"`` plots the out-of-domain
    evaluation. Returns the Figure (saved to ``path``)."""
    if x not in ("k", "l0"):
        raise ValueError(f"x={x!r}: choose 'k' or 'l0'")
    from matplotlib.figure import Figure

    panels = (
        ("delta_ce", "ΔCE (nats/token) when spliced", "linear"),
        ("kl", "KL(clean ‖ spliced) per token", "log"),
        ("fvu", "FVU of the MLP output", "log"),
    )
    blocks = sorted(table["block"].unique())
    fig = Figure(figsize=(4.4 * len(blocks) + 1.5, 10.5), layout="constrained")
    axes = fig.subplots(len(panels), len(blocks), squeeze=False)
    ks = sorted(table["k"].unique())
    for col, block in enumerate(blocks):
        for method, group in table[table["block"] == block].groupby("arch"):
            label = arch_label(method)
            for row, (column, _, _) in enumerate(panels):
                stats = group.groupby("k")[prefix + column].agg(["mean", "min", "max"]).sort_index()
                where = stats.index if x == "k" else group.groupby("k")[prefix + "l0"].mean().sort_index()
                err = [stats["mean"] - stats["min"], stats["max"] - stats["mean"]]
                axes[row, col].errorbar(where, stats["mean"], yerr=err, marker="o", capsize=3, label=label)
        for row, (_, title, scale) in enumerate(panels):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_yscale(scale)
            if x == "k":
                ax.set_xticks(ks, labels=[str(k) for k in ks])
            ax.set_xlabel(
                "K (active units per token)" if x == "k" else "L0 measured (active codes per token)"
            )
            where = " (out-of-domain text)" if prefix == "ood_" else ""
            ax.set_title(f"block {block}: {title}{where}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[0, col].axhline(0, color="grey", lw=0.8)
    handles, labels = axes[0, 0].get_legend_handles_labels()  # below the panels, where it hides no curve
    fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)), fontsize=8)
    model = table["model"].iloc[0]
    m = table["width_multiplier"].iloc[0]
    tokens = table["train_tokens"].iloc[0]
    seeds = table["seed"].nunique() if "seed" in table else 1
    spread = f"\nbars: min-max over {seeds} seeds" if seeds > 1 else ""  # a line of its own: narrow figures
    fig.suptitle(f"{model}, m = {m}, {tokens:,} training tokens{spread}", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def run(model: Any, options: FrontierOptions, out: Path, progress: bool | None = None) -> StudyResult:
    """The verb ``mxd-lens frontier``: the study (or, with ``cache_only``, only its activation cache)."""
    config = options.config()
    progress = options.progress if progress is None else progress
    if options.cache_only:
        cache, _, n_shards = write_frontier_cache(model, config, out, progress)
        return StudyResult(name="frontier", text=f"cache: {cache} ({n_shards} shards)")
    rows = run_frontier(model, config, out, progress=progress)
    result = frontier_result(rows, config)
    result.text = f"results in {out}/frontier.json|csv|png"
    return result


def report(model: Any, options: ReportOptions, out: Path) -> StudyResult:
    """The verb ``mxd-lens frontier-report``: summary.md and the plots (against K, and against measured
    L0 in and out of domain where the rows have the usage diagnostics) from OUT/frontier.json, with the
    rows of ``options.override`` studies in place of OUT's at the same (block, K, arch, seed)."""
    table = load_results(out, options.override)
    summary = summarize(table)
    text = summary_markdown(summary)
    figures = {"frontier.png": plot_frontier(table)}
    usage = usage_markdown(summary)
    if usage:  # studies with the usage diagnostics and an out-of-domain text
        text += "\n\nHow the units are used, and the out-of-domain text:\n\n" + usage
        figures["frontier-l0.png"] = plot_frontier(table, x="l0")
        figures["frontier-l0-ood.png"] = plot_frontier(table, x="l0", prefix="ood_")
    return StudyResult(
        name="summary", figures=figures, pages={"summary.md": text + "\n"}, text=text, value=summary
    )


def _init(arch: str, config: Any) -> str:
    """The learner's start: the study's ``init`` for an architecture that takes the host MLP's weights."""
    from mxd_lens.layers import get_architecture, parse_arch

    if config.init == "mlp" and get_architecture(parse_arch(arch)[0]).copies_host_mlp:
        return "mlp"
    return "default"

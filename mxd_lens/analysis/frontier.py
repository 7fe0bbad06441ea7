"""The sparsity–accuracy frontier: parameter-matched MxD, TopK transcoder and skip transcoder at several
K, trained from one cached activation stream and spliced into the model on held-out text.

``run_frontier`` does it all and writes, under ``out``: ``cache/`` (activations, reusable), ``runs/``
(checkpoints and SAELens-format weights), ``frontier.json`` (config, command, one record per layer),
``frontier.csv`` and ``frontier.png`` (ΔCE and FVU against K, one line per method, as in the paper).
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxd_lens import data
from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
from mxd_lens.evaluation import check_disjoint, evaluate
from mxd_lens.training import LearnerSpec, TrainConfig, Trainer

METHODS = {"mxd": "MxD", "transcoder": "Transcoder", "skip_transcoder": "Skip transcoder"}


@dataclass
class FrontierConfig:
    """What to compare. ``train_tokens`` are drawn from the 'train' side of ``text``'s document split,
    ``eval_tokens`` from its 'eval' side (never the same documents)."""

    text: str
    layers: list[int]
    ks: list[int] = field(default_factory=lambda: [16, 32, 64])
    width_multiplier: int = 8
    archs: list[str] = field(default_factory=lambda: list(METHODS))
    train_tokens: int = 1_000_000  # tokens cached from the train split
    epochs: float = 1.0  # passes over them
    eval_tokens: int = 25_600
    context_size: int = 128
    batch_tokens: int = TrainConfig.batch_tokens
    lr: float = TrainConfig.lr
    warmup_steps: int | None = None  # None: the trainer's default fraction of the steps
    rows_per_block: int = 256
    eval_batch_rows: int = 8
    eval_fraction: float = 0.02
    split_seed: int = 0
    seed: int = 0
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.archs) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown architectures {unknown}; choose from {list(METHODS)}")
        if not self.layers or not self.ks:
            raise ValueError("give at least one layer and one K")

    @property
    def steps(self) -> int:
        return int(self.epochs * self.train_tokens) // self.batch_tokens


def eval_batches(model: Any, config: FrontierConfig) -> list[torch.Tensor]:
    """Held-out [rows, context] token batches: the 'eval' side of the split, ``eval_tokens`` in all."""
    rows = data.TokenRows.for_model(model, config.context_size)
    texts = data.split_texts(data.iter_texts(config.text), "eval", config.eval_fraction, config.split_seed)
    n_rows = max(1, math.ceil(config.eval_tokens / config.context_size))
    held_out = list(itertools.islice(rows.rows(texts), n_rows))
    if len(held_out) < n_rows:
        print(
            f"note: the eval split holds {len(held_out) * config.context_size:,} tokens, fewer than asked",
            file=sys.stderr,
        )
    return [
        torch.stack(held_out[i : i + config.eval_batch_rows])
        for i in range(0, len(held_out), config.eval_batch_rows)
    ]


def run_frontier(
    model: Any, config: FrontierConfig, out: str | Path, progress: bool = True
) -> list[dict[str, Any]]:
    """Cache, train every (arch, K) at every layer from the one stream, evaluate, write results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stream = ModelActivations.from_text(
        model,
        config.layers,
        config.text,
        config.context_size,
        eval_fraction=config.eval_fraction,
        split_seed=config.split_seed,
        rows_per_block=config.rows_per_block,
    )
    text_info = stream.text_info
    n_blocks = math.ceil(config.train_tokens / stream.info.tokens_per_block)
    write_cache(
        stream,
        out / "cache",
        n_blocks=n_blocks,
        dtype=config.cache_dtype,
        progress=progress,
        text_info=text_info,
    )
    source = CachedActivations(
        out / "cache", layers=config.layers, expect={"model_name": model.cfg.model_name}
    )

    specs = [
        LearnerSpec(arch, layer, k, config.width_multiplier)
        for layer in config.layers
        for arch in config.archs
        for k in config.ks
    ]
    train_config = TrainConfig(
        total_tokens=config.steps * config.batch_tokens,
        batch_tokens=config.batch_tokens,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        seed=config.seed,
        checkpoint_every=max(50, config.steps // 10),
        log_every=max(1, config.steps // 50),
    )
    trainer = Trainer(specs, source, train_config, out / "runs", progress=progress, data_info=text_info)
    train_metrics = trainer.fit(resume=True)

    eval_info = {**text_info, "split": "eval"}
    layers = {name: layer.eval() for name, layer in trainer.trained_layers().items()}
    for layer in layers.values():
        check_disjoint(layer.cfg.metadata.training["data"], eval_info)
    batches = eval_batches(model, config)
    rows_out = evaluate(model, layers, batches, progress=progress)
    for row in rows_out:
        spec = trainer.learners[row["name"]].spec
        row.update(
            method=METHODS[spec.arch],
            width_multiplier=spec.width_multiplier,
            train_tokens=trainer.tokens_seen,
            train_fvu=train_metrics[row["name"]]["fvu"],
            model=model.cfg.model_name,
        )
    write_results(rows_out, config, train_config, out)
    return rows_out


def write_results(
    rows: list[dict[str, Any]], config: FrontierConfig, train_config: TrainConfig, out: Path
) -> None:
    import pandas as pd

    record = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "config": asdict(config),
        "train_config": asdict(train_config),
        "results": rows,
    }
    (out / "frontier.json").write_text(json.dumps(record, indent=2))
    table = pd.DataFrame(rows)
    table.to_csv(out / "frontier.csv", index=False)
    plot_frontier(table, out / "frontier.png")


def plot_frontier(table: Any, path: Path) -> None:
    """ΔCE and FVU against K, one line per method (and per layer when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (method, layer), group in table.groupby(["method", "layer"]):
        group = group.sort_values("k")
        label = method if table["layer"].nunique() == 1 else f"{method} (layer {layer})"
        for ax, column in zip(axes, ("delta_ce", "fvu"), strict=True):
            ax.plot(group["k"], group[column], marker="o", label=label)
    model = table["model"].iloc[0]
    m = table["width_multiplier"].iloc[0]
    tokens = table["train_tokens"].iloc[0]
    for ax, title in zip(axes, ("ΔCE (nats/token) when spliced", "FVU of the MLP output"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(table["k"].unique()), labels=[str(k) for k in sorted(table["k"].unique())])
        ax.set_xlabel("K (active units per token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{model}: parameter-matched at m = {m}, {tokens:,} training tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

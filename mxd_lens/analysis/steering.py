"""Steering with one expert coefficient (MxD) or latent (transcoder), judged without a paid LLM.

``steer(model, layer, feature, alpha)`` edits the codes of a layer spliced into ``model``: it adds
``alpha`` to code ``feature`` at every position (``mode="add"``, the paper's protocol) or sets it to
``alpha`` (``mode="clamp"``). Use it inside ``mxd_lens.splice`` (with ``error_term=True`` the model is
exactly the clean model at ``alpha = 0`` in add mode, so every change comes from the edit)::

    with mxd_lens.splice(model, layer, error_term=True), steer(model, layer, 1234, 40.0):
        generation = generate(model, "Let's talk about", n_samples=10)

Scoring: a ``Scorer`` maps a ``Generation`` to one number per sample. Built in: ``ProbeScorer`` (a
concept probe, e.g. the dense probe of a sparse-probing task, reading the clean model's pooled MLP
activations over the generated tokens: the concept's strength) and ``PerplexityScorer`` (the clean
model's perplexity of the generated tokens after the prompt: fluency). An LLM judge is one more class
with ``name`` and ``__call__(generation) -> list[float]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm.auto import tqdm

from mxd_lens import hooks
from mxd_lens.config import NEUTRAL_PROMPT

if TYPE_CHECKING:
    import pandas as pd
    from transformer_lens import HookedTransformer

    from mxd_lens.layers.base import MLPReplacement

log = logging.getLogger(__name__)


@contextmanager
def steer(
    model: HookedTransformer,
    layer: MLPReplacement,
    feature: int | Sequence[int],
    alpha: float | Sequence[float],
    mode: str = "add",
) -> Iterator[HookedTransformer]:
    """Edit ``layer``'s codes while ``model`` runs: ``codes[..., f] += alpha`` (add) or ``= alpha``
    (clamp) at every position, for each feature ``f`` (with its own alpha when a sequence is given).
    ``layer`` must be spliced into ``model`` (``mxd_lens.splice``) or attached to a
    ``HookedSAETransformer`` with ``model.add_sae(layer)`` (``load_model(..., cls=HookedSAETransformer)``)."""
    features = [feature] if isinstance(feature, int) else list(feature)
    alphas = [float(alpha)] * len(features) if isinstance(alpha, (int, float)) else [float(a) for a in alpha]
    if mode not in ("add", "clamp"):
        raise ValueError(f"mode={mode!r}: choose 'add' or 'clamp'")
    if len(alphas) != len(features):
        raise ValueError(f"{len(features)} features but {len(alphas)} alphas")
    if not all(math.isfinite(a) for a in alphas):
        raise ValueError(f"alpha must be finite, got {alphas}: a NaN or infinite code makes every logit NaN")
    bad = [
        f for f in features if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < layer.cfg.d_sae
    ]
    if bad:
        raise IndexError(
            f"features {bad} out of range: this layer has {layer.cfg.d_sae} (0..{layer.cfg.d_sae - 1})"
        )
    index = hooks.block_of(layer)
    attached = any(sae is layer for sae in getattr(model, "acts_to_saes", {}).values())  # add_sae
    if hooks.spliced_layers(model).get(index) is not layer and not attached:
        raise ValueError(
            f"this layer is not spliced into {model.cfg.model_name} (block {index}): steer inside "
            "`with mxd_lens.splice(model, layer, error_term=True):`, or attach it to a "
            "HookedSAETransformer with model.add_sae(layer, use_error_term=True)"
        )
    cols = torch.tensor(features)

    def edit(module: Any, inputs: Any, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.clone()
        values = torch.tensor(alphas, dtype=codes.dtype, device=codes.device)
        if mode == "add":
            codes[..., cols] += values
        else:
            codes[..., cols] = values.expand_as(codes[..., cols])
        return codes

    handle = layer.hook_sae_acts_post.register_forward_hook(edit)
    try:
        yield model
    finally:
        handle.remove()


@dataclass
class Generation:
    """Samples from one prompt: ``tokens`` [n, prompt_len + new] (the prompt's tokens first)."""

    prompt: str
    tokens: torch.Tensor
    prompt_len: int
    texts: list[str]  # the generated continuations only


@torch.no_grad()
def generate(
    model: HookedTransformer,
    prompt: str = NEUTRAL_PROMPT,
    n_samples: int = 10,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float | None = None,
    seed: int = 0,
) -> Generation:
    """``n_samples`` continuations sampled with hooks as they are (steer/splice apply); the random
    state is forked, so the same seed gives the same samples under different steering."""
    if n_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"n_samples={n_samples} and max_new_tokens={max_new_tokens} must be >= 1")
    prompt_tokens = model.to_tokens(prompt)
    start = prompt_tokens.shape[1]
    if start + max_new_tokens > model.cfg.n_ctx:
        raise ValueError(f"{start} prompt + {max_new_tokens} new tokens exceed n_ctx={model.cfg.n_ctx}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokens = model.generate(
            prompt_tokens.expand(n_samples, -1),
            max_new_tokens=max_new_tokens,
            stop_at_eos=False,
            temperature=temperature,
            top_p=top_p,
            verbose=False,
            return_type="tokens",
        )
    texts = [model.to_string(row[start:]) for row in tokens]
    return Generation(prompt, tokens.cpu().clone(), start, texts)  # generate returns inference tensors


class Scorer(Protocol):
    name: str

    def __call__(self, generation: Generation) -> list[float]: ...


class PerplexityScorer:
    """The clean model's perplexity of each sample's generated tokens given the prompt (fluency: lower
    is better). Scores must be computed outside any splice/steer context to be the clean model's."""

    name = "perplexity"

    def __init__(self, model: HookedTransformer):
        self.model = model

    @torch.no_grad()
    def __call__(self, generation: Generation) -> list[float]:
        if hooks.spliced_layers(self.model):
            raise RuntimeError("PerplexityScorer must run on the clean model: call it outside splice()")
        tokens = generation.tokens.to(next(self.model.parameters()).device)
        logp = self.model(tokens).log_softmax(-1)[:, :-1]
        nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0][:, generation.prompt_len - 1 :]
        return nll.mean(1).exp().tolist()


class ProbeScorer:
    """P(concept) from a probe on the clean model's MLP activations of ``block`` (``kind`` 'mlp_in' or
    'mlp_out'), mean-pooled over the generated tokens only: how strongly the text carries the concept."""

    def __init__(
        self, model: HookedTransformer, probe: Any, block: int, kind: str = "mlp_in", name: str = "concept"
    ):
        if kind not in ("mlp_in", "mlp_out"):
            raise ValueError(f"kind={kind!r}: choose 'mlp_in' or 'mlp_out'")
        self.model, self.probe, self.block, self.kind, self.name = model, probe, block, kind, name

    @torch.no_grad()
    def __call__(self, generation: Generation) -> list[float]:
        if hooks.spliced_layers(self.model):
            raise RuntimeError("ProbeScorer must run on the clean model: call it outside splice()")
        tokens = generation.tokens.to(next(self.model.parameters()).device)
        with hooks.capture_mlp_io(self.model, [self.block]) as io:
            self.model(tokens, stop_at_layer=self.block + 1)
        acts = io[self.block]["in" if self.kind == "mlp_in" else "out"][:, generation.prompt_len :]
        pooled = acts.mean(1).float().cpu().numpy()
        return self.probe.predict_proba(pooled)[:, 1].tolist()


def concept_probe(positive: Any, negative: Any, seed: int = 0) -> tuple[Any, float]:
    """A probe for "the text carries the concept" against broad other text, from pooled activations
    [n, d] of concept texts and of anything else: a balanced sample (as many negatives as positives,
    drawn with ``seed``), a 60/20/20 split, the dense probe of sparse probing with C chosen by
    validation log-loss (calibrated probabilities). Returns (probe, test
    accuracy). Task probes are one-vs-rest within one dataset; steering needs one that also says
    "no" to generic text."""
    import numpy as np

    from mxd_lens.analysis.probing import probe_task

    positive, negative = np.asarray(positive), np.asarray(negative)
    rng = np.random.default_rng(seed)
    n = min(len(positive), len(negative))
    if n < 5:
        raise ValueError(
            f"concept probe needs at least 5 texts on each side, got {len(positive)} and {len(negative)}"
        )
    X = np.concatenate(
        [positive[rng.permutation(len(positive))[:n]], negative[rng.permutation(len(negative))[:n]]]
    )
    y = np.array([1] * n + [0] * n)
    order = rng.permutation(2 * n)
    cut = [int(0.6 * 2 * n), int(0.8 * 2 * n)]
    parts = {"train": order[: cut[0]], "val": order[cut[0] : cut[1]], "test": order[cut[1] :]}
    result = probe_task(X, y, parts, k=None, criterion="log_loss")  # its P(concept) is the score
    return result["probe"], result["test_accuracy"]


def sweep(
    model: HookedTransformer,
    targets: Sequence[Mapping[str, Any]],
    multiples: Sequence[float],
    scorers: Sequence[Scorer],
    prompt: str = NEUTRAL_PROMPT,
    n_samples: int = 10,
    max_new_tokens: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Generate at ``alpha = multiple x target['scale']`` for each target (a mapping with ``layer``,
    ``feature``, ``scale`` and any labels to carry, e.g. ``name``, ``task``), score every generation
    with each scorer (a target may bring its own ``scorers``), one row per (target, multiple)."""
    import pandas as pd

    rows = []
    bar = tqdm(total=len(targets) * len(multiples), desc="steering", disable=not progress)
    for target in targets:
        layer = target["layer"]
        for multiple in multiples:
            alpha = multiple * target["scale"]
            with hooks.splice(model, layer, error_term=True), steer(model, layer, target["feature"], alpha):
                generation = generate(model, prompt, n_samples, max_new_tokens, seed=seed)
            row = {k: v for k, v in target.items() if k not in ("layer", "scorers")}
            row.update(multiple=multiple, alpha=alpha, example=generation.texts[0])
            for scorer in [*scorers, *target.get("scorers", [])]:
                scores = scorer(generation)
                row[scorer.name] = sum(scores) / len(scores)
            rows.append(row)
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


def plot_sweep(
    table: pd.DataFrame, path: str | Path | None = None, concept: str = "concept", fluency: str = "perplexity"
) -> Any:
    """Concept strength against fluency, one line per (layer, task) along increasing alpha (the
    paper's steerability-vs-coherence picture), with one panel per task. Returns the Figure (saved
    to ``path`` when given)."""
    from matplotlib.figure import Figure

    tasks = list(dict.fromkeys(table["task"]))
    fig = Figure(figsize=(4.2 * len(tasks), 4.4), layout="constrained")
    axes = fig.subplots(1, len(tasks), squeeze=False)
    labels = _labels(table)
    for ax, task in zip(axes[0], tasks, strict=True):
        for label, rows in table[table.task == task].groupby(labels, sort=False):
            rows = rows.sort_values("multiple")
            ax.plot(rows[fluency], rows[concept], marker="o", label=label)
            for _, r in rows.iterrows():
                ax.annotate(f"{r.multiple:g}", (r[fluency], r[concept]), fontsize=6, alpha=0.7)
        ax.set_xscale("log")
        ax.set_xlabel("perplexity (clean model)", fontsize=8)
        ax.set_title(task, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(concept), concept probe")
    handles, names = axes[0][0].get_legend_handles_labels()
    # below the panels: inside one it hides the points it labels
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 3), fontsize=8)
    fig.suptitle(
        "Steering one feature: concept strength against fluency (lower perplexity = more fluent); "
        "point labels are alpha in units of the feature's max activation",
        fontsize=9,
    )
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _labels(table: pd.DataFrame) -> pd.Series:
    """One label per steered layer: its architecture's (``arch_label`` of the ``arch`` column's key), or
    its name where several layers share an architecture (two seeds would otherwise be drawn as one line).
    Tables written before the ``arch`` column have ``method``, the layer class's label ("MxD"), shown as
    it is (``arch_label`` leaves a string that is no key unchanged)."""
    from mxd_lens.layers import arch_label

    column = "arch" if "arch" in table else "method" if "method" in table else None
    if column is None:
        return table["name"]
    if "name" not in table:
        return table[column].map(arch_label)
    per_arch = table.groupby(column)["name"].nunique()
    shared = set(per_arch[per_arch > 1].index)
    return table.apply(lambda r: r["name"] if r[column] in shared else arch_label(r[column]), axis=1)


def summary_markdown(
    table: pd.DataFrame,
    concept: str = "concept",
    fluency: str = "perplexity",
    min_concept: float = 0.1,
    max_perplexity: float = 500.0,
) -> str:
    """A sweep's table as a reader wants it: one row per (task, layer), ``P(concept) / perplexity`` at
    each multiple, and per layer the number of tasks where some multiple reaches ``concept >=
    min_concept`` at ``perplexity <= max_perplexity`` (a feature that moves the text toward the concept
    without breaking it). Rebuilds the docs' steering tables from a ``steering.csv``."""
    labels = _labels(table).rename("layer")
    frame = table.assign(layer=labels)
    multiples = sorted(frame["multiple"].unique())
    lines = [
        "| task | layer (feature) | " + " | ".join(f"{m:g}×" for m in multiples) + " |",
        "|:---|:---|" + "---:|" * len(multiples),
    ]
    hits: dict[str, int] = {}
    for (task, layer), rows in frame.groupby(["task", "layer"], sort=False):
        by_multiple = rows.set_index("multiple")
        cells = [
            f"{by_multiple.at[m, concept]:.3f} / {by_multiple.at[m, fluency]:.0f}"
            if m in by_multiple.index
            else ""
            for m in multiples
        ]
        feature = f" ({int(rows['feature'].iloc[0])})" if "feature" in rows else ""
        lines.append(f"| {task} | {layer}{feature} | " + " | ".join(cells) + " |")
        good = (rows[concept] >= min_concept) & (rows[fluency] <= max_perplexity) & (rows["multiple"] > 0)
        hits[layer] = hits.get(layer, 0) + int(good.any())
    n_tasks = frame["task"].nunique()
    lines += [
        "",
        f"tasks where a multiple reaches P(concept) >= {min_concept:g} at perplexity <= {max_perplexity:g}: "
        + ", ".join(f"{layer} {n}/{n_tasks}" for layer, n in hits.items()),
    ]
    return "\n".join(lines)

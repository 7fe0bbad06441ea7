"""Summaries of an SPD decomposition of the toy induction model (see docs/spd.md).

Positions of an induction sequence fall in four classes: s1 (the planted S), m (= s1 + 1, the token to
copy), s2 (the final S, where the label is predicted) and "other". The expected circuit (arXiv
2511.08854): Q0 needs one component at m, K0 and V0 one at s1, Q1 one at s2, K1 one at m, and V1 several
(11 in the paper; at m, where the layer-1 head reads M's identity; the position is our inference).

```python
from mxd_lens.spd.report import study_report, plot_ci_by_position
report = study_report(decomposition, batch)          # batch: InductionTask.sample_batch(512, gen)
plot_ci_by_position(report, "ci.png", title="token CI, subset loss")
```

Everything here runs in chunks of sequences (the CI functions' hidden activations grow with
batch x positions x C x hidden) and returns plain Python numbers and lists (JSON-ready).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mxd_lens.spd.losses import kl_divergence
from mxd_lens.spd.train import evaluate

if TYPE_CHECKING:
    from mxd_lens.spd.components import Decomposition
    from mxd_lens.spd.induction import InductionBatch

POSITION_CLASSES = ("s1", "m", "s2", "other")
# weight name -> (position class, number of components) reported by arXiv 2511.08854 for Q0, K0, V0,
# Q1, K1; V1's count is the paper's, its position (m) our reading of the circuit.
EXPECTED_CIRCUIT: dict[str, tuple[str, int]] = {
    "blocks.0.attn.W_Q": ("m", 1),
    "blocks.0.attn.W_K": ("s1", 1),
    "blocks.0.attn.W_V": ("s1", 1),
    "blocks.1.attn.W_Q": ("s2", 1),
    "blocks.1.attn.W_K": ("m", 1),
    "blocks.1.attn.W_V": ("m", 11),
}


def short_name(name: str) -> str:
    """'blocks.1.attn.W_Q' -> 'Q1' (other names are returned unchanged)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[2] == "attn" and parts[3].startswith("W_"):
        return f"{parts[3][2:]}{parts[1]}"
    return name


def position_classes(s1: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, seq_len] class index per position: 0 = s1, 1 = m = s1 + 1, 2 = s2 = seq_len - 1, 3 = other."""
    s1 = s1.long()
    if s1.ndim != 1:
        raise ValueError(f"s1 must be one position per sequence [b], got shape {tuple(s1.shape)}")
    if ((s1 < 0) | (s1 + 1 >= seq_len - 1)).any():
        raise ValueError(f"need 0 <= s1 and s1 + 1 < seq_len - 1 = {seq_len - 1} (m before the final S)")
    classes = torch.full((s1.numel(), seq_len), 3, dtype=torch.long, device=s1.device)
    rows = torch.arange(s1.numel(), device=s1.device)
    classes[rows, s1] = 0
    classes[rows, s1 + 1] = 1
    classes[:, -1] = 2
    return classes


def _on_device(batch: InductionBatch, model: Any) -> InductionBatch:
    """``batch`` on the model's device (training may run on a GPU; the reports follow it)."""
    device = next(model.parameters()).device
    return type(batch)(*(t.to(device) for t in batch))


def _chunks(n: int, chunk: int) -> list[slice]:
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be positive")
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


@torch.no_grad()
def causal_importances(
    decomposition: Decomposition, tokens: torch.Tensor, chunk: int = 64
) -> dict[str, torch.Tensor]:
    """{name: g [b, p, C]} (the masks' CI, lower-leaky hard sigmoid), computed ``chunk`` sequences at a
    time, on the CPU."""
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in decomposition.names}
    for rows in _chunks(tokens.shape[0], chunk):
        ci = decomposition.causal_importance(decomposition.model, tokens[rows])
        for name, (g, _) in ci.items():
            parts[name].append(g.float().cpu())
    return {name: torch.cat(gs) for name, gs in parts.items()}


def ci_position_summary(
    g: torch.Tensor, classes: torch.Tensor, threshold: float = 0.1, n_classes: int = len(POSITION_CLASSES)
) -> dict[str, Any]:
    """One module's CI g [b, p, C] by position class (``classes`` [b, p] with values 0..n_classes-1):

    - ``alive``: indices of components with g > threshold at some sequence and position;
    - ``mean_ci``: [class][component] mean g over that class's positions;
    - ``active_frac``: [class][component] fraction of that class's positions with g > threshold;
    - ``l0``: [class] mean number of components with g > threshold at that class's positions (CI-L0).
    """
    if g.ndim != 3 or classes.shape != g.shape[:2]:
        raise ValueError(f"need g [b, p, C] and classes [b, p]; got {tuple(g.shape)}, {tuple(classes.shape)}")
    flat, labels = g.reshape(-1, g.shape[-1]).float(), classes.reshape(-1).to(g.device)
    active = flat > threshold
    mean_ci, active_frac, l0 = [], [], []
    for k in range(n_classes):
        rows = labels == k
        if not rows.any():
            mean_ci.append([float("nan")] * g.shape[-1])
            active_frac.append([float("nan")] * g.shape[-1])
            l0.append(float("nan"))
            continue
        mean_ci.append(flat[rows].mean(0).tolist())
        active_frac.append(active[rows].float().mean(0).tolist())
        l0.append(float(active[rows].sum(-1).float().mean()))
    return {
        "alive": torch.nonzero(active.any(0)).flatten().tolist(),
        "mean_ci": mean_ci,
        "active_frac": active_frac,
        "l0": l0,
    }


@torch.no_grad()
def masked_run_metrics(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    masks: dict[str, torch.Tensor] | None = None,
    modules: Sequence[str] | None = None,
    delta: bool = True,
    chunk: int = 64,
) -> dict[str, float]:
    """Accuracy at the final position and KL(clean ‖ masked) there, with ``modules`` (default: all)
    computed by their components masked by ``masks[name]`` [b, p, C] (missing: ones) and the ΔW term at
    m_Δ = 1 (``delta=False``: the components alone)."""
    names = decomposition.names if modules is None else list(modules)
    masks = {name: masks[name] for name in names if masks and name in masks}
    correct, kl_sum, n = 0.0, 0.0, tokens.shape[0]
    saved = decomposition.delta
    decomposition.delta = delta
    try:
        for rows in _chunks(n, chunk):
            clean = decomposition.model(tokens[rows])
            with decomposition.patched({name: m[rows] for name, m in masks.items()}, modules=names):
                logits = decomposition.model(tokens[rows])
            correct += float((logits[:, -1].argmax(-1) == labels[rows]).float().sum())
            kl_sum += float(kl_divergence(clean, logits, "last")) * (rows.stop - rows.start)
    finally:
        decomposition.delta = saved
    return {"accuracy": correct / n, "kl": kl_sum / n}


@torch.no_grad()
def loss_metrics(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    positions: str = "last",
    mask_type: str = "continuous",
    seed: int = 0,
    chunk: int = 64,
) -> dict[str, float]:
    """Faithfulness, and KL(target ‖ masked) with stochastic masks (one draw per chunk, generator seeded
    with ``seed``) and with masks = g (ΔW at m_Δ = 1), averaged over sequences; ``positions`` as in
    training; ``kl_*_all_positions`` always over every position (the paper's number, ~1e-4, is that).
    Also the CI-L0 over all positions (mean over modules) and over the last one (per module)."""
    generator = torch.Generator().manual_seed(seed)
    totals = {"kl_stochastic": 0.0, "kl_ci_masked": 0.0}
    everywhere = {"kl_stochastic_all_positions": 0.0, "kl_ci_masked_all_positions": 0.0}
    l0_all = {name: 0.0 for name in decomposition.names}
    n = tokens.shape[0]
    for rows in _chunks(n, chunk):
        part = evaluate(
            decomposition, tokens[rows], positions=positions, mask_type=mask_type, generator=generator
        )
        weight = (rows.stop - rows.start) / n
        for key in totals:
            totals[key] += part[key] * weight
        if positions != "all":
            part = evaluate(
                decomposition, tokens[rows], positions="all", mask_type=mask_type, generator=generator
            )
        for key in everywhere:
            everywhere[key] += part[key.removesuffix("_all_positions")] * weight
        for name in l0_all:
            l0_all[name] += part["ci_l0"][name] * weight
    return {
        "faithfulness": float(decomposition.faithfulness_loss()),
        **totals,
        **everywhere,
        "ci_l0_all_positions": l0_all,
    }


def compare_with_expected(modules: dict[str, dict[str, Any]], at_least: float = 0.5) -> dict[str, Any]:
    """Per module of ``EXPECTED_CIRCUIT`` present in ``modules`` (``study_report``'s per-module
    summaries): the expected class and count, the CI-L0 there and at the other classes, and
    ``n_at_expected`` = components whose mean CI at the expected class is >= ``at_least``.
    ``match`` (for the one-component modules): exactly one such component, CI-L0 at the expected class
    within 0.5 of 1, and CI-L0 below 0.5 at every other class."""
    out = {}
    for name, (where, count) in EXPECTED_CIRCUIT.items():
        if name not in modules:
            continue
        summary = modules[name]
        k = POSITION_CLASSES.index(where)
        n_at = sum(1 for c in range(len(summary["mean_ci"][k])) if summary["mean_ci"][k][c] >= at_least)
        others = {cls: summary["l0"][j] for j, cls in enumerate(POSITION_CLASSES) if j != k}
        match = None
        if count == 1:
            match = bool(n_at == 1 and abs(summary["l0"][k] - 1) <= 0.5 and max(others.values()) < 0.5)
        out[name] = {
            "expected_position": where,
            "expected_components": count,
            "l0_at_expected": summary["l0"][k],
            "l0_elsewhere": others,
            "n_at_expected": n_at,
            "match": match,
        }
    return out


RANKS = (1, 2, 3, 4, 6, 8, 16)


@torch.no_grad()
def rank_replacement(
    model: Any,
    batch: InductionBatch,
    ranks: Sequence[int] = RANKS,
    modules: Sequence[str] | None = None,
    chunk: int = 64,
) -> dict[str, list[dict[str, float]]]:
    """What the model allows: for each module of ``EXPECTED_CIRCUIT`` (or ``modules``) and each rank r,
    the accuracy and KL(clean ‖ replaced) at the final position when that module's output at its
    expected positions (only there) is replaced by the best rank-r map of its input.

    "Best" in output error on ``batch``: with Y the module's outputs there minus its bias, the best
    rank-r Ŷ is Y P_r (Eckart–Young; P_r projects on Y's top r right singular vectors), and Y P_r =
    X (W P_r) is the output of the rank-r map W P_r. SPD can give the module one component at a
    position only if rank 1 already keeps the accuracy: when it does not, a failure to find one is
    the model's (calibration), not SPD's (consolidation). {name: [{rank, accuracy, kl}, ...]}."""
    from mxd_lens.spd.sites import read_weight, resolve

    batch = _on_device(batch, model)
    tokens, labels = batch.tokens, batch.labels
    classes = position_classes(batch.s1, tokens.shape[1])
    names = [n for n in (modules or EXPECTED_CIRCUIT) if n in EXPECTED_CIRCUIT]
    clean = torch.cat([model(tokens[rows])[:, -1] for rows in _chunks(len(tokens), chunk)])
    out: dict[str, list[dict[str, float]]] = {}
    for name in names:
        site = resolve(model, name)
        _, bias = read_weight(model, name)
        where = classes == POSITION_CLASSES.index(EXPECTED_CIRCUIT[name][0])
        seen: list[torch.Tensor] = []
        model.run_with_hooks(tokens, fwd_hooks=[(site.writes, _collect(seen, where, bias))])
        outputs = torch.cat(seen)
        _, _, vt = torch.linalg.svd(outputs.double(), full_matrices=False)
        rows_out = []
        for r in ranks:
            if r > vt.shape[0]:
                continue
            P = (vt[:r].T @ vt[:r]).to(outputs.dtype)
            replaced = torch.cat(
                [
                    model.run_with_hooks(
                        tokens[rows], fwd_hooks=[(site.writes, _project(P, where[rows], bias))]
                    )[:, -1]
                    for rows in _chunks(len(tokens), chunk)
                ]
            )
            rows_out.append(
                {
                    "rank": r,
                    "accuracy": float((replaced.argmax(-1) == labels).float().mean()),
                    "kl": float(kl_divergence(clean[:, None], replaced[:, None])),
                }
            )
        out[name] = rows_out
    return out


def _collect(store: list, where: torch.Tensor, bias: torch.Tensor | None):
    """A hook keeping the site's outputs minus its bias at ``where`` [b, p] (heads flattened)."""

    def hook(y: torch.Tensor, hook: Any) -> None:
        store.append(y.flatten(2)[where] - (0.0 if bias is None else bias))

    return hook


def _project(P: torch.Tensor, where: torch.Tensor, bias: torch.Tensor | None):
    """A hook putting (y − b) P + b in place of the site's output y at ``where`` [b, p]."""
    b = 0.0 if bias is None else bias

    def hook(y: torch.Tensor, hook: Any) -> torch.Tensor:
        flat = y.flatten(2)
        return torch.where(where[..., None], (flat - b) @ P + b, flat).view(y.shape)

    return hook


@torch.no_grad()
def components_carrying(
    decomposition: Decomposition, batch: InductionBatch, fraction: float = 0.9, chunk: int = 64
) -> dict[str, float]:
    """What SPD found: for each module of ``EXPECTED_CIRCUIT`` it decomposes, the mean (over the
    expected positions) of the fewest components whose contributions h_c u_c, largest first, leave
    at most 1 - ``fraction`` of the squared norm of the components' sum h U unexplained."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    batch = _on_device(batch, decomposition.model)
    tokens = batch.tokens
    classes = position_classes(batch.s1, tokens.shape[1])
    names = [n for n in decomposition.names if n in EXPECTED_CIRCUIT]
    counts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for rows in _chunks(len(tokens), chunk):
        _, inputs = decomposition.run_clean(decomposition.model, tokens[rows])
        for name in names:
            part = decomposition._components(name)
            where = classes[rows] == POSITION_CLASSES.index(EXPECTED_CIRCUIT[name][0])
            h = inputs[name][where].to(part.V.dtype) @ part.V  # [n, C]
            each = h[..., None] * part.U  # [n, C, d_out]
            total = each.sum(1)
            order = each.norm(dim=-1).argsort(-1, descending=True)
            partial = each.gather(1, order[..., None].expand_as(each)).cumsum(1)  # top-1, top-2, ...
            left = (partial - total[:, None]).pow(2).sum(-1) / total.pow(2).sum(-1, keepdim=True).clamp_min(
                1e-30
            )
            counts[name].append(((left > 1 - fraction).sum(-1) + 1).clamp(max=h.shape[-1]).float())
    return {name: float(torch.cat(c).mean()) for name, c in counts.items()}


@torch.no_grad()
def study_report(
    decomposition: Decomposition,
    batch: InductionBatch,
    threshold: float = 0.1,
    positions: str = "last",
    mask_type: str = "continuous",
    seed: int = 0,
    chunk: int = 64,
) -> dict[str, Any]:
    """The whole per-variant summary on an evaluation batch (JSON-ready):

    - ``accuracy_clean``; ``accuracy_ci_masked`` / ``kl_ci_masked_last`` (all modules masked by g, ΔW at
      1), ``..._no_delta`` (components alone, masks g), ``..._binary`` (masks 1[g > threshold], ΔW at 1);
    - ``per_module_ci_masked``: {name: {accuracy, kl}} with only that module masked by g;
    - ``losses``: faithfulness, stochastic and CI-masked KL (as in training: ``positions``), CI-L0;
    - ``modules``: {name: ci_position_summary}, plus ``n_alive``;
    - ``expected``: compare_with_expected;
    - ``diagnostics``: ``rank_replacement`` (what the model allows at each expected position) and
      ``components_carrying_90`` (what SPD found there), to tell calibration from consolidation.
    """
    batch = _on_device(batch, decomposition.model)
    tokens, labels = batch.tokens, batch.labels
    classes = position_classes(batch.s1, tokens.shape[1])
    g = causal_importances(decomposition, tokens, chunk)
    modules = {}
    for name in decomposition.names:
        summary = ci_position_summary(g[name], classes, threshold)
        modules[name] = {"short": short_name(name), "n_alive": len(summary["alive"]), **summary}
    binary = {name: (gi > threshold).float() for name, gi in g.items()}
    clean = masked_run_metrics(decomposition, tokens, labels, masks=None, modules=[], chunk=chunk)
    masked = masked_run_metrics(decomposition, tokens, labels, g, chunk=chunk)
    no_delta = masked_run_metrics(decomposition, tokens, labels, g, delta=False, chunk=chunk)
    binarised = masked_run_metrics(decomposition, tokens, labels, binary, chunk=chunk)
    per_module = {
        name: masked_run_metrics(decomposition, tokens, labels, g, modules=[name], chunk=chunk)
        for name in decomposition.names
    }
    return {
        "n_sequences": int(tokens.shape[0]),
        "threshold": threshold,
        "position_classes": list(POSITION_CLASSES),
        "accuracy_clean": clean["accuracy"],
        "accuracy_ci_masked": masked["accuracy"],
        "kl_ci_masked_last": masked["kl"],
        "accuracy_ci_masked_no_delta": no_delta["accuracy"],
        "kl_ci_masked_no_delta_last": no_delta["kl"],
        "accuracy_ci_binary": binarised["accuracy"],
        "kl_ci_binary_last": binarised["kl"],
        "per_module_ci_masked": per_module,
        "losses": loss_metrics(decomposition, tokens, positions, mask_type, seed, chunk),
        "modules": modules,
        "expected": compare_with_expected(modules),
        "diagnostics": {
            "rank_replacement": rank_replacement(
                decomposition.model, batch, modules=decomposition.names, chunk=chunk
            ),
            "components_carrying_90": components_carrying(decomposition, batch, 0.9, chunk),
        },
    }


@torch.no_grad()
def trend_point(
    decomposition: Decomposition, batch: InductionBatch, threshold: float = 0.1, chunk: int = 16
) -> dict[str, Any]:
    """A small summary for a curve over training: CI-L0 per module and position class
    ({short name: [s1, m, s2, other]}), and the accuracy and KL at the final position with every
    module CI-masked."""
    batch = _on_device(batch, decomposition.model)
    classes = position_classes(batch.s1, batch.tokens.shape[1])
    g = causal_importances(decomposition, batch.tokens, chunk)
    l0 = {short_name(n): ci_position_summary(g[n], classes, threshold)["l0"] for n in decomposition.names}
    masked = masked_run_metrics(decomposition, batch.tokens, batch.labels, g, chunk=chunk)
    return {"l0": l0, "accuracy_ci_masked": masked["accuracy"], "kl_ci_masked_last": masked["kl"]}


def plot_trend(points: Sequence[dict[str, Any]], path: str | Path | None = None, title: str = "") -> Any:
    """CI-L0 at each expected module's expected position against the training step (one line per
    module, the expected count dashed), from ``trend_point`` records with a ``step``; a second panel
    the CI-masked accuracy. Returns the Figure (saved to ``path`` when given)."""
    from matplotlib.figure import Figure

    steps = [p["step"] for p in points]
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax, ax_acc = fig.subplots(1, 2, width_ratios=(2, 1))
    for name, (where, count) in EXPECTED_CIRCUIT.items():
        short = short_name(name)
        if points and short in points[0]["l0"]:
            k = POSITION_CLASSES.index(where)
            line = ax.plot(
                steps, [p["l0"][short][k] for p in points], marker=".", label=f"{short} at {where}"
            )
            ax.axhline(count, color=line[0].get_color(), ls=":", lw=0.8)
    ax.set(
        xlabel="SPD step",
        ylabel="CI-L0 at the expected position",
        yscale="log",
        title="components per position (dotted: the paper's count)",
    )
    ax.legend(fontsize=8, ncol=2)
    ax_acc.plot(steps, [p["accuracy_ci_masked"] for p in points], marker=".")
    ax_acc.set(xlabel="SPD step", ylabel="accuracy, all modules CI-masked", ylim=(0, 1.02))
    fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def plot_ci_by_position(
    report: dict[str, Any],
    path: str | Path | None = None,
    title: str = "",
    max_components: int = 12,
    dpi: int = 110,
) -> Any:
    """Two panels from a ``study_report``: (a) CI-L0 per module and position class, the expected
    circuit's cells outlined; (b) mean CI per alive component (rows, grouped by module; at most
    ``max_components`` per module, those with the largest class mean) and position class. Returns
    the matplotlib Figure (saved to ``path`` when given; the backend is left as it is)."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    classes = report["position_classes"]
    names = list(report["modules"])
    shorts = [report["modules"][n]["short"] for n in names]
    l0 = np.array([report["modules"][n]["l0"] for n in names])
    rows, labels, bounds, hidden = [], [], [], {}
    for name in names:
        summary = report["modules"][name]
        mean = np.array(summary["mean_ci"])  # [class, C]
        alive = sorted(summary["alive"], key=lambda c: -np.nanmax(mean[:, c]))
        for c in alive[:max_components]:
            rows.append(mean[:, c])
            labels.append(f"{summary['short']} c{c}")
        hidden[summary["short"]] = max(0, len(alive) - max_components)
        bounds.append(len(rows))
    height = max(4.0, 0.16 * max(len(rows), 1) + 1.5)
    fig = Figure(figsize=(10, height), layout="constrained")
    ax_l0, ax_ci = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1]})
    vmax = max(1.0, float(np.nanmax(l0)) if l0.size else 1.0)
    image = ax_l0.imshow(l0, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
    for i in range(l0.shape[0]):
        for j in range(l0.shape[1]):
            color = "black" if l0[i, j] > 0.6 * vmax else "white"
            ax_l0.text(j, i, f"{l0[i, j]:.2f}", ha="center", va="center", fontsize=8, color=color)
    for i, name in enumerate(names):
        if name in EXPECTED_CIRCUIT:
            where, count = EXPECTED_CIRCUIT[name]
            j = classes.index(where)
            ax_l0.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
            ax_l0.text(j + 0.45, i - 0.45, f"exp {count}", ha="right", va="top", fontsize=6, color="red")
    ax_l0.set_xticks(range(len(classes)), classes)
    ax_l0.set_yticks(
        range(len(names)),
        [f"{s} ({report['modules'][n]['n_alive']} alive)" for s, n in zip(shorts, names, strict=True)],
    )
    ax_l0.set_title(
        f"(a) CI-L0 (components with g > {report['threshold']:.2g}) per position class", fontsize=9
    )
    fig.colorbar(image, ax=ax_l0, shrink=0.6)
    if rows:
        ci = ax_ci.imshow(
            np.array(rows), cmap="magma", vmin=0, vmax=1, aspect="auto", interpolation="nearest"
        )
        ax_ci.set_yticks(range(len(labels)), labels, fontsize=6)
        for bound in bounds[:-1]:
            ax_ci.axhline(bound - 0.5, color="cyan", lw=1.0)
        fig.colorbar(ci, ax=ax_ci, shrink=0.6)
    ax_ci.set_xticks(range(len(classes)), classes)
    more = ", ".join(f"{s} +{k}" for s, k in hidden.items() if k)
    ax_ci.set_title(
        "(b) mean CI of alive components" + (f"\n(not shown: {more})" if more else ""), fontsize=9
    )
    if title:
        fig.suptitle(title, fontsize=10)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig


def comparison_table(reports: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per variant (``reports``: {variant: study_report (with an optional
    ``training`` entry: steps, batch_size, wall_s)}): steps, faithfulness, KLs, accuracies, alive
    components and CI-L0 at the expected class per module, and how many of the five one-component
    modules match."""
    if not reports:
        return ""
    names = list(next(iter(reports.values()))["modules"])
    head = [
        "variant",
        "steps",
        "faithful.",
        "KL stoch.",
        "KL CI",
        "KL stoch. all pos. (paper ~1e-4)",
        "acc CI",
        "acc CI bin.",
        *(
            f"{short_name(n)} alive / L0@{EXPECTED_CIRCUIT[n][0] if n in EXPECTED_CIRCUIT else 's2'}"
            for n in names
        ),
        "match (of 5)",
    ]
    rows = []
    for variant, rep in reports.items():
        losses = rep["losses"]
        cells = [
            variant,
            str(rep.get("training", {}).get("steps", "")),
            f"{losses['faithfulness']:.1e}",
            f"{losses['kl_stochastic']:.3g}",
            f"{losses['kl_ci_masked']:.3g}",
            f"{losses['kl_stochastic_all_positions']:.3g}"
            if "kl_stochastic_all_positions" in losses
            else "–",
            f"{rep['accuracy_ci_masked']:.3f}",
            f"{rep['accuracy_ci_binary']:.3f}",
        ]
        for name in names:
            where = EXPECTED_CIRCUIT[name][0] if name in EXPECTED_CIRCUIT else "s2"
            summary = rep["modules"][name]
            cells.append(f"{summary['n_alive']} / {summary['l0'][POSITION_CLASSES.index(where)]:.2f}")
        matches = [e["match"] for e in rep["expected"].values() if e["match"] is not None]
        cells.append(f"{sum(matches)}")
        rows.append(cells)
    return _markdown(head, rows)


def module_table(report: dict[str, Any]) -> str:
    """A markdown table of one ``study_report``, one row per module: alive components, CI-L0 at each
    position class, the expected position and count, components with mean CI >= 0.5 there, and the
    accuracy / KL at the final position with only that module masked by its CI."""
    classes = report["position_classes"]
    head = [
        "module",
        "alive",
        *(f"L0 {c}" for c in classes),
        "expected",
        "n ≥ 0.5 there",
        "acc / KL, only it CI-masked",
        "rank-1 acc there",
        "rank for acc ≥ 0.99",
        "components for 90%",
    ]
    rows = []
    for name, summary in report["modules"].items():
        expected = report["expected"].get(name)
        alone = report["per_module_ci_masked"][name]
        cells = [
            summary["short"],
            str(summary["n_alive"]),
            *(f"{v:.2f}" for v in summary["l0"]),
            f"{expected['expected_components']} at {expected['expected_position']}" if expected else "–",
            str(expected["n_at_expected"]) if expected else "–",
            f"{alone['accuracy']:.3f} / {alone['kl']:.3g}",
            *_diagnostic_cells(report.get("diagnostics", {}), name),
        ]
        rows.append(cells)
    return _markdown(head, rows)


def adversarial_table(report: dict[str, Any]) -> str:
    """Accuracy and KL at the final position (and KL over all positions) under stochastic, adversarial
    (PGD) and CI masks, every module replaced and each alone (``report["adversarial"]``)."""
    adv = report["adversarial"]
    kinds = ("stochastic", "adversarial", "ci_masked")
    head = ["replaced", *[f"{kind}: acc / KL last / KL all" for kind in kinds]]

    def cells(row: dict[str, float]) -> str:
        return f"{row['accuracy']:.3f} / {row['kl_last']:.3g} / {row['kl_all']:.3g}"

    rows = [["all modules", *[cells(adv[kind]["all"]) for kind in kinds]]]
    for name in adv["stochastic"]["per_module"]:
        rows.append([short_name(name), *[cells(adv[kind]["per_module"][name]) for kind in kinds]])
    pgd = adv["pgd"]
    note = (f"PGD: {pgd['n_steps']} steps of {pgd['step_size']:g}, {pgd['init']} start, ascending KL over "
            f"{pgd['positions']} positions")  # fmt: skip
    return _markdown(head, rows) + "\n\n" + note


def trend_table(points: Sequence[dict[str, Any]], every: int = 0) -> str:
    """A run's trend (``trend_point`` records with their ``step``) as the docs show it: per step, the
    CI-L0 of each module of ``EXPECTED_CIRCUIT`` at its expected position, the CI-masked accuracy, and a
    last row with the expected counts. ``every`` keeps only steps that are multiples of it (and the
    last). Rebuilds the table from a committed ``trend.jsonl``."""
    names = [short_name(n) for n in EXPECTED_CIRCUIT]
    where = [POSITION_CLASSES.index(pos) for pos, _ in EXPECTED_CIRCUIT.values()]
    head = ["step", *[f"{n} ({pos})" for n, (pos, _) in zip(names, EXPECTED_CIRCUIT.values(), strict=True)],
            "CI-masked accuracy"]  # fmt: skip
    kept = [p for i, p in enumerate(points) if not every or p["step"] % every == 0 or i == len(points) - 1]
    rows = [
        [f"{p['step']:,}", *[f"{p['l0'][n][k]:.3g}" if n in p["l0"] else "–" for n, k in zip(names, where, strict=True)],
         f"{p['accuracy_ci_masked']:.3f}"]
        for p in kept
    ]  # fmt: skip
    rows.append(["paper", *[str(count) for _, count in EXPECTED_CIRCUIT.values()], ""])
    return _markdown(head, rows)


def steps_to_reach(
    points: Sequence[dict[str, Any]], target: float = 1.5, since: int = 0, horizon: float = 1e12
) -> dict[str, dict[str, float | None]]:
    """When would each module of ``EXPECTED_CIRCUIT`` (one component expected) reach CI-L0 ``target`` at
    its expected position, if it kept falling at the rate it fell since step ``since``? The rate is a
    least-squares slope over the trend points from ``since`` on, either per step ("linear"; optimistic
    for a decelerating trend) or per unit of log(step) ("log"; the usual shape of these trends), and
    the extrapolation starts from the last point. Returns {short name: {"now": the last CI-L0,
    "linear": step, "log": step}}: the last step where it is already at ``target`` or below, None where
    the fit does not fall or reaches ``target`` only beyond ``horizon`` steps."""
    import math

    import numpy as np

    kept = [p for p in points if p["step"] >= since and p["step"] > 0]
    if len(kept) < 2:
        raise ValueError(f"need two trend points at steps >= max(since={since}, 1), got {len(kept)}")
    steps = np.array([p["step"] for p in kept], dtype=float)
    last = float(steps[-1])
    out: dict[str, dict[str, float | None]] = {}
    for name, (where, count) in EXPECTED_CIRCUIT.items():
        short, k = short_name(name), POSITION_CLASSES.index(where)
        if count != 1 or short not in kept[-1]["l0"]:
            continue
        y = np.array([p["l0"][short][k] for p in kept], dtype=float)
        now = float(y[-1])
        reach: dict[str, float | None] = {"now": now}
        for fit, x in (("linear", steps), ("log", np.log(steps))):
            slope = float(np.polyfit(x, y, 1)[0])
            if now <= target:
                reach[fit] = last
            elif slope >= 0:
                reach[fit] = None
            else:
                more = (now - target) / -slope  # steps, or e-folds of the step
                if fit == "log":
                    at = last * math.exp(more) if more < math.log(horizon / last) else math.inf
                else:
                    at = last + more
                reach[fit] = at if at <= horizon else None
        out[short] = reach
    return out


def reach_table(points: Sequence[dict[str, Any]], target: float = 1.5, since: int = 0) -> str:
    """Markdown of :func:`steps_to_reach`: per module, CI-L0 now and the step each fit reaches
    ``target`` at (">1e12" where it does not)."""
    reach = steps_to_reach(points, target, since)

    def cell(step: float | None) -> str:
        return ">1e12" if step is None else f"{step:,.0f}" if step < 1e7 else f"{step:.1e}"

    head = [
        "module",
        "CI-L0 now",
        f"step at ≤ {target:g}, linear in step",
        f"step at ≤ {target:g}, linear in log(step)",
    ]
    rows = [[name, f"{r['now']:.3g}", cell(r["linear"]), cell(r["log"])] for name, r in reach.items()]
    return _markdown(head, rows)


def _diagnostic_cells(diagnostics: dict[str, Any], name: str) -> list[str]:
    ranks = diagnostics.get("rank_replacement", {}).get(name)
    carrying = diagnostics.get("components_carrying_90", {}).get(name)
    if not ranks:
        return ["–", "–", "–" if carrying is None else f"{carrying:.2f}"]
    first = next((r for r in ranks if r["rank"] == 1), None)
    enough = next((r["rank"] for r in ranks if r["accuracy"] >= 0.99), None)
    return [
        "–" if first is None else f"{first['accuracy']:.3f}",
        f"{enough}" if enough is not None else f"> {ranks[-1]['rank']}",
        "–" if carrying is None else f"{carrying:.2f}",
    ]


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of already formatted cells (pandas.DataFrame.to_markdown, left-aligned)."""
    import pandas as pd

    return pd.DataFrame(rows, columns=head).to_markdown(
        index=False, tablefmt="pipe", stralign="left", disable_numparse=True
    )

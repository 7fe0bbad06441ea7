"""SPD's losses. D = KL(target ‖ masked) on the logits, per position, averaged over positions.

- faithfulness: Σ_l ‖W_l − (V_l U_l)ᵀ‖²_F / Σ_l numel(W_l)
- stochastic reconstruction: D with every module replaced, masks m = g + (1 − g) ⊙ r, m_Δ ~ U(0, 1)
- layerwise reconstruction: mean over modules l of D with only module l replaced (stochastic masks)
- subset (partial) reconstruction: per position k ~ U{1..L}, a random k-subset of the modules replaced,
  the others keep the original weights (stochastic masks)
- CI-masked reconstruction: D with masks = g and m_Δ = 1, no noise
- importance minimality: Σ_l Σ_c mean over positions of (g_upper + ε)^p (``reduce="sum"``: summed over
  a sequence's positions, averaged over sequences — the pressure per position a last-position KL gets)

r ~ U(0, 1) ("continuous") or Bernoulli(½) ("binomial"), one draw per loss term and step.

The reconstruction terms are forwards of the same tokens with different masks, so
``reconstruction_losses`` stacks them along the batch into one forward (``fuse=True``): on a small
model that replaces 3 + L Python-heavy forwards by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from mxd_lens.spd.components import Decomposition

CI = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (g, g_upper), each [b, p, C]
RECONSTRUCTIONS = ("stochastic_recon", "layerwise_recon", "subset_recon", "ci_masked_recon")
MASK_TYPES = ("continuous", "binomial")
POSITIONS = ("all", "last")


class MaskedRun(NamedTuple):
    """One forward of the decomposed model: arguments of ``Decomposition.patched`` (None: defaults)."""

    masks: dict[str, torch.Tensor] | None
    delta_masks: dict[str, torch.Tensor] | None
    routing: dict[str, torch.Tensor] | None


def kl_divergence(target_logits: torch.Tensor, logits: torch.Tensor, positions: str = "all") -> torch.Tensor:
    """KL(softmax(target) ‖ softmax(logits)) summed over the vocabulary, averaged over batch and
    positions (``"last"``: the last position only)."""
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r}: choose one of {POSITIONS}")
    if positions == "last":
        target_logits, logits = target_logits[:, -1:], logits[:, -1:]
    target = F.log_softmax(target_logits.float(), dim=-1)
    return (target.exp() * (target - F.log_softmax(logits.float(), dim=-1))).sum(-1).mean()


MINIMALITY_REDUCE = ("mean", "sum")


def importance_minimality_loss(ci: CI, p: float, eps: float = 1e-12, reduce: str = "mean") -> torch.Tensor:
    """Σ_l Σ_c (g_upper + ε)^p, averaged over batch and positions (``reduce="mean"``), or summed over
    each sequence's positions and averaged over the batch (``"sum"``)."""
    if reduce not in MINIMALITY_REDUCE:
        raise ValueError(f"reduce={reduce!r}: choose one of {MINIMALITY_REDUCE}")
    per_position = [((g_upper + eps) ** p).sum(-1) for _, g_upper in ci.values()]  # each [b, p]
    if reduce == "sum":
        return sum(t.sum(-1).mean() for t in per_position)
    return sum(t.mean() for t in per_position)


def stochastic_masks(ci: CI, mask_type: str, generator: torch.Generator | None = None) -> tuple[dict, dict]:
    """(masks m = g + (1 − g) ⊙ r, delta masks m_Δ ~ U(0, 1) per position), one draw."""
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type={mask_type!r}: choose one of {MASK_TYPES}")
    masks, delta_masks = {}, {}
    for name, (g, _) in ci.items():
        if mask_type == "continuous":
            r = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype)
        else:
            r = torch.randint(0, 2, g.shape, generator=generator, device=g.device).to(g.dtype)
        masks[name] = g + (1 - g) * r
        delta_masks[name] = torch.rand(g.shape[:-1], generator=generator, device=g.device, dtype=g.dtype)
    return masks, delta_masks


def subset_routing(
    names: Sequence[str],
    shape: tuple[int, int],
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Per position draw k ~ U{1..L} and a uniformly random k-subset of the L modules:
    {name: [b, p] bool, True where that module is replaced}."""
    L = len(names)
    k = torch.randint(1, L + 1, (*shape, 1), generator=generator, device=device)
    ranks = torch.rand((*shape, L), generator=generator, device=device).argsort(-1).argsort(-1)
    chosen = ranks < k
    return {name: chosen[..., i] for i, name in enumerate(names)}


def reconstruction_runs(
    decomposition: Decomposition,
    ci: CI,
    which: Sequence[str],
    mask_type: str = "continuous",
    generator: torch.Generator | None = None,
) -> dict[str, list[MaskedRun]]:
    """The forwards each reconstruction term needs (layerwise: one per module), masks drawn in a fixed
    order so that a run is reproducible from the generator's state."""
    unknown = set(which) - set(RECONSTRUCTIONS)
    if unknown:
        raise ValueError(f"unknown reconstruction losses {sorted(unknown)}; choose from {RECONSTRUCTIONS}")
    names = decomposition.names
    runs: dict[str, list[MaskedRun]] = {}
    for term in RECONSTRUCTIONS:
        if term not in which:
            continue
        if term == "ci_masked_recon":
            runs[term] = [MaskedRun({name: g for name, (g, _) in ci.items()}, None, None)]
            continue
        masks, delta_masks = stochastic_masks(ci, mask_type, generator)
        if term == "stochastic_recon":
            runs[term] = [MaskedRun(masks, delta_masks, None)]
        elif term == "subset_recon":
            g = ci[names[0]][0]
            routing = subset_routing(names, tuple(g.shape[:2]), generator, g.device)
            runs[term] = [MaskedRun(masks, delta_masks, routing)]
        else:
            runs[term] = [
                MaskedRun({only: masks[only]}, {only: delta_masks[only]}, _only(names, only, masks[only]))
                for only in names
            ]
    return runs


def reconstruction_losses(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    target_logits: torch.Tensor,
    ci: CI,
    which: Sequence[str] = RECONSTRUCTIONS,
    mask_type: str = "continuous",
    generator: torch.Generator | None = None,
    positions: str = "all",
    fuse: bool = True,
) -> dict[str, torch.Tensor]:
    """{term: D} for each reconstruction term in ``which`` (layerwise: the mean over modules)."""
    runs = reconstruction_runs(decomposition, ci, which, mask_type, generator)
    flat = [run for term_runs in runs.values() for run in term_runs]
    logits = masked_logits(decomposition, tokens, flat, fuse)
    losses, start = {}, 0
    for term, term_runs in runs.items():
        kls = [kl_divergence(target_logits, out, positions) for out in logits[start : start + len(term_runs)]]
        losses[term] = torch.stack(kls).mean()
        start += len(term_runs)
    return losses


def masked_logits(
    decomposition: Decomposition, tokens: torch.Tensor, runs: Sequence[MaskedRun], fuse: bool = True
) -> list[torch.Tensor]:
    """Logits of each run; with ``fuse`` all runs are one forward on the tokens repeated along the batch."""
    if not fuse or len(runs) == 1:
        outs = []
        for run in runs:
            with decomposition.patched(*run):
                outs.append(decomposition.model(tokens))
        return outs
    b, p = tokens.shape
    C, device = decomposition.C, tokens.device

    def stacked(field: int, shape: tuple[int, ...], fill: float | bool) -> dict[str, torch.Tensor] | None:
        if all(run[field] is None for run in runs):
            return None
        out = {}
        for name in decomposition.names:
            parts = []
            for run in runs:
                given = None if run[field] is None else run[field].get(name)
                if given is None:  # the default of patched(): ones, or routed everywhere
                    given = torch.full(shape, fill, device=device, dtype=torch.bool if fill is True else None)
                parts.append(given)
            out[name] = torch.cat(parts)
        return out

    fused = MaskedRun(stacked(0, (b, p, C), 1.0), stacked(1, (b, p), 1.0), stacked(2, (b, p), True))
    with decomposition.patched(*fused):
        logits = decomposition.model(tokens.repeat(len(runs), 1))
    return list(logits.split(b))


def _only(names: Sequence[str], only: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Routing that replaces module ``only`` everywhere and no other."""
    on = torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    return {name: on if name == only else torch.zeros_like(on) for name in names}

"""Adversarial masks: is a decomposition faithful under the worst masks its CI allows, not only random ones?

SPD trains and validates with *stochastic* masks m = g + (1 − g) ⊙ r, r ~ U(0, 1): each component may be
ablated as much as its causal importance g allows. A subnetwork that survives random r can still fail
for some r in that range (the SPD authors' successor, VPD, found such cases and trains against them).
Here r (and the ΔW term's mask m_Δ) is chosen by projected gradient ascent on the same KL the losses
use, as goodfire-ai/spd's ``pgd_masked_recon_loss`` does: sources s ∈ [0, 1] per (sequence, position,
component), masks m = g + (1 − g) ⊙ s, ``n_steps`` steps of s ← clamp(s + step_size · sign(∂KL/∂s), 0, 1)
from a random (or all-ones / all-zeros) start. The decomposition's parameters are not changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mxd_lens.spd.losses import kl_divergence

if TYPE_CHECKING:
    from mxd_lens.spd.components import Decomposition

INITS = ("random", "ones", "zeros")


def pgd_masks(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    g: dict[str, torch.Tensor],
    target_logits: torch.Tensor,
    n_steps: int = 20,
    step_size: float = 0.1,
    init: str = "random",
    positions: str = "all",
    modules: Sequence[str] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(masks {name: [b, p, C]} in [g, 1], delta masks {name: [b, p]} in [0, 1]) for ``modules``
    (default: all) that raise KL(target ‖ masked) (at ``positions``) by ``n_steps`` of projected
    sign-gradient ascent (module docstring). ``g`` is each module's CI [b, p, C] on ``tokens``."""
    if init not in INITS:
        raise ValueError(f"init={init!r}: choose one of {INITS}")
    if n_steps < 0 or step_size <= 0:
        raise ValueError(f"n_steps={n_steps} must be >= 0 and step_size={step_size} > 0")
    names = decomposition.names if modules is None else list(modules)
    missing = [name for name in names if name not in g]
    if missing:
        raise ValueError(f"no CI given for {missing}")

    def start(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if init == "random":
            return torch.rand(shape, generator=generator, dtype=like.dtype).to(like.device)
        return torch.full(shape, 1.0 if init == "ones" else 0.0, dtype=like.dtype, device=like.device)

    ci = {name: g[name].detach() for name in names}
    sources = {name: start(tuple(ci[name].shape), ci[name]) for name in names}
    delta_sources = {name: start(tuple(ci[name].shape[:-1]), ci[name]) for name in names}

    def masked(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: ci[name] + (1 - ci[name]) * src[name] for name in names}

    for _ in range(n_steps):
        variables = [*sources.values(), *delta_sources.values()]
        for v in variables:
            v.requires_grad_(True)
        with torch.enable_grad(), decomposition.patched(masked(sources), delta_sources, modules=names):
            kl = kl_divergence(target_logits, decomposition.model(tokens), positions)
            grads = torch.autograd.grad(kl, variables, allow_unused=True)
        with torch.no_grad():
            for v, grad in zip(variables, grads, strict=True):
                if grad is not None:
                    v.add_(step_size * grad.sign()).clamp_(0.0, 1.0)
                v.requires_grad_(False)
    return masked({n: s.detach() for n, s in sources.items()}), {
        n: s.detach() for n, s in delta_sources.items()
    }


@torch.no_grad()
def adversarial_metrics(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    n_steps: int = 20,
    step_size: float = 0.1,
    init: str = "random",
    positions: str = "all",
    seed: int = 0,
    chunk: int = 64,
) -> dict[str, Any]:
    """The decomposed model under three kinds of masks, each with every module replaced ("all") and
    with one module replaced at a time ("per_module"): ``stochastic`` (one draw of r ~ U(0, 1), m_Δ ~
    U(0, 1)), ``adversarial`` (:func:`pgd_masks`, ascending KL at ``positions``) and, for reference,
    ``ci_masked`` (m = g, m_Δ = 1). Each: accuracy and KL(clean ‖ masked) at the final position, and KL
    over every position, averaged over the sequences (computed ``chunk`` at a time)."""
    generator = torch.Generator().manual_seed(seed)
    names = decomposition.names
    groups: dict[str, list[str]] = {"all": list(names), **{name: [name] for name in names}}
    kinds = ("stochastic", "adversarial", "ci_masked")
    sums = {
        kind: {group: {"accuracy": 0.0, "kl_last": 0.0, "kl_all": 0.0} for group in groups} for kind in kinds
    }
    n = tokens.shape[0]
    for begin in range(0, n, chunk):
        rows = slice(begin, min(begin + chunk, n))
        batch, answer = tokens[rows], labels[rows]
        target, inputs = decomposition.run_clean(decomposition.model, batch)
        g = {name: gi for name, (gi, _) in decomposition.ci_from_inputs(inputs).items()}
        for group, modules in groups.items():
            for kind in kinds:
                if kind == "adversarial":
                    masks, delta = pgd_masks(decomposition, batch, g, target, n_steps, step_size, init,
                                             positions, modules, generator)  # fmt: skip
                elif kind == "stochastic":
                    masks = {m: g[m] + (1 - g[m]) * torch.rand(g[m].shape, generator=generator).to(g[m])
                             for m in modules}  # fmt: skip
                    delta = {m: torch.rand(g[m].shape[:-1], generator=generator).to(g[m]) for m in modules}
                else:
                    masks, delta = {m: g[m] for m in modules}, None
                with decomposition.patched(masks, delta, modules=modules):
                    logits = decomposition.model(batch)
                weight = (rows.stop - rows.start) / n
                cell = sums[kind][group]
                cell["accuracy"] += float((logits[:, -1].argmax(-1) == answer).float().mean()) * weight
                cell["kl_last"] += float(kl_divergence(target, logits, "last")) * weight
                cell["kl_all"] += float(kl_divergence(target, logits, "all")) * weight
    return {
        "pgd": {
            "n_steps": n_steps,
            "step_size": step_size,
            "init": init,
            "positions": positions,
            "seed": seed,
        },
        **{
            kind: {"all": sums[kind]["all"], "per_module": {m: sums[kind][m] for m in names}}
            for kind in kinds
        },
    }

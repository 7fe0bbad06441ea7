"""Why a position keeps more components than it needs: what switching some off would cost.

The minimality loss pushes every causal importance (CI) down; the reconstruction losses hold up those
whose ablation would change the output. Where a module keeps n components active at a position but the
circuit needs fewer, two readings are possible: the pressure has not had the steps to act yet, or the
decomposition sits where dropping a component costs more reconstruction than it saves minimality
(a local equilibrium that only moving the components themselves can leave). This module measures which.

For a module and a set of positions ``where``:

- :func:`contributions`: per active component, its CI (and the pre-activation z, recovered from the
  upper-leaky CI where z > 1) and the norm of its contribution ``(x · v_c) u_c`` to the module's output;
  and the *cancellation* ratio Σ_c ‖(x · v_c) u_c‖ / ‖Σ_c (x · v_c) u_c‖ over the active ones (1: they
  add up; larger: they partly cancel, so masking any one of them moves the output by more than its share).
- :func:`pruning_cost`: the training objective (the config's reconstruction terms with their
  coefficients, plus the minimality term) with the CI of all but the ``k`` largest contributors active
  at each position of ``where`` set to zero there, minus the same objective as trained, for each ``k``. Both sides use the same mask
  draws (paired), so the difference's standard error is small. A positive total for ``k = n - 1`` means
  the training objective itself keeps the n-th component.

```python
from mxd_lens.spd.pruning import pruning_cost
rows = tokens == task.induction_token                 # [b, p] bool
cost = pruning_cost(decomposition, tokens, config, step, "blocks.0.attn.W_K", rows, keep=[9, 5, 1])
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mxd_lens.spd.ci import LEAK
from mxd_lens.spd.losses import RECONSTRUCTIONS, importance_minimality_loss, reconstruction_losses

if TYPE_CHECKING:
    from mxd_lens.spd.components import Decomposition
    from mxd_lens.spd.train import SPDConfig


def _check_where(where: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    if where.dtype != torch.bool or tuple(where.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"where must be a bool mask [batch, positions] = {tuple(tokens.shape[:2])}, "
            f"got {where.dtype} {tuple(where.shape)}"
        )
    if not where.any():
        raise ValueError("where selects no position: nothing to measure")
    return where


def _row_parts(
    decomposition: Decomposition, tokens: torch.Tensor, name: str, where: torch.Tensor, threshold: float
) -> dict[str, torch.Tensor]:
    """At the positions ``where`` (n rows): the CI (g, g_upper) [n, C], each component's contribution
    norm ‖(x · v_c) u_c‖ [n, C] and h = x V [n, C]; plus the full CI of every module and the clean
    logits, for the objective."""
    part = decomposition._components(name)
    target, inputs = decomposition.run_clean(decomposition.model, tokens)
    ci = decomposition.ci_from_inputs(inputs)
    g, g_upper = ci[name]
    h = inputs[name][where].to(part.V.dtype) @ part.V
    norms = h.abs() * part.U.norm(dim=-1)  # ‖h_c u_c‖ = |h_c| ‖u_c‖
    return dict(g=g[where], g_upper=g_upper[where], h=h, norms=norms, active=g[where] > threshold,
                ci=ci, target=target)  # fmt: skip


@torch.no_grad()
def contributions(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    name: str,
    where: torch.Tensor,
    threshold: float = 0.1,
) -> dict[str, Any]:
    """The components of ``name`` at the positions ``where`` (a bool mask [batch, positions]).

    Returns {"components": [{"component", "ci", "active", "z", "contribution"}], "n_active",
    "cancellation", "n_positions"}, one entry per component active (CI > ``threshold``) at one of the
    positions at least, the largest mean contribution first: ``ci`` its mean CI, ``active`` the share of
    positions where it is active, ``z`` its mean pre-activation where that exceeds 1 (the CI is 1 there;
    None if never), ``contribution`` the mean of ‖(x · v_c) u_c‖. ``n_active`` is the mean number of
    active components per position (the CI-L0 there), ``cancellation`` the mean over positions of
    Σ_c ‖(x · v_c) u_c‖ / ‖Σ_c (x · v_c) u_c‖ over that position's active components."""
    where = _check_where(where, tokens)
    parts = _row_parts(decomposition, tokens, name, where, threshold)
    g, g_upper, h, norms, active = (parts[key] for key in ("g", "g_upper", "h", "norms", "active"))
    z = 1 + (g_upper - 1) / LEAK  # the pre-activation, exact where z > 1
    anywhere = active.any(0).nonzero().squeeze(1)
    rows = []
    for c in anywhere[norms[:, anywhere].mean(0).argsort(descending=True)].tolist():
        above = g_upper[:, c] > 1
        rows.append(
            {
                "component": c,
                "ci": float(g[:, c].mean()),
                "active": float(active[:, c].float().mean()),
                "z": float(z[above, c].mean()) if above.any() else None,
                "contribution": float(norms[:, c].mean()),
            }
        )
    U = decomposition._components(name).U
    summed = ((h * active) @ U).norm(dim=-1)  # ‖Σ over active c of h_c u_c‖ per row
    ratio = (norms * active).sum(-1) / summed.clamp_min(1e-12)
    some = active.any(-1)
    return {
        "components": rows,
        "n_active": float(active.sum(-1).float().mean()),
        "cancellation": float(ratio[some].mean()) if some.any() else float("nan"),
        "n_positions": int(where.sum()),
    }


@torch.no_grad()
def training_objective(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    target: torch.Tensor,
    ci: dict[str, tuple[torch.Tensor, torch.Tensor]],
    config: SPDConfig,
    p: float,
    seeds: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-draw weighted reconstruction loss [len(seeds)], coefficient × minimality loss): the SPD
    loss without faithfulness (which the CI does not touch), one mask draw per seed."""
    which = [term for term in RECONSTRUCTIONS if getattr(config, term)]
    per_draw = []
    for seed in seeds:
        terms = reconstruction_losses(
            decomposition, tokens, target, ci, which, config.mask_type,
            torch.Generator(device=tokens.device).manual_seed(seed), config.positions,
        )  # fmt: skip
        per_draw.append(sum(getattr(config, term) * value for term, value in terms.items()))
    recon = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in per_draw])
    minimality = config.minimality * importance_minimality_loss(ci, p, reduce=config.minimality_reduce)
    return recon, minimality.double()


@torch.no_grad()
def pruning_cost(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    config: SPDConfig,
    step: int,
    name: str,
    where: torch.Tensor,
    keep: Sequence[int],
    threshold: float = 0.1,
    draws: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """For each k in ``keep``: the change of the training objective (``config``'s terms at ``step``'s p)
    when, at each position ``where``, only the k largest contributors among ``name``'s components
    active there (CI > ``threshold``) keep their CI, and the other active ones' CI (both leaky forms)
    is set to 0 there. Positions with k or fewer active components are left as they are.

    Returns :func:`contributions`' fields plus {"module", "base": {"recon", "minimality"}, "keep":
    [{"k", "recon_delta", "recon_delta_se", "minimality_delta", "total_delta"}]};
    ``recon_delta_se`` is the standard error of the paired per-draw differences."""
    where = _check_where(where, tokens)
    if draws < 2:
        raise ValueError(f"draws={draws}: need at least 2 mask draws for a standard error")
    bad = [k for k in keep if isinstance(k, bool) or not isinstance(k, int) or k < 0]
    if bad:
        raise ValueError(f"keep={list(keep)}: each k must be an int >= 0 (components kept per position)")
    info = contributions(decomposition, tokens, name, where, threshold)
    parts = _row_parts(decomposition, tokens, name, where, threshold)
    ci, target, norms, active = parts["ci"], parts["target"], parts["norms"], parts["active"]
    # rank of each component's contribution among the position's active ones (0 = largest)
    rank = torch.where(active, norms, -1.0).argsort(-1, descending=True).argsort(-1)
    p = config.p_at(step)
    seeds = [seed + i for i in range(draws)]
    base_recon, base_min = training_objective(decomposition, tokens, target, ci, config, p, seeds)
    rows = []
    for k in keep:
        cut = torch.zeros_like(ci[name][0], dtype=torch.bool)
        cut[where] = active & (rank >= k)
        g, g_upper = ci[name]
        pruned = {**ci, name: (g.masked_fill(cut, 0.0), g_upper.masked_fill(cut, 0.0))}
        recon, minimality = training_objective(decomposition, tokens, target, pruned, config, p, seeds)
        diff = recon - base_recon
        rows.append(
            {
                "k": k,
                "recon_delta": float(diff.mean()),
                "recon_delta_se": float(diff.std() / len(seeds) ** 0.5),
                "minimality_delta": float(minimality - base_min),
                "total_delta": float(diff.mean() + minimality - base_min),
            }
        )
    return {"module": name, **info, "base": {"recon": float(base_recon.mean()), "minimality": float(base_min)},
            "keep": rows}  # fmt: skip


def pruning_table(results: Sequence[dict[str, Any]], label: str = "positions") -> str:
    """Markdown: one row per (module, k) of :func:`pruning_cost` results."""
    from mxd_lens.spd.report import _markdown, short_name

    head = [
        "module",
        label,
        "active",
        "cancellation",
        "keep k",
        "Δ recon (± s.e.)",
        "Δ minimality",
        "Δ total",
    ]
    rows = []
    for result in results:
        for row in result["keep"]:
            rows.append(
                [
                    short_name(result["module"]),
                    str(result.get("where", "")),
                    f"{result['n_active']:.2f}",
                    f"{result['cancellation']:.2f}",
                    str(row["k"]),
                    f"{row['recon_delta']:+.2e} (± {row['recon_delta_se']:.1e})",
                    f"{row['minimality_delta']:+.2e}",
                    f"{row['total_delta']:+.2e}",
                ]
            )
    return _markdown(head, rows)

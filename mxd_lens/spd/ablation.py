"""Finding and ablating the SPD components of a concept.

After a decomposition is trained (``SPDTrainer``), three steps test whether one rank-1 component carries
a concept (the SPD paper's "golf"/"basketball" directions in GPT-2-small):

    scores = concept_scores(decomp, model, concept_batches, control_batches)      # which component?
    top = scores["blocks.27.mlp.W_out"].top(1)
    with ablate(decomp, {"blocks.27.mlp.W_out": top}):                          # the model without it
        logits = model(tokens)
    report = ablation_effect(model, decomp, {"blocks.27.mlp.W_out": top}, target_batches, control_batches)

- ``concept_scores``: per component, the mean causal importance g_c (or the mean component activation
  |x v_c|·‖u_c‖) over the positions of concept texts minus that over control texts; ranked by it.
- ``ablate``: the host model with the chosen components' rank-1 terms removed, every other component at
  mask 1 and the delta component on: the module computes y = x Wᵀ + b − Σ_{c ∈ A} (x·v_c) u_c. It is
  ``decomp.patched(masks=m)`` with m_c = 0 for c ∈ A and 1 otherwise, m_Δ = 1, and equals the model whose
  weight has u_c v_cᵀ subtracted by hand. With nothing ablated the model is exactly the clean one
  (whatever ``decomp.delta`` says).
- ``ablation_effect``: next-token cross-entropy, probability of the correct next token and
  KL(clean ‖ ablated) on target and control texts, with and without the ablation, and the same for
  components of similar norm drawn at random (the baseline).

A late layer of a large model can be decomposed without running the early layers at every step:
``ResidualModel(model, layer)`` is the model run from the input of block ``layer``; its batches are the
residual streams ``residual(tokens)`` cached once. ``Decomposition``, ``SPDTrainer``, ``evaluate`` and
everything here take it in place of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mxd_lens.spd.components import Decomposition, _io_hooks, _storer

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # tokens, or (model input, tokens)
METHODS = ("ci", "activation")


# -- running a model from a layer ------------------------------------------------------------------------
class ResidualModel(nn.Module):
    """``model`` run from the input of block ``layer``: ``forward(resid)`` = ``model(resid,
    start_at_layer=layer)`` for a residual stream [b, p, d_model] cached with ``residual(tokens)``.

    It exposes what ``Decomposition`` needs (``cfg``, ``blocks``, ``hooks``), so the decomposition and the
    trainer run on it unchanged; a decomposed weight must sit in a block the forward runs
    (``check_modules``). Its parameters are the host model's (for ``requires_grad_``)."""

    def __init__(self, model: HookedTransformer, layer: int):
        super().__init__()
        n_layers = model.cfg.n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"layer={layer!r}: the model has blocks 0..{n_layers - 1}")
        if model.cfg.positional_embedding_type == "shortformer":
            raise ValueError(
                "a Shortformer model adds its position embedding inside every attention layer: "
                "ResidualModel does not pass it; run the full model on tokens instead"
            )
        self.model, self.layer = model, layer

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.blocks

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def hooks(self, *args: Any, **kwargs: Any):
        return self.model.hooks(*args, **kwargs)

    def forward(self, resid: torch.Tensor) -> torch.Tensor:
        if resid.ndim != 3 or not resid.is_floating_point() or resid.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"ResidualModel takes the residual stream [batch, pos, d_model={self.cfg.d_model}] at the "
                f"input of block {self.layer} (see .residual(tokens)), got a {resid.dtype} tensor of shape "
                f"{tuple(resid.shape)}"
            )
        return self.model(resid, start_at_layer=self.layer)

    @torch.no_grad()
    def residual(self, tokens: torch.Tensor) -> torch.Tensor:
        """The clean residual stream at the input of block ``layer`` (= ``blocks.L.hook_resid_pre``)."""
        return self.model(tokens, stop_at_layer=self.layer)

    def check_modules(self, names: Sequence[str]) -> None:
        """Raise unless every weight name is in a block at or after ``layer`` (others never run)."""
        early = [name for name in names if _layer_of(name) < self.layer]
        if early:
            raise ValueError(
                f"{early} sit before block {self.layer}, where this ResidualModel starts: they never run"
            )


def _layer_of(name: str) -> int:
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"{name!r} is not a weight name like 'blocks.0.mlp.W_in'")
    return int(parts[1])


def _host(model: Any) -> Any:
    return model.model if isinstance(model, ResidualModel) else model


def _split(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(model input, tokens) of a batch given as tokens or as an (input, tokens) pair."""
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise ValueError(f"a batch is tokens or an (input, tokens) pair, got a sequence of {len(batch)}")
        return batch[0], batch[1]
    return batch, (None if batch.is_floating_point() else batch)


# -- which components carry a concept --------------------------------------------------------------------
@dataclass
class ConceptScores:
    """Per component c of one module: mean importance on concept positions, on control positions, and
    the score = concept − control (higher: more specific to the concept)."""

    module: str
    method: str
    concept: torch.Tensor  # [C]
    control: torch.Tensor  # [C]
    n_concept: int  # positions averaged
    n_control: int

    @property
    def score(self) -> torch.Tensor:
        return self.concept - self.control

    def ranking(self) -> list[int]:
        """Component indices, highest score first (ties: lower index first)."""
        return torch.argsort(self.score, descending=True, stable=True).tolist()

    def top(self, k: int = 1) -> list[int]:
        return self.ranking()[:k]

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        rows = [
            {
                "component": c,
                "score": float(self.score[c]),
                "concept": float(self.concept[c]),
                "control": float(self.control[c]),
            }
            for c in self.top(k)
        ]
        return {
            "module": self.module,
            "method": self.method,
            "n_concept_positions": self.n_concept,
            "n_control_positions": self.n_control,
            "top": rows,
        }


@torch.no_grad()
def component_importance(
    decomp: Decomposition, model: Any, batch: Batch, method: str = "ci"
) -> dict[str, torch.Tensor]:
    """{name: [b, p, C]}: the CI g (``"ci"``) or the component activations |x·v_c|·‖u_c‖
    (``"activation"``, the norm of the component's output) of every decomposed module on one batch."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {METHODS}")
    x, _ = _split(batch)
    _, inputs = decomp.run_clean(model, x)
    if method == "ci":
        return {name: g for name, (g, _) in decomp.ci_from_inputs(inputs).items()}
    out = {}
    for name in decomp.names:
        part = decomp._components(name)
        out[name] = (inputs[name].to(part.V.dtype) @ part.V).abs() * part.U.norm(dim=1)
    return out


def concept_scores(
    decomp: Decomposition,
    model: Any,
    concept_batches: Iterable[Batch],
    control_batches: Iterable[Batch],
    method: str = "ci",
    skip_first: int = 1,
) -> dict[str, ConceptScores]:
    """Rank each module's components by how specifically they matter on the concept texts: mean
    importance (``component_importance``) over all positions of the concept batches minus that over the
    control batches. ``skip_first`` leading positions of every row are left out (default 1: the BOS,
    whose activations are outliers). ``model`` is what the batches are fed to (the host model on tokens,
    or a ``ResidualModel`` on cached residual streams)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {METHODS}")
    if skip_first < 0:
        raise ValueError(f"skip_first={skip_first} must be >= 0")
    means = []
    for label, batches in (("concept", concept_batches), ("control", control_batches)):
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for batch in batches:
            importance = component_importance(decomp, model, batch, method)
            for name, value in importance.items():
                value = value[:, skip_first:].double()
                sums[name] = sums.get(name, 0) + value.sum((0, 1))
            count += value.shape[0] * value.shape[1]
        if count == 0:
            raise ValueError(
                f"no {label} positions: give at least one batch with more than {skip_first} positions"
            )
        means.append(({name: (total / count).float() for name, total in sums.items()}, count))
    (concept, n_concept), (control, n_control) = means
    return {
        name: ConceptScores(name, method, concept[name], control[name], n_concept, n_control)
        for name in decomp.names
    }


# -- ablation --------------------------------------------------------------------------------------------
def check_components(decomp: Decomposition, components: Mapping[str, Iterable[int]]) -> dict[str, list[int]]:
    """``components`` as {name: sorted distinct indices}; a ValueError for an unknown module or an index
    outside 0..C−1 (each index counts once: ablating a component twice is ablating it)."""
    if not isinstance(components, Mapping):
        raise ValueError(
            f"components must map weight names to component indices, got {type(components).__name__}"
        )
    out = {}
    for name, indices in components.items():
        decomp._components(name)  # unknown module: ValueError naming the decomposed ones
        if isinstance(indices, int) or isinstance(indices, torch.Tensor) and indices.ndim == 0:
            indices = [indices]
        checked = set()
        for index in indices:
            index = index.item() if isinstance(index, torch.Tensor) else index
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < decomp.C:
                raise ValueError(
                    f"component index {index!r} of {name!r} is out of range: components are 0..{decomp.C - 1}"
                )
            checked.add(index)
        if checked:
            out[name] = sorted(checked)
    return out


@contextmanager
def ablate(decomp: Decomposition, components: Mapping[str, Iterable[int]]) -> Iterator[Any]:
    """Run the host model (yielded) with ``components`` ({name: indices}) removed: at each listed module
    y = x Wᵀ + b − Σ_{c ∈ A} (x·v_c) u_c, the rest of the model untouched. Nothing listed: the clean model."""
    spec = check_components(decomp, components)
    entries = []
    for name, indices in spec.items():
        part = decomp._components(name)
        index = torch.tensor(indices, device=part.V.device)
        slot: dict[str, torch.Tensor] = {}

        def remove(original: torch.Tensor, hook: Any, part=part, index=index, slot=slot) -> torch.Tensor:
            x = slot.pop("x")
            out = original.reshape(*original.shape[:2], -1)
            removed = (x.to(part.V.dtype) @ part.V[:, index]) @ part.U[index]
            return (out - removed.to(out.dtype)).reshape(original.shape)

        entries.append((decomp.sites[name], _storer(slot, "x"), remove))
    with _io_hooks(decomp.model, entries):
        yield decomp.model


def component_norms(decomp: Decomposition, name: str) -> torch.Tensor:
    """‖u_c v_cᵀ‖_F = ‖v_c‖·‖u_c‖ for every component of module ``name``: [C]."""
    part = decomp._components(name)
    return (part.V.norm(dim=0) * part.U.norm(dim=1)).detach()


def norm_matched_components(
    decomp: Decomposition,
    components: Mapping[str, Iterable[int]],
    n: int = 5,
    pool: int = 10,
    generator: torch.Generator | None = None,
) -> list[dict[str, list[int]]]:
    """``n`` random stand-ins for ``components``: each ablated component is replaced by one of the
    ``pool`` other components of its module closest to it in norm (in log scale), not one of the ablated
    ones; draws go through a random order of that pool, so they differ while the pool lasts."""
    spec = check_components(decomp, components)
    if n < 0 or pool < 1:
        raise ValueError(f"n={n} must be >= 0 and pool={pool} >= 1")
    draws: list[dict[str, list[int]]] = [{} for _ in range(n)]
    for name, indices in spec.items():
        log_norm = (component_norms(decomp, name).double() + 1e-12).log()
        others = torch.tensor([c for c in range(decomp.C) if c not in indices], dtype=torch.long)
        if others.numel() < len(indices):
            raise ValueError(f"{name!r}: {decomp.C} components leave too few to stand in for {indices}")
        used_per_draw: list[set[int]] = [set() for _ in range(n)]
        for index in indices:
            distance = (log_norm[others] - log_norm[index]).abs()
            nearest = others[torch.argsort(distance, stable=True)[: max(pool, len(indices))]]
            order = nearest[torch.randperm(nearest.numel(), generator=generator)].tolist()
            for d in range(n):
                choice = next(c for c in order[d % len(order) :] + order if c not in used_per_draw[d])
                used_per_draw[d].add(choice)
                draws[d].setdefault(name, []).append(choice)
    return [{name: sorted(ix) for name, ix in draw.items()} for draw in draws]


# -- effect of an ablation -------------------------------------------------------------------------------
class _Tally:
    """Per-row sums of next-token CE, p(correct) and KL(clean ‖ ablated), clean and ablated."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []  # [b, 6]: ce_clean, ce_abl, p_clean, p_abl, kl, n

    def add(self, clean_lp: torch.Tensor, lp: torch.Tensor, tokens: torch.Tensor) -> None:
        labels = tokens[:, 1:, None]
        clean_lp, lp = clean_lp[:, :-1], lp[:, :-1]
        ce_clean = -clean_lp.gather(-1, labels)[..., 0]
        ce = -lp.gather(-1, labels)[..., 0]
        kl = (clean_lp.exp() * (clean_lp - lp)).sum(-1)
        n = torch.full_like(ce, 1.0)
        stats = [ce_clean, ce, (-ce_clean).exp(), (-ce).exp(), kl, n]
        self.rows.append(torch.stack([s.double().sum(1) for s in stats], dim=1))

    def summary(self) -> dict[str, float]:
        rows = torch.cat(self.rows)
        n = rows[:, 5]
        total = rows.sum(0)
        mean = {
            key: float(total[i] / total[5])
            for i, key in enumerate(("ce", "ce_ablated", "p", "p_ablated", "kl"))
        }
        per_row = (rows[:, 1] - rows[:, 0]) / n
        se = float(per_row.std(unbiased=True) / math.sqrt(len(per_row))) if len(per_row) > 1 else float("nan")
        return {
            "ce_clean": mean["ce"],
            "ce_ablated": mean["ce_ablated"],
            "delta_ce": mean["ce_ablated"] - mean["ce"],
            "delta_ce_se": se,  # standard error of the per-row mean ΔCE, across rows
            "rel_delta_ce": (mean["ce_ablated"] - mean["ce"]) / mean["ce"],
            "p_correct_clean": mean["p"],
            "p_correct_ablated": mean["p_ablated"],
            "delta_p_correct": mean["p_ablated"] - mean["p"],
            "kl": mean["kl"],
            "n_rows": len(per_row),
            "n_tokens": int(total[5]),
        }


@torch.no_grad()
def ablation_effect(
    model: Any,
    decomp: Decomposition,
    components: Mapping[str, Iterable[int]],
    target_batches: Iterable[Batch],
    control_batches: Iterable[Batch] | Mapping[str, Iterable[Batch]],
    n_random: int = 5,
    pool: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    """Effect of ablating ``components`` on next-token prediction, on target and control texts.

    A batch is tokens [b, p] or, for a model run from a cached residual stream, an (input, tokens)
    pair. ``control_batches`` may be a mapping {label: batches} for several control sets. For each set
    (``"target"``, ``"control"`` or the labels): ``ce_clean``, ``ce_ablated``, ``delta_ce`` (nats per
    token, with ``delta_ce_se`` across rows), ``p_correct_*`` and ``delta_p_correct`` (mean probability of
    the actual next token) and ``kl`` (KL(clean ‖ ablated) per token). The same for ``n_random``
    norm-matched random components (``norm_matched_components``), each and their mean."""
    spec = check_components(decomp, components)
    if _host(model) is not _host(decomp.model):
        raise ValueError("model and the decomposition's model are not the same host model")
    generator = torch.Generator().manual_seed(seed)
    randoms = norm_matched_components(decomp, spec, n_random, pool, generator) if spec else []
    configs = [spec, *randoms]
    sets = {"target": target_batches}
    if isinstance(control_batches, Mapping):
        if "target" in control_batches:
            raise ValueError("'target' is taken: name the control sets otherwise")
        sets.update(control_batches)
    else:
        sets["control"] = control_batches
    tallies = {label: [_Tally() for _ in configs] for label in sets}
    for label, batches in sets.items():
        for batch in batches:
            x, tokens = _split(batch)
            if tokens is None:
                raise ValueError(f"{label}: a residual-stream batch must come as an (input, tokens) pair")
            clean = F.log_softmax(model(x).float(), dim=-1)
            for tally, config in zip(tallies[label], configs, strict=True):
                with ablate(decomp, config):
                    lp = F.log_softmax(model(x).float(), dim=-1)
                tally.add(clean, lp, tokens.to(clean.device))
        if not tallies[label][0].rows:
            raise ValueError(f"{label}: no batches")

    def described(config: dict[str, list[int]], i: int) -> dict[str, Any]:
        return {
            "components": config,
            "norms": {
                name: [float(component_norms(decomp, name)[c]) for c in ix] for name, ix in config.items()
            },
            "effects": {label: tallies[label][i].summary() for label in sets},
        }

    result = described(spec, 0)
    result["random"] = [described(config, i + 1) for i, config in enumerate(randoms)]
    if randoms:
        result["random_mean"] = {
            label: {
                key: float(sum(r["effects"][label][key] for r in result["random"]) / len(randoms))
                for key in ("delta_ce", "delta_p_correct", "kl", "rel_delta_ce")
            }
            for label in sets
        }
    return result

"""Attribution through spliced layers: which experts (MxD) or latents (transcoders) carry a prediction.

**Exact contributions** (``contributions``). A layer's output is affine in its codes: with the
mixture m = Σ_n a_n W_dec[n], MxD writes (zD) ⊙ m + b, a transcoder m + b (+ x W_skip). So unit n's
contribution at token t is e_{t,n} = out(a_n W_dec[n]) − out(0), and Σ_n e_{t,n} + out(0) is the
output exactly; ``out(0)`` (the bias, and the skip term of a skip transcoder) is reported as ``rest``.
For MxD e_{t,n} = a_{t,n} · ((z_t D) ⊙ c_n): an input-dependent vector, not a fixed decoder row.

**Attribution to a target** (``attribute``), in the model linearised at the prompt (as circuit-tracer
does): every attention pattern and every norm's scale frozen at their values on the prompt, and every
MLP output (spliced or not) frozen as a constant "node". The target (a logit, a logit difference, any
scalar of the logits) is then an affine function of the sources that write into the residual stream:
token and position embeddings, the MLP outputs, and the bias parameters (attention b_O and b_V, norm
biases, b_U). Each source's attribution is source · ∂target/∂source in the frozen model, and they sum
to the target exactly (``Attribution.completeness``). A spliced block's output is split further into
its units' e_{t,n} · g_t, its ``rest`` and the error term (what the splice writes minus the layer's
own output: the error term itself with ``splice(..., error_term=True)``, else zero), at the positions
the splice replaces (``mxd_lens.hooks.first_position``); before them (position 0, BOS, for a layer
trained without it) the block's output is the MLP's own, a "mlp (dense)" part, as circuit-tracer
zeroes every feature at position 0.

A layer that replaces the MLP module (``metadata.hook_name_out = blocks.L.mlp.hook_out``: Gemma-2/3 and
OLMo-2/3, whose blocks normalise the MLP output before ``hook_mlp_out``, ``mxd_lens.hooks``) is split
where it writes: its block's node is the MLP module's output, and the post-MLP norm after it, its scale
frozen, is affine, so the target stays affine in every source and the parts still sum to it;
``Attribution.frozen`` holds that node under ``blocks.L.mlp.hook_out``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mxd_lens import hook_names, hooks

__all__ = [
    "Attribution",
    "Contributions",
    "attribute",
    "contributions",
    "edges",
    "frozen_target",
    "logit_target",
]

# Sources among the parameters: those added into the residual stream (weights multiply, and Q/K biases
# and MLP-internal biases act only through what is frozen). Matched on the attribute name with its
# leading underscores removed: grouped-query attention stores the value bias as ``_b_V`` (``b_V`` is a
# property repeating it over heads). ``_unrecognised_sources`` checks the selection without names.
_BIAS_NAMES = ("b_O", "b_V", "b_U", "b")


def _is_bias_source(name: str) -> bool:
    return name.split(".")[-1].lstrip("_") in _BIAS_NAMES


@dataclass
class Contributions:
    """One layer's output split by unit: ``vectors[t, j]`` is unit ``indices[t, j]``'s contribution
    (code ``values[t, j]``) at token t; ``rest[t]`` the output with no unit active."""

    indices: torch.Tensor  # [T, K]
    values: torch.Tensor  # [T, K]
    vectors: torch.Tensor  # [T, K, d_out]
    rest: torch.Tensor  # [T, d_out]

    def total(self) -> torch.Tensor:
        """Σ contributions + rest: the layer's output [T, d_out]."""
        return self.vectors.sum(1) + self.rest


@torch.no_grad()
def contributions(layer: Any, x: torch.Tensor) -> Contributions:
    """The exact per-unit split of ``layer(x)`` for inputs x [T, d_in] (see the module docstring): any
    mxd-lens layer, or a SAELens transcoder from elsewhere (``mxd_lens.foreign``), x being what it reads."""
    return Contributions(*hooks.replacement(layer).split(x))


def logit_target(
    token: int, minus: int | None = None, position: int = -1
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A target: the logit of ``token`` at ``position`` (minus that of ``minus``: a logit difference)."""

    def target(logits: torch.Tensor) -> torch.Tensor:
        value = logits[0, position, token]
        return value - logits[0, position, minus] if minus is not None else value

    target.tokens = (token, minus)  # type: ignore[attr-defined]
    target.position = position  # type: ignore[attr-defined]
    return target


@dataclass
class Attribution:
    """The parts of a target in the frozen model. ``units``: one row per (block, position, unit) of a
    spliced layer with its code and attribution; ``parts``: every other source (embeddings per
    position, dense MLP outputs, spliced layers' rest and error per position, bias parameters)."""

    target: float
    units: Any  # pandas.DataFrame: block, position, token, unit, code, attribution
    parts: Any  # pandas.DataFrame: kind, block, position, attribution
    frozen: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    logit_head: Any = field(repr=False, default=None)  # _LogitHead: the soft-cap as linearised, if any

    @property
    def total(self) -> float:
        return float(self.units["attribution"].sum() + self.parts["attribution"].sum())

    @property
    def completeness(self) -> float:
        """|Σ parts − target| / max(|target|, 1e-12): 0 up to float error (the parts sum to the target)."""
        return abs(self.total - self.target) / max(abs(self.target), 1e-12)

    def top(self, n: int = 10) -> Any:
        """The ``n`` units with the largest |attribution|."""
        return self.units.reindex(self.units["attribution"].abs().sort_values(ascending=False).index).head(n)


def _check_tokens(model: Any, tokens: Any) -> torch.Tensor:
    if isinstance(tokens, str):
        tokens = model.to_tokens(tokens)
    tokens = torch.as_tensor(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[0] != 1:
        raise ValueError(
            f"attribute takes one prompt: tokens of shape [1, positions], got {tuple(tokens.shape)}"
        )
    bad = tokens[(tokens < 0) | (tokens >= model.cfg.d_vocab)]
    if len(bad):
        raise ValueError(f"token id {int(bad[0])} is not in the vocabulary (0..{model.cfg.d_vocab - 1})")
    return tokens.to(model.cfg.device)


def _check_target(model: Any, target: Any, n_pos: int) -> None:
    for token in getattr(target, "tokens", ()):
        if token is not None and not 0 <= token < model.cfg.d_vocab:
            raise ValueError(f"target token {token} is not in the vocabulary (0..{model.cfg.d_vocab - 1})")
    position = getattr(target, "position", None)
    if position is not None and not -n_pos <= position < n_pos:
        raise ValueError(f"target position {position} is out of range for a prompt of {n_pos} tokens")


def attribute(model: Any, tokens: Any, target: Callable[[torch.Tensor], torch.Tensor]) -> Attribution:
    """Attribute ``target(logits)`` (a scalar; e.g. ``logit_target(token)``) on one prompt to the
    units of the layers spliced into ``model`` (``with mxd_lens.splice(model, layer): ...``) and to
    every other source, in the model linearised at the prompt (see the module docstring)."""
    import pandas as pd

    spliced = hooks.spliced_layers(model)
    if not spliced:
        raise ValueError(
            "no layer is spliced into the model: call attribute inside `with mxd_lens.splice(model, layer):` "
            "(its units are what gets attributed)"
        )
    tokens = _check_tokens(model, tokens)
    n_pos = tokens.shape[1]
    _check_target(model, target, n_pos)

    freeze_names = hook_names.is_pattern_or_scale
    mlp_out = [hook_names.mlp_out_hook(b) for b in range(model.cfg.n_layers)]
    wanted = lambda name: freeze_names(name) or name in mlp_out  # noqa: E731
    reps = {block: hooks.replacement(layer) for block, layer in spliced.items()}
    resid = hooks.resid_blocks(list(reps.values()))
    # each block's node: hook_mlp_out, or the MLP module's output for a layer that writes there
    at_module = sorted(b for b, rep in reps.items() if rep.writes == "mlp")
    node = {
        b: hook_names.out_hook(b, "mlp" if b in at_module else "hook_mlp_out")
        for b in range(model.cfg.n_layers)
    }
    with (
        torch.no_grad(),
        hooks.capture_mlp_io(model, sorted(spliced), resid=resid, module_out=at_module) as io,
        _raw_logits(model) as cap,
    ):
        raw, cache = model.run_with_cache(tokens, names_filter=wanted)
    head = _LogitHead.at(raw, cap)

    leaves: dict[str, torch.Tensor] = {}

    def freeze(value: torch.Tensor, hook: Any) -> torch.Tensor:
        return cache[hook.name].detach()

    def leaf(value: torch.Tensor, hook: Any) -> torch.Tensor:
        source = (cache[hook.name] if hook.name in cache else value).detach().clone().requires_grad_(True)
        leaves[hook.name] = source
        return source

    fwd_hooks = [
        (freeze_names, freeze),
        (lambda name: name in node.values() or name in hook_names.EMBED_HOOKS.values(), leaf),
    ]
    module_leaves = {(b, "mlp"): _module_leaf(io[b]["module_out"], node[b], leaves) for b in at_module}
    biases = {name: p for name, p in model.named_parameters() if _is_bias_source(name)}
    with torch.enable_grad(), hooks.replacing_outputs(model, module_leaves), _raw_logits(model):
        logits = head(model.run_with_hooks(tokens, fwd_hooks=fwd_hooks))
        value = target(logits)
        if value.numel() != 1:
            raise ValueError(f"the target must be a scalar, got a tensor of shape {tuple(value.shape)}")
        names, inputs = zip(*[*leaves.items(), *biases.items()], strict=True)
        grads = torch.autograd.grad(value, inputs, allow_unused=True)
    grad = {
        n: (torch.zeros_like(t) if g is None else g) for n, t, g in zip(names, inputs, grads, strict=True)
    }

    strings = (
        model.to_str_tokens(tokens[0])
        if getattr(model, "tokenizer", None) is not None
        else tokens[0].tolist()
    )
    parts, units = [], []
    for kind, name in hook_names.EMBED_HOOKS.items():
        if name in leaves:
            per_pos = (leaves[name][0].detach() * grad[name][0]).sum(-1)
            parts += [{"kind": kind, "block": None, "position": t, "attribution": float(v)}
                      for t, v in enumerate(per_pos)]  # fmt: skip
    for block in range(model.cfg.n_layers):
        name = node[block]
        written, g = leaves[name][0].detach(), grad[name][0]
        if block not in spliced:
            parts += [{"kind": "mlp (dense)", "block": block, "position": t, "attribution": float(v)}
                      for t, v in enumerate((written * g).sum(-1))]  # fmt: skip
            continue
        split = contributions(spliced[block], hooks.layer_input(io, reps[block])[0])
        unit_attr = (split.vectors * g[:, None, :]).sum(-1)  # [T, K]
        error = written - split.total()
        first = min(reps[block].first, n_pos)  # before it the splice kept the MLP's own output
        parts += [{"kind": "mlp (dense)", "block": block, "position": t, "attribution": float(v)}
                  for t, v in enumerate((written[:first] * g[:first]).sum(-1))]  # fmt: skip
        for t in range(first, n_pos):
            for j in range(split.indices.shape[1]):
                if split.values[t, j] != 0:
                    units.append({"block": block, "position": t, "token": strings[t], "unit": int(split.indices[t, j]),
                                  "code": float(split.values[t, j]), "attribution": float(unit_attr[t, j])})  # fmt: skip
            parts.append({"kind": "rest (bias, skip)", "block": block, "position": t,
                          "attribution": float(split.rest[t] @ g[t])})  # fmt: skip
            parts.append(
                {"kind": "error", "block": block, "position": t, "attribution": float(error[t] @ g[t])}
            )
    bias_parts = {name: float((p.detach() * grad[name]).sum()) for name, p in biases.items()}
    for name, v in bias_parts.items():
        parts.append({"kind": f"bias {name}", "block": None, "position": None, "attribution": v})
    if head.offset is not None:  # what the linearised soft-cap adds: cap tanh(u0/cap) - slope u0
        parts.append({"kind": "logit soft-cap (linearised)", "block": None, "position": None,
                      "attribution": float(target(head.offset))})  # fmt: skip
    _check_bias_sources(
        model, tokens, target, fwd_hooks, module_leaves, head, sum(bias_parts.values()), value
    )
    columns = ["block", "position", "token", "unit", "code", "attribution"]
    return Attribution(
        target=float(value.detach()),
        units=pd.DataFrame(units, columns=columns),
        parts=pd.DataFrame(parts, columns=["kind", "block", "position", "attribution"]),
        frozen={n: t.detach() for n, t in leaves.items()},
        logit_head=head,
    )


@dataclass
class _LogitHead:
    """The logits from the unembedding's output ``u``: as they are, or, for a model whose logits are
    soft-capped (Gemma-2: ``cap tanh(u / cap)``), that tanh frozen like every other nonlinearity: its
    tangent at the prompt, ``slope u + offset`` (slope = 1 - tanh²(u0 / cap), offset = cap tanh(u0 / cap)
    - slope u0). At the prompt it gives the model's logits; the offset is a part of its own."""

    slope: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @classmethod
    def at(cls, raw: torch.Tensor, cap: float | None) -> _LogitHead:
        if cap is None:
            return cls()
        capped = torch.tanh(raw.detach() / cap)
        slope = 1 - capped**2
        return cls(slope, cap * capped - slope * raw.detach())

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        return raw if self.slope is None else raw * self.slope + self.offset


@contextmanager
def _raw_logits(model: Any) -> Iterator[float | None]:
    """While inside, the model returns its logits before the final soft-cap (if it has one: its cap)."""
    cap = getattr(model.cfg, "output_logits_soft_cap", -1.0)
    if cap is None or cap <= 0:
        yield None
        return
    model.cfg.output_logits_soft_cap = -1.0
    try:
        yield float(cap)
    finally:
        model.cfg.output_logits_soft_cap = cap


def _check_bias_sources(
    model: Any,
    tokens: torch.Tensor,
    target: Callable,
    fwd_hooks: list,
    module_leaves: dict,
    head: _LogitHead,
    bias_total: float,
    value: torch.Tensor,
) -> None:
    """The name-free check of the bias sources: the frozen model is linear in its sources, so with every
    embedding and MLP output set to zero the target is what the bias parameters carry. If the
    parameters selected by name carry something else, a source of this family is missed: raise, naming
    the family, instead of returning parts that do not sum to the target (a Qwen2 value bias ``_b_V``
    was once missed silently). A linearised soft-cap's offset is its own part, so it is taken out."""
    zeroed = [(fwd_hooks[0][0], fwd_hooks[0][1]), (fwd_hooks[1][0], lambda v, hook: torch.zeros_like(v))]
    zero_modules = {at: (lambda out: torch.zeros_like(out)) for at in module_leaves}
    with torch.no_grad(), hooks.replacing_outputs(model, zero_modules), _raw_logits(model):
        alone = float(target(head(model.run_with_hooks(tokens, fwd_hooks=zeroed))))
        if head.offset is not None:
            alone -= float(target(head.offset))
    scale = max(abs(float(value.detach())), abs(alone), 1.0)
    if abs(alone - bias_total) > 1e-5 * scale:
        arch = getattr(model.cfg, "original_architecture", None) or model.cfg.model_name
        raise RuntimeError(
            f"attribution: the bias parameters found by name carry {bias_total:.6g} of the target, but the "
            f"frozen model with every embedding and MLP output zeroed gives {alone:.6g}: this model ({arch}) "
            "adds into the residual stream a parameter that mxd_lens.attribution does not recognise as a "
            "source, so the parts would not sum to the target. Report it with the model's family "
            "(the parameters considered: attribution._BIAS_NAMES)"
        )


def _module_leaf(value: torch.Tensor, name: str, leaves: dict[str, torch.Tensor]):
    """A replacement for an MLP module's output (``hooks.replacing_outputs``): ``value`` as a fresh leaf
    that requires grad, kept in ``leaves[name]``."""

    def replace(out: torch.Tensor) -> torch.Tensor:
        source = value.detach().clone().requires_grad_(True)
        leaves[name] = source
        return source

    return replace


def frozen_target(model: Any, tokens: Any, target: Callable, attribution: Attribution,
                  edit: dict[str, torch.Tensor] | None = None) -> float:  # fmt: skip
    """The target in the frozen model of ``attribution`` (patterns, scales and MLP outputs as on the
    prompt), with ``edit`` {hook name: new value} replacing frozen MLP outputs: what an intervention on
    one contribution does there (the test of the attribution's linearity). A block whose node is the
    MLP module's output (``blocks.L.mlp.hook_out``) has that replaced, its post-MLP norm run after it."""
    tokens = _check_tokens(model, tokens)
    names = [
        n for n in attribution.frozen if (at := hook_names.parse_out_hook(n)) and at[1] == "hook_mlp_out"
    ]
    nodes = {
        n: parsed
        for n in attribution.frozen
        if (parsed := hook_names.parse_out_hook(n)) and parsed[1] == "mlp"
    }
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=hook_names.is_pattern_or_scale)

        def freeze(value: torch.Tensor, hook: Any) -> torch.Tensor:
            return cache[hook.name]

        def mlp(value: torch.Tensor, hook: Any) -> torch.Tensor:
            return (edit or {}).get(hook.name, attribution.frozen[hook.name])

        def module(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda out: (edit or {}).get(name, attribution.frozen[name])

        head = attribution.logit_head or _LogitHead()
        with (
            hooks.replacing_outputs(model, {at: module(name) for name, at in nodes.items()}),
            _raw_logits(model) if head.slope is not None else contextlib.nullcontext(),
        ):
            logits = head(
                model.run_with_hooks(
                    tokens,
                    fwd_hooks=[
                        (hook_names.is_pattern_or_scale, freeze),
                        (lambda n: n in names, mlp),
                    ],
                )
            )
    return float(target(logits))


def edges(model: Any, tokens: Any, upstream: int, downstream: int, keep: float = 0.9) -> Any:
    """Expert → expert edges between the layers spliced at blocks ``upstream`` < ``downstream``: the
    effect of each active upstream unit's contribution e_{t1,u} on each active downstream unit's gate
    pre-activation p_{t2,m} = (x_{t2} W_enc + b_enc)_m (MxD: x G + b_G), in the frozen model (patterns,
    norm scales and MLP outputs as on the prompt), where p is linear in e: weight = e · ∂p/∂(MLP out).
    Returns the edges sorted by |weight|, pruned to the fewest that carry ``keep`` of the total
    |weight| (per downstream unit), with columns up_position, up_unit, down_position, down_unit,
    weight, down_pre (p itself)."""
    import pandas as pd

    spliced = hooks.spliced_layers(model)
    for block in (upstream, downstream):
        if block not in spliced:
            raise ValueError(f"no layer is spliced at block {block} (spliced: {sorted(spliced)})")
    if not upstream < downstream:
        raise ValueError(f"upstream block {upstream} must come before downstream block {downstream}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep={keep} must be in (0, 1]")
    tokens = _check_tokens(model, tokens)
    up, down = spliced[upstream], spliced[downstream]
    mlp_out = [hook_names.mlp_out_hook(b) for b in range(model.cfg.n_layers)]
    freeze_names = hook_names.is_pattern_or_scale
    up_rep, down_rep = hooks.replacement(up), hooks.replacement(down)
    # the source: upstream's hook_mlp_out, or its MLP module's output for a layer writing there (its
    # block's post-MLP norm, scale frozen, then runs after it: hook_mlp_out is not held fixed)
    at_module = up_rep.writes == "mlp"
    with (
        torch.no_grad(),
        hooks.capture_mlp_io(
            model, [upstream], resid=hooks.resid_blocks([up_rep]), module_out=[upstream] if at_module else []
        ) as io,
    ):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: freeze_names(n) or n in mlp_out)
    split = contributions(up, hooks.layer_input(io, up_rep)[0])
    source_name = hook_names.mlp_out_hook(upstream)
    leaf: dict[str, torch.Tensor] = {}
    if at_module:
        mlp_out.remove(source_name)
        source_name = hook_names.mlp_module_out_hook(upstream)
    module_leaf = (
        {(upstream, "mlp"): _module_leaf(io[upstream]["module_out"], "source", leaf)} if at_module else {}
    )

    def freeze(value: torch.Tensor, hook: Any) -> torch.Tensor:
        return cache[hook.name].detach()

    def constant(value: torch.Tensor, hook: Any) -> torch.Tensor:
        out = cache[hook.name].detach().clone()
        if hook.name == source_name:
            out.requires_grad_(True)
            leaf["source"] = out
        return out

    down_resid = hooks.resid_blocks([down_rep])
    with (
        torch.enable_grad(),
        hooks.capture_mlp_io(model, [downstream], resid=down_resid) as down_io,
        hooks.replacing_outputs(model, module_leaf),
    ):
        model.run_with_hooks(tokens, fwd_hooks=[(freeze_names, freeze), (lambda n: n in mlp_out, constant)],
                             stop_at_layer=downstream + 1)  # fmt: skip
        x = hooks.layer_input(down_io, down_rep)[0]
        values, indices = down_rep.encode_sparse(x.detach())
        pre = down_rep.pre_activations(x)  # [T, N], linear in the upstream MLP output under the freeze
        rows = []
        for t2 in range(down_rep.first, x.shape[0]):
            for j in range(indices.shape[1]):
                if values[t2, j] == 0:
                    continue
                m = int(indices[t2, j])
                (g,) = torch.autograd.grad(pre[t2, m], leaf["source"], retain_graph=True)
                weights = (split.vectors * g[0][:, None, :]).sum(-1)  # [T1, K1]
                for t1 in range(up_rep.first, t2 + 1):  # its units write from its first position on
                    for i in range(split.indices.shape[1]):
                        if split.values[t1, i] != 0:
                            rows.append({"up_position": t1, "up_unit": int(split.indices[t1, i]), "down_position": t2,
                                         "down_unit": m, "weight": float(weights[t1, i].detach()), "down_pre": float(pre[t2, m].detach())})  # fmt: skip
    table = pd.DataFrame(
        rows, columns=["up_position", "up_unit", "down_position", "down_unit", "weight", "down_pre"]
    )
    kept = []
    for _, group in table.groupby(["down_position", "down_unit"], sort=False):
        group = group.reindex(group["weight"].abs().sort_values(ascending=False).index)
        share = group["weight"].abs().cumsum() / max(group["weight"].abs().sum(), 1e-30)
        kept.append(group[share.shift(fill_value=0) < keep])
    pruned = pd.concat(kept) if kept else table
    return pruned.reindex(pruned["weight"].abs().sort_values(ascending=False).index).reset_index(drop=True)


def plot_graph(result: Attribution, edge_tables: dict[tuple[int, int], Any] | None = None, top: int = 12,
               path: Any = None) -> Any:  # fmt: skip
    """The pruned graph: the ``top`` units by |attribution| as nodes at (position, block), sized by
    |attribution| and coloured by its sign, each joined to the target (drawn above the last position);
    ``edge_tables`` {(upstream, downstream): edges(...)} adds the expert → expert edges among the shown
    nodes. Returns the Figure (saved to ``path`` when given)."""
    from matplotlib.figure import Figure

    nodes = result.top(top)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    if nodes.empty:
        ax.set_title("no active units")
        return fig
    blocks = sorted(nodes.block.unique())
    level = {b: i for i, b in enumerate(blocks)}
    target_pos, target_level = int(result.units.position.max()), len(blocks)
    scale = float(nodes.attribution.abs().max()) or 1.0
    offsets: dict[tuple[int, int], int] = {}
    where = {}
    for _, row in nodes.iterrows():
        key = (int(row.block), int(row.position))
        k = offsets.get(key, 0)
        offsets[key] = k + 1
        x, y = row.position + 0.12 * k, level[row.block]
        where[(int(row.block), int(row.position), int(row.unit))] = (x, y)
        ax.plot([x, target_pos], [y, target_level], color="tab:red" if row.attribution > 0 else "tab:blue",
                alpha=0.25 + 0.6 * abs(row.attribution) / scale, lw=0.8)  # fmt: skip
        ax.scatter([x], [y], s=60 + 400 * abs(row.attribution) / scale, zorder=3,
                   color="tab:red" if row.attribution > 0 else "tab:blue")  # fmt: skip
        ax.annotate(f"{int(row.unit)}", (x, y), fontsize=7, ha="center", va="center", zorder=4)
    for (up, down), table in (edge_tables or {}).items():
        for _, e in table.iterrows():
            a = where.get((up, int(e.up_position), int(e.up_unit)))
            b = where.get((down, int(e.down_position), int(e.down_unit)))
            if a and b:
                ax.annotate("", b, a, arrowprops={"arrowstyle": "->", "color": "gray", "lw": 0.6})
    ax.scatter([target_pos], [target_level], marker="*", s=300, color="black", zorder=3)
    ax.set_yticks(range(len(blocks) + 1), [f"block {b}" for b in blocks] + ["target"])
    tokens = result.units.drop_duplicates("position").sort_values("position")
    ax.set_xticks(tokens.position, [str(t) for t in tokens.token], rotation=45, ha="right", fontsize=8)
    ax.set_title(f"top {len(nodes)} units by |attribution| (red +, blue −); target {result.target:+.3f}, "
                 f"completeness {result.completeness:.1e}", fontsize=9)  # fmt: skip
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# -- the comparison study: how much of a prediction a few units carry ---------------------------------
def replacement_summary(result: Attribution, top: int = 10) -> dict[str, float]:
    """How much of the spliced layers' share of the target a few units carry (a replacement-score-style
    number). ``spliced`` is the spliced blocks' whole attribution (units + rest + error); then
    ``top_fraction`` = Σ attribution of the ``top`` units by |attribution| / spliced,
    ``units_fraction`` = Σ every unit's / spliced, ``error_fraction`` = Σ error / spliced (signed: parts
    may cancel, so a fraction can exceed 1, and it explodes where the spliced total is near zero),
    ``top_abs_share`` = Σ |top units| / (Σ |units| + Σ |error| + Σ |rest|) and ``error_abs_share`` =
    Σ |error| / the same (unsigned shares of the spliced blocks' attribution mass: comparable across
    prompts), and ``active_units`` = the units that fired at any position."""
    parts = result.parts
    at_spliced = parts[parts["kind"].isin(("error", "rest (bias, skip)"))]
    is_error = at_spliced["kind"] == "error"
    error = float(at_spliced.loc[is_error, "attribution"].sum())
    rest = float(at_spliced.loc[~is_error, "attribution"].sum())
    units = result.units["attribution"]
    spliced = float(units.sum()) + error + rest
    top_units = result.top(top)["attribution"]
    scale = spliced if abs(spliced) > 1e-12 else float("nan")
    denominator = float(units.abs().sum() + at_spliced["attribution"].abs().sum())
    error_mass = float(at_spliced.loc[is_error, "attribution"].abs().sum())
    return {
        "target": result.target,
        "spliced": spliced,
        "top_fraction": float(top_units.sum()) / scale,
        "units_fraction": float(units.sum()) / scale,
        "error_fraction": error / scale,
        "top_abs_share": float(top_units.abs().sum()) / denominator if denominator else float("nan"),
        "error_abs_share": error_mass / denominator if denominator else float("nan"),
        "active_units": len(result.units),
        "completeness": result.completeness,
    }


def single_token(model: Any, text: str) -> int:
    """The id of ``text`` if it is one token of the model's vocabulary (no BOS), else ValueError."""
    ids = model.to_tokens(text, prepend_bos=False)[0]
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens of this model's vocabulary; give one")
    unk = getattr(model.tokenizer, "unk_token_id", None)
    if unk is not None and int(ids[0]) == unk and text != model.tokenizer.unk_token:
        raise ValueError(
            f"{text!r} is not in this model's vocabulary (the tokenizer maps it to {model.tokenizer.unk_token!r}); "
            "give a word the model has as one token"
        )
    return int(ids[0])


def parse_prompt(model: Any, spec: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor], str]:
    """'prompt|target|minus' (minus optional) -> (prompt, logit_target, label); target and minus must
    each be one token (a ValueError names the one that is not)."""
    pieces = spec.split("|")
    if len(pieces) not in (2, 3) or not pieces[0]:
        raise ValueError(f"prompt {spec!r}: write 'prompt|target' or 'prompt|target|minus'")
    try:
        target = single_token(model, pieces[1])
        minus = single_token(model, pieces[2]) if len(pieces) == 3 else None
    except ValueError as err:
        raise ValueError(f"prompt {spec!r}: {err}") from None
    label = f"{pieces[1]!r}" + (f" − {pieces[2]!r}" if minus is not None else "")
    return pieces[0], logit_target(target, minus), label

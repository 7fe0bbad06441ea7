"""Attribution graphs through a replacement model, as circuit-tracer and the Circuit Tracing paper build
them (Ameisen et al. 2025), with mxd-lens's layers (MxD experts or transcoder latents) as the features.

**The local replacement model.** On one prompt, every attention pattern and every norm's scale is frozen
at its value on the prompt, and each block's MLP output is a constant split into *nodes*: the active
units of the block's layer (unit n at position t writes ``a_{t,n} · v_{t,n}``: a transcoder's decoder row,
an MxD expert's ``(z_t D) ⊙ c_n`` with the dense hidden z_t frozen), an *error node* (the MLP's output
minus the layer's, per block and position), and the layer's bias. A skip transcoder's ``x W_skip`` stays
a live linear path, like attention. What is not a node (the bias parameters, positional embeddings, a
layer's bias, a linearised logit soft-cap) is each target's ``bias``. Blocks with no layer, and the
positions before a layer's first trained one (BOS), are error nodes whole.

**Edges.** The model so frozen is linear in its nodes, so each target node's input is exactly the sum of
its in-edges and its bias: ``input = Σ_s A[target, s] + bias`` (``Graph.completeness_errors``). Targets
are the active units (input: the unit's gate/encoder pre-activation, ``x W_enc + b_enc``; MxD ``x G +
b_G``) and the top next-token logits at the last position (input: the logit minus the mean logit).
``A[target, s]`` = source value · ∂ target / ∂ source, computed with one batched backward per chunk of
targets. Nodes are ordered as circuit-tracer orders them: features, errors (block-major), tokens, logits.

**Pruning and scores** follow circuit-tracer's definitions (``prune``, ``scores``): influence through
the row-normalised |A|, logits weighted by their probabilities; the replacement score is the share of
the tokens' influence against the error nodes'; the completeness score the influence-weighted share of
each node's input that does not come from error nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mxd_lens import hook_names, hooks
from mxd_lens.attribution import (
    _check_tokens,
    _is_bias_source,
    _LogitHead,
    _raw_logits,
    contributions,
)


@dataclass
class Graph:
    """An attribution graph (see the module docstring). ``features``: a row per feature node (block,
    position, unit, activation); ``adjacency[target, source]``; ``inputs`` and ``bias`` per node (zero for
    error and token nodes, which have no in-edges)."""

    prompt: str
    tokens: list[int]
    strings: list[str]
    n_blocks: int
    features: Any  # pandas.DataFrame: block, position, unit, activation
    logit_tokens: list[int]
    logit_strings: list[str]
    logit_probabilities: torch.Tensor
    adjacency: torch.Tensor
    inputs: torch.Tensor
    bias: torch.Tensor
    spliced: list[int] = field(default_factory=list)  # the blocks with a layer

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    @property
    def n_features(self) -> int:
        return len(self.features)

    @property
    def n_errors(self) -> int:
        return self.n_blocks * self.n_pos

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    @property
    def n_nodes(self) -> int:
        return self.n_features + self.n_errors + self.n_pos + self.n_logits

    def logit_weights(self) -> torch.Tensor:
        weights = torch.zeros(self.n_nodes, dtype=self.adjacency.dtype)
        weights[-self.n_logits :] = self.logit_probabilities.to(weights.dtype)
        return weights

    def completeness_errors(self) -> torch.Tensor:
        """Per target node (features, logits), |Σ in-edges + bias − input| / max(|input|, 1): ~0 up to
        float error, since the frozen model is linear in its nodes."""
        rows = torch.cat(
            [torch.arange(self.n_features), torch.arange(self.n_nodes - self.n_logits, self.n_nodes)]
        )
        total = self.adjacency[rows].sum(1) + self.bias[rows]
        return (total - self.inputs[rows]).abs() / self.inputs[rows].abs().clamp_min(1.0)


def _graph_layers(model: Any, layers: Any) -> dict[int, Any]:
    placed = hooks.by_block(layers, model)
    for block, layer in placed.items():
        hooks.check_block(model, block)
        rep = hooks.replacement(layer)
        hooks.check_model_name(model, rep)
        rep.check_fits(model, block)
    return placed


def _skip_map(layer: Any) -> torch.Tensor | None:
    """A skip transcoder's W_skip as [d_in, d_out] (x W_skip), else None."""
    w = getattr(layer, "W_skip", None)
    if w is None:
        return None
    d_in = layer.cfg.d_in
    return w if w.shape[0] == d_in else w.T


def _encoder_columns(rep: Any, x: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor, units: torch.Tensor,
                     block: int) -> torch.Tensor:  # fmt: skip
    """The gradient of each target unit's pre-activation at its layer's input, [targets, d_in]: its encoder
    column (by autograd at one input, in the layer's dtype). Valid where the pre-activations are affine in
    the input, ``x W + b``: checked on the prompt, each target's value against ``x_t · column + pre(0)``
    (``x`` [T, d_in] the prompt's inputs, ``pre`` [T, d_sae] their pre-activations); a layer whose encoder is
    not affine has no such graph."""
    distinct, back = torch.unique(units, return_inverse=True)
    with torch.enable_grad():
        point = x[-1:].detach().clone().requires_grad_(True)  # any input would do for an affine map
        at_point = rep.pre_activations(point)[0]
        seed = torch.zeros(len(distinct), at_point.shape[-1], dtype=at_point.dtype)
        seed[torch.arange(len(distinct)), distinct] = 1
        (columns,) = torch.autograd.grad(at_point, point, grad_outputs=seed, is_grads_batched=True)
    columns = columns[:, 0][back]  # [targets, d_in]
    with torch.no_grad():
        offset = at_point.float()[units] - (point[0].float() * columns.float()).sum(-1)  # pre(0), if affine
        terms = x[positions].float() * columns.float()
        gap = (terms.sum(-1) + offset - pre[positions, units].float()).abs()
        size = terms.abs().sum(-1) + offset.abs()  # the magnitude of what is summed
    eps = torch.finfo(x.dtype).eps if x.dtype in (torch.float16, torch.bfloat16) else 0.0
    ok = gap <= (1e-4 + 8 * eps) * size.clamp_min(1.0)  # (NaN is not ok)
    if not bool(ok.all()):
        worst = int(torch.nonzero(~ok)[0])
        raise ValueError(
            f"block {block}: the layer's pre-activations are not affine in its input (at position "
            f"{int(positions[worst])}, unit {int(units[worst])}, x W + b misses the pre-activation by "
            f"{float(gap[worst]):.2e} of {float(size[worst]):.2e}); attribution graphs need an encoder that is "
            "x W_enc + b_enc"
        )
    return columns


def top_logits(probs: torch.Tensor, max_logits: int = 10, desired_prob: float = 0.95) -> list[int]:
    """The most probable next tokens, fewest whose probabilities reach ``desired_prob``, at most
    ``max_logits`` (circuit-tracer's defaults)."""
    ordered = torch.argsort(probs, descending=True)
    cumulative = probs[ordered].cumsum(0)
    n = int(torch.searchsorted(cumulative, torch.tensor(desired_prob, dtype=cumulative.dtype)).item()) + 1
    return ordered[: max(1, min(n, max_logits))].tolist()


def build_graph(
    model: Any,
    layers: Any,
    prompt: Any,
    max_logits: int = 10,
    desired_logit_prob: float = 0.95,
    chunk: int = 128,
) -> Graph:
    """The attribution graph of ``prompt`` (a string or [1, positions] token ids) through ``layers`` (one per
    block, a mapping or a list; the other blocks' MLPs are error nodes) in ``model``: see the module
    docstring. ``chunk`` targets share one batched backward."""
    import pandas as pd

    placed = _graph_layers(model, layers)
    tokens = _check_tokens(model, prompt)
    n_pos, n_blocks = tokens.shape[1], model.cfg.n_layers
    reps = {b: hooks.replacement(layer) for b, layer in placed.items()}
    writes = {b: reps[b].writes if b in reps else "hook_mlp_out" for b in range(n_blocks)}
    at_module = [b for b in range(n_blocks) if writes[b] == "mlp"]
    resid = hooks.resid_blocks(list(reps.values()))

    # the clean run: patterns, scales, each block's MLP input and output as the layers see them
    with (
        torch.no_grad(),
        hooks.capture_mlp_io(model, list(range(n_blocks)), resid=resid, module_out=at_module) as io,
        _raw_logits(model) as cap,
    ):
        raw, cache = model.run_with_cache(tokens, names_filter=hook_names.is_pattern_or_scale)
    head = _LogitHead.at(raw, cap)
    out_key = {b: "module_out" if writes[b] == "mlp" else "out" for b in range(n_blocks)}

    # node values per block: the units' vectors, the layer's bias, the error (all of it where no layer is)
    split, error, bias_out, skips, skip_clean = {}, {}, {}, {}, {}
    feature_rows = []
    for block in range(n_blocks):
        written = io[block][out_key[block]][0].detach()
        if block not in placed:
            error[block] = written
            continue
        x = hooks.layer_input(io, reps[block])[0]
        parts = contributions(placed[block], x)
        skip = _skip_map(placed[block])
        first = min(reps[block].first, n_pos)
        # before its first trained position (BOS) the splice keeps the MLP: all of it an error node there
        mask = (torch.arange(n_pos) >= first).to(written.dtype)[:, None]
        skips[block] = (skip, mask) if skip is not None else None
        skipped = x @ skip * mask if skip is not None else torch.zeros_like(written)
        err = written - parts.total()
        err[:first] = written[:first]
        parts.vectors = parts.vectors * mask[:, :, None]
        b_out = (parts.rest - skipped) * mask  # what the layer writes with no unit on, skip path aside
        error[block], split[block], bias_out[block] = err, parts, b_out
        skip_clean[block] = skipped
        for t in range(first, n_pos):
            for j in range(parts.indices.shape[1]):
                if parts.values[t, j] != 0:
                    feature_rows.append((block, t, int(parts.indices[t, j]), float(parts.values[t, j]), j))
    features = pd.DataFrame(feature_rows, columns=["block", "position", "unit", "activation", "slot"])

    # the frozen model with its nodes as leaves
    leaves: dict[str, torch.Tensor] = {}
    live_x: dict[int, torch.Tensor] = {}
    constant = {
        b: (error[b] + (split[b].vectors.sum(1) + bias_out[b] if b in split else 0)).detach()
        for b in range(n_blocks)
    }

    def freeze(value: torch.Tensor, hook: Any) -> torch.Tensor:
        return cache[hook.name].detach()

    def embed_leaf(value: torch.Tensor, hook: Any) -> torch.Tensor:
        source = value.detach().clone().requires_grad_(True)
        leaves[hook.name] = source
        return source

    def node(block: int):
        def replace(out: torch.Tensor) -> torch.Tensor:
            source = constant[block][None].clone().requires_grad_(True)
            leaves[f"node.{block}"] = source
            if skips.get(block) is not None:  # the skip path stays live, like attention
                skip, mask = skips[block]
                return source + live_x[block] @ skip * mask
            return source

        return replace

    handles = []
    for block, rep in reps.items():  # each layer's live input: its pre-activations and skip path read it
        module = hooks.read_module(model, block, rep.reads)
        handles.append(
            module.register_forward_pre_hook(lambda m, args, b=block: live_x.__setitem__(b, args[0]))
        )
    biases = {name: p for name, p in model.named_parameters() if _is_bias_source(name)}
    fwd_hooks = [
        (hook_names.is_pattern_or_scale, freeze),
        (lambda name: name in hook_names.EMBED_HOOKS.values(), embed_leaf),
    ]
    try:
        with torch.enable_grad(), hooks.replacing_outputs(model, {(b, writes[b]): node(b) for b in range(n_blocks)}), _raw_logits(model):  # fmt: skip
            logits = head(model.run_with_hooks(tokens, fwd_hooks=fwd_hooks))[0, -1]
            pre = {b: reps[b].pre_activations(live_x[b][0]) for b in reps}
    finally:
        for handle in handles:
            handle.remove()
    probs = torch.softmax(logits.detach().float(), -1)
    chosen = top_logits(probs, max_logits, desired_logit_prob)
    demeaned = logits - logits.mean()
    # targets in groups that share a depth (each block's units, then the logits), so that a group's backward
    # runs only through the blocks below it, and only to the leaves there
    depth = features["block"].to_list() + [n_blocks] * len(chosen)
    groups = [i for i in range(len(depth) + 1) if i in (0, len(depth)) or depth[i] != depth[i - 1]]
    position_at = torch.tensor(features["position"].to_list(), dtype=torch.long)
    unit_at = torch.tensor(features["unit"].to_list(), dtype=torch.long)
    columns = {}  # each unit target's encoder column, in feature order per block
    for start, end in zip(groups[:-1], groups[1:], strict=True):
        if start < len(features):
            b = depth[start]
            columns[b] = _encoder_columns(reps[b], live_x[b][0].detach(), pre[b].detach(), position_at[start:end],
                                          unit_at[start:end], b)  # fmt: skip
    group_targets = [
        pre[depth[start]][position_at[start:end], unit_at[start:end]]
        if start < len(features)
        else demeaned[chosen]
        for start, end in zip(groups[:-1], groups[1:], strict=True)
    ]

    # one batched backward per chunk of targets: the gradient of each target at every leaf below it. A unit's
    # input is affine in its layer's input (checked above), so its backward starts there, seeded with the
    # encoder's column: no backward through the encoder's d_sae columns per target.
    n_f, n_err = len(features), n_blocks * n_pos
    n_nodes = n_f + n_err + n_pos + len(chosen)
    adjacency = torch.zeros(n_nodes, n_nodes)
    bias = torch.zeros(n_nodes)
    embed = leaves[hook_names.EMBED_HOOKS["embed"]]
    embed_value = embed[0].detach().float()
    nodes = [leaves[f"node.{b}"] for b in range(n_blocks)]
    extra = [n for n in leaves if n != hook_names.EMBED_HOOKS["embed"] and not n.startswith("node.")]
    constants = [leaves[n] for n in extra] + list(biases.values())  # positional embedding, bias parameters
    feature_cols = {b: torch.full((n_pos, split[b].indices.shape[1]), -1, dtype=torch.long) for b in split}
    for col, (b, t, j) in enumerate(
        zip(features["block"], features["position"], features["slot"], strict=True)
    ):
        feature_cols[b][t, j] = col
    rows = list(range(n_f)) + list(range(n_nodes - len(chosen), n_nodes))
    spans = [
        (lo, min(lo + chunk, end), start, end, group)
        for group, (start, end) in enumerate(zip(groups[:-1], groups[1:], strict=True))
        for lo in range(start, end, chunk)
    ]
    for lo, hi, start, end, group in spans:
        size, below = hi - lo, depth[start]
        if below < n_blocks:  # units of block `below`: seed its layer's input with their encoder columns
            outputs = live_x[below]
            seed = torch.zeros(size, *outputs.shape, dtype=outputs.dtype)
            seed[torch.arange(size), 0, position_at[lo:hi]] = columns[below][lo - start : hi - start]
        else:
            outputs = group_targets[group]
            seed = torch.zeros(size, end - start, dtype=outputs.dtype)
            seed[torch.arange(size), torch.arange(lo - start, hi - start)] = 1
        inputs = [embed, *nodes[:below], *constants]
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=seed, retain_graph=True,
                                    is_grads_batched=True, allow_unused=True)  # fmt: skip
        grads = [None if g is None else g.float() for g in grads]  # edges in float32 (a half model's too)
        target_rows = torch.tensor(rows[lo:hi])
        if grads[0] is not None:
            adjacency[target_rows, n_f + n_err : n_f + n_err + n_pos] = (embed_value * grads[0][:, 0]).sum(-1)
        row_bias = torch.zeros(size)
        for b in range(below):
            g = grads[1 + b]
            if g is None:  # nothing from this block reaches the targets
                continue
            g = g[:, 0]  # [C, T, d]
            adjacency[target_rows, n_f + b * n_pos : n_f + (b + 1) * n_pos] = (error[b].float() * g).sum(-1)
            if b in split:
                weights = torch.einsum("tkd,ctd->ctk", split[b].vectors.float(), g)
                cols = feature_cols[b]
                kept = cols >= 0
                adjacency[target_rows[:, None], cols[kept][None]] = weights[:, kept]
                row_bias += (bias_out[b].float() * g).sum((-1, -2))
        for value, g in zip(constants, grads[1 + below :], strict=True):
            if g is not None:
                row_bias += (value.detach().float() * g).flatten(1).sum(1)
        bias[target_rows] = row_bias
    if head.offset is not None:  # a linearised soft-cap's offset: part of each logit target's bias
        off = head.offset[0, -1]
        offset_demeaned = off - off.mean()
        for i, y in enumerate(chosen):
            bias[n_nodes - len(chosen) + i] += float(offset_demeaned[y])
    with torch.no_grad():  # a unit's input has its own constant: the encoder's / gate's bias (pre at x = 0)
        for b, rep in reps.items():
            own = rep.pre_activations(torch.zeros(1, live_x[b].shape[-1], dtype=live_x[b].dtype))[0]
            at = torch.nonzero(torch.tensor(features["block"].to_numpy() == b)).flatten()
            bias[at] += own[torch.tensor(features["unit"].to_numpy()[at.numpy()])].float()
    node_inputs = torch.zeros(n_nodes)
    node_inputs[torch.tensor(rows)] = torch.cat(group_targets).detach().float()
    strings = (
        model.to_str_tokens(tokens[0])
        if getattr(model, "tokenizer", None) is not None
        else tokens[0].tolist()
    )
    logit_strings = [model.tokenizer.decode([y]) if getattr(model, "tokenizer", None) is not None else str(y) for y in chosen]  # fmt: skip
    text = prompt if isinstance(prompt, str) else "".join(map(str, strings))
    return Graph(
        prompt=text, tokens=tokens[0].tolist(), strings=[str(s) for s in strings], n_blocks=n_blocks,
        features=features.drop(columns="slot"), logit_tokens=chosen, logit_strings=logit_strings,
        logit_probabilities=probs[chosen], adjacency=adjacency.detach(), inputs=node_inputs.detach(), bias=bias.detach(),
        spliced=sorted(placed),
    )  # fmt: skip


# -- influence, pruning and scores (circuit-tracer's definitions) ------------------------------------


def normalized(adjacency: torch.Tensor) -> torch.Tensor:
    """|A| with each row (a target's in-edges) summing to 1 (rows with no in-edges stay zero)."""
    a = adjacency.abs()
    return a / a.sum(1, keepdim=True).clamp_min(1e-10)


def influence(adjacency: torch.Tensor, weights: torch.Tensor, max_iter: int = 1000) -> torch.Tensor:
    """``weights @ (A + A² + ...)`` for the row-normalised A: each node's total influence on the weighted
    targets, over paths of every length (the graph is acyclic, so the series ends)."""
    a = normalized(adjacency)
    current = weights @ a
    total = current.clone()
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ a
        total += current
    raise RuntimeError(f"influence did not converge in {max_iter} steps: the graph has a cycle?")


def _cut(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the largest scores carry ``fraction`` of their sum."""
    if not scores.numel():
        return torch.zeros((), dtype=scores.dtype)
    ordered = torch.sort(scores.flatten(), descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum().clamp_min(1e-30)
    index = int(torch.searchsorted(cumulative, torch.tensor(fraction, dtype=cumulative.dtype)).item())
    index = min(index, max(int((ordered > 0).sum()) - 1, 0))
    return ordered[index]


@dataclass
class Pruned:
    nodes: torch.Tensor  # [N] bool
    edges: torch.Tensor  # [N, N] bool
    cumulative: torch.Tensor  # [N] each node's place in the cumulative influence (0..1)


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """Keep the nodes carrying ``node_threshold`` of the influence on the logits, then the edges carrying
    ``edge_threshold`` of the influence among them; feature and error nodes left without an out-edge (and
    features without an in-edge) go too, until nothing changes. Tokens and logits always stay."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    n_keep_always = graph.n_pos + graph.n_logits
    weights = graph.logit_weights()
    node_influence = influence(graph.adjacency, weights)
    nodes = node_influence >= _cut(node_influence, node_threshold)
    nodes[-n_keep_always:] = True
    pruned = graph.adjacency.clone()
    pruned[~nodes] = 0
    pruned[:, ~nodes] = 0
    a = normalized(pruned)
    edge_scores = a * (influence(pruned, weights) + weights)[:, None]
    edges = edge_scores >= _cut(edge_scores[edge_scores > 0], edge_threshold)  # (zeros move no cut; a sort of
    # every entry of a 14k-node graph's [N, N] scores would take seconds and GBs)
    edges &= pruned != 0
    while True:
        before = nodes.clone()
        nodes[:-n_keep_always] &= edges[:, :-n_keep_always].any(0)
        nodes[: graph.n_features] &= edges[: graph.n_features].any(1)
        edges[~nodes] = False
        edges[:, ~nodes] = False
        if torch.equal(before, nodes):
            break
    order = torch.argsort(node_influence, descending=True)
    cumulative = torch.zeros_like(node_influence)
    cumulative[order] = node_influence[order].cumsum(0) / node_influence.sum().clamp_min(1e-30)
    return Pruned(nodes, edges, cumulative)


def scores(graph: Graph) -> dict[str, float]:
    """circuit-tracer's graph scores: ``replacement`` (the tokens' share of the influence on the logits,
    against the error nodes'), ``completeness`` (per node, the share of its normalised input not from
    error nodes, weighted by its influence on the logits plus its own logit weight), and ``nodes_80``:
    the feature and error nodes that carry 80% of the influence (the node-pruning cut at 0.8)."""
    weights = graph.logit_weights()
    a = normalized(graph.adjacency)
    node_influence = influence(graph.adjacency, weights)
    e0, e1 = graph.n_features, graph.n_features + graph.n_errors
    token = node_influence[e1 : e1 + graph.n_pos].sum()
    err = node_influence[e0:e1].sum()
    non_error = 1 - a[:, e0:e1].sum(1)
    output = node_influence + weights
    inner = node_influence[:e1]
    kept = int((inner >= _cut(node_influence, 0.8)).sum()) if inner.any() else 0
    return {
        "replacement": float(token / (token + err).clamp_min(1e-30)),
        "completeness": float((non_error * output).sum() / output.sum()),
        "nodes_80": kept,
        "features": graph.n_features,
        "error_nodes": graph.n_errors,
        "max_completeness_error": float(graph.completeness_errors().max()),
    }

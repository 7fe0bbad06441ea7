"""The one place that knows where each decomposable weight of a TransformerLens model reads and writes.

A weight is named ``blocks.L.attn.W_Q`` (``W_K``, ``W_V``, ``W_O``) or ``blocks.L.mlp.W_in`` (``W_gate``,
``W_out``) and seen as one matrix W ∈ R^{d_out×d_in} over all heads. Code keeps its transpose
``weight`` = Wᵀ ∈ R^{d_in×d_out}, the layout of ``x @ weight`` and of V U.

| weight | input x (read)                                   | output y = x Wᵀ + b (replaced)              |
|--------|--------------------------------------------------|---------------------------------------------|
| W_Q    | ``query_input`` kwarg of ``blocks.L.attn``        | ``blocks.L.attn.hook_q`` [b, p, heads, d_head] |
| W_K    | ``key_input`` (GQA: the n_key_value_heads weight) | ``blocks.L.attn.hook_k``                     |
| W_V    | ``value_input``                                   | ``blocks.L.attn.hook_v``                     |
| W_O    | ``blocks.L.attn.hook_z``, heads flattened         | ``blocks.L.hook_attn_out``                   |
| W_in   | input of ``blocks.L.mlp``                         | ``blocks.L.mlp.hook_pre`` (gated: ``hook_pre_linear``, no bias) |
| W_gate | input of ``blocks.L.mlp``                         | ``blocks.L.mlp.hook_pre`` (no bias)          |
| W_out  | ``blocks.L.mlp.hook_post``                        | ``blocks.L.hook_mlp_out``                    |

The attention inputs are read with a forward pre-hook on the attention module, so they are exactly what
the projections see: after ln1, and with the Shortformer position embedding already added to Q and K.
Rotary embeddings act after ``hook_q``/``hook_k``, so they stay outside the decomposed map.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mxd_lens import hook_names

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

ATTN_KINDS = ("W_Q", "W_K", "W_V", "W_O")
MLP_KINDS = ("W_in", "W_gate", "W_out")
_NAME = re.compile(r"^blocks\.(\d+)\.(attn|mlp)\.(\w+)$")
_ATTN_INPUTS = {"W_Q": ("query_input", 0), "W_K": ("key_input", 1), "W_V": ("value_input", 2)}


@dataclass(frozen=True)
class Site:
    """Where one weight reads its input and writes its output."""

    name: str
    layer: int
    kind: str
    d_in: int
    d_out: int
    writes: str  # the hook point whose value is y = x Wᵀ + b


def decomposable_weights(model: HookedTransformer) -> list[str]:
    """Every weight name of ``model`` that a ``Decomposition`` can take, block by block."""
    names = []
    for layer in range(model.cfg.n_layers):
        for kind in ATTN_KINDS:
            names.append(f"blocks.{layer}.attn.{kind}")
        for kind in MLP_KINDS:
            names.append(f"blocks.{layer}.mlp.{kind}")
    return [name for name in names if _unsupported(model, name) is None]


def resolve(model: HookedTransformer, name: str) -> Site:
    """The ``Site`` of weight ``name``; a ``ValueError`` naming the valid names if there is none."""
    reason = _unsupported(model, name)
    if reason is not None:
        valid = decomposable_weights(model)
        suffixes = list(dict.fromkeys(n.split(".", 2)[2] for n in valid))
        raise ValueError(
            f"cannot decompose {name!r}: {reason}. Valid names are blocks.L.{{{', '.join(suffixes)}}} "
            f"for L in 0..{model.cfg.n_layers - 1} (see mxd_lens.spd.decomposable_weights(model))"
        )
    layer, _, kind = _parse(name)
    weight, _ = read_weight(model, name)
    if kind in ("W_Q", "W_K", "W_V"):
        writes = hook_names.attn_hook(layer, kind[-1].lower())
    else:
        writes = {
            "W_O": hook_names.attn_out_hook(layer),
            "W_gate": hook_names.mlp_pre_hook(layer),
            "W_in": hook_names.mlp_pre_hook(layer, linear=model.cfg.gated_mlp),
            "W_out": hook_names.mlp_out_hook(layer),
        }[kind]
    return Site(name, layer, kind, weight.shape[0], weight.shape[1], writes)


@torch.no_grad()
def read_weight(model: HookedTransformer, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Wᵀ as [d_in, d_out], bias as [d_out] or None where the hooked output has none), detached;
    views of the model's parameters where the layout allows."""
    layer, part, kind = _parse(name)
    block = model.blocks[layer]
    if part == "attn":
        attn = block.attn
        if kind == "W_O":
            n_heads, d_head, d_model = attn.W_O.shape
            return attn.W_O.detach().reshape(n_heads * d_head, d_model), attn.b_O.detach()
        return _qkv_weight(model, attn, kind)
    mlp = block.mlp
    weight = getattr(mlp, kind).detach()
    if kind == "W_out":
        return weight, mlp.b_out.detach()
    if kind == "W_gate" or model.cfg.gated_mlp:  # GatedMLP adds b_in after the gate product
        return weight, None
    return weight, mlp.b_in.detach()


def input_reader(
    model: HookedTransformer, site: Site, store: Callable[[torch.Tensor], None]
) -> tuple[nn.Module | None, Callable, str | None]:
    """How to see ``site``'s input: returns (module, pre_hook, None) for a forward pre-hook (with kwargs)
    or (None, hook_fn, hook_name) for a TransformerLens hook. ``store`` receives x as [b, p, d_in]."""
    block = model.blocks[site.layer]
    if site.kind in _ATTN_INPUTS:
        key, index = _ATTN_INPUTS[site.kind]

        def attn_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            store(kwargs[key] if key in kwargs else args[index])

        return block.attn, attn_pre_hook, None
    if site.kind in ("W_in", "W_gate"):

        def mlp_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            store(args[0] if args else kwargs["x"])

        return block.mlp, mlp_pre_hook, None
    hook_name = (
        hook_names.attn_hook(site.layer, "z") if site.kind == "W_O" else hook_names.mlp_post_hook(site.layer)
    )

    def tl_hook(value: torch.Tensor, hook: object) -> None:
        store(value.flatten(2))  # hook_z: [b, p, heads, d_head] -> [b, p, heads * d_head]

    return None, tl_hook, hook_name


def _parse(name: str) -> tuple[int, str, str]:
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"{name!r} is not a weight name like 'blocks.0.attn.W_Q' or 'blocks.0.mlp.W_in'")
    return int(match.group(1)), match.group(2), match.group(3)


def _unsupported(model: HookedTransformer, name: str) -> str | None:
    """Why ``name`` cannot be decomposed in ``model``, or None if it can."""
    from transformer_lens.components import MLP, GatedMLP
    from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

    try:
        layer, part, kind = _parse(name)
    except ValueError as err:
        return str(err)
    cfg = model.cfg
    if not 0 <= layer < cfg.n_layers:
        return f"there is no block {layer}"
    writes_residual = kind in ("W_O", "W_out")
    post_norm = cfg.use_normalization_before_and_after or cfg.original_architecture in POST_NORM_ARCHITECTURES
    if part == "attn":
        if kind not in ATTN_KINDS:
            return f"attention weights are {', '.join(ATTN_KINDS)}"
        if cfg.use_split_qkv_input or cfg.use_attn_in:
            return "use_split_qkv_input/use_attn_in give every head its own input; turn them off"
        if cfg.load_in_4bit:
            return "4-bit weights cannot be decomposed"
    else:
        if kind not in MLP_KINDS:
            return f"MLP weights are {', '.join(MLP_KINDS)}"
        if cfg.attn_only or not hasattr(model.blocks[layer], "mlp"):
            return "the model is attention-only"
        if type(model.blocks[layer].mlp) not in (MLP, GatedMLP):
            return (
                f"block {layer}'s MLP is a {type(model.blocks[layer].mlp).__name__}, not a dense (gated) MLP"
            )
        if kind == "W_gate" and not cfg.gated_mlp:
            return "the MLP is not gated"
    if writes_residual and post_norm:
        return "the block normalises this output before its hook, so the hook does not see x Wᵀ + b"
    return None


def _qkv_weight(model: HookedTransformer, attn: nn.Module, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Q/K/V as [d_model, heads * d_head]; with grouped-query attention K and V have the key-value heads
    that ``hook_k``/``hook_v`` carry."""
    grouped = model.cfg.n_key_value_heads is not None and not model.cfg.ungroup_grouped_query_attention
    if kind != "W_Q" and grouped:
        W, b = getattr(attn, f"_{kind}"), getattr(attn, f"_b_{kind[-1]}")
    else:
        W, b = getattr(attn, kind), getattr(attn, f"b_{kind[-1]}")
    n_heads, d_model, d_head = W.shape
    return W.detach().permute(1, 0, 2).reshape(d_model, n_heads * d_head), b.detach().reshape(-1)

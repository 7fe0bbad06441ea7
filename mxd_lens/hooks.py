"""Where block L's MLP reads and writes (the hook names a layer's metadata records), and splicing.

Where a layer reads: the exact input of ``blocks.L.mlp`` (after ln2 and its affine weights). SAELens's
``HookedSAETransformer`` names it ``blocks.L.mlp.hook_in``, which is what a layer's metadata records.
A plain ``HookedTransformer`` has no such hook (``ln2.hook_normalized`` is pre-affine unless LayerNorm
is folded; ``hook_mlp_in`` is before ln2), so we read the MLP module's own input with a forward
pre-hook: exact with LN folded or not, for sequential and parallel (Pythia, GPT-J) blocks alike.

Where a layer writes: ``blocks.L.hook_mlp_out``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

if TYPE_CHECKING:
    from sae_lens.saes.sae import SAEMetadata
    from transformer_lens import HookedTransformer

    from mxd_lens.layers.base import MLPReplacement

_OUT_HOOK = re.compile(r"^blocks\.(\d+)\.hook_mlp_out$")
# model -> {block: layer} for the splices active on it (what steering checks)
_SPLICED: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def mlp_in_hook(block: int) -> str:
    return f"blocks.{block}.mlp.hook_in"


def mlp_out_hook(block: int) -> str:
    return f"blocks.{block}.hook_mlp_out"


def check_block(model: HookedTransformer, block: int) -> None:
    """Raise a clear error unless block ``block`` of ``model`` exists and has an MLP."""
    n_layers = model.cfg.n_layers
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < n_layers:
        raise ValueError(
            f"block {block!r} does not exist: {model.cfg.model_name} has blocks 0..{n_layers - 1}"
        )
    if model.cfg.attn_only or not hasattr(model.blocks[block], "mlp"):
        raise ValueError(f"{model.cfg.model_name} is attention-only: block {block} has no MLP to replace")


def mlp_module(model: HookedTransformer, block: int) -> nn.Module:
    check_block(model, block)
    return model.blocks[block].mlp


def dense_mlp(model: HookedTransformer, block: int) -> nn.Module:
    """Block ``block``'s MLP when ``hook_mlp_out`` is exactly ``W_out act(...) + b_out`` of a plain
    or gated MLP (what ``MxD.from_mlp`` can copy); a clear error otherwise."""
    from transformer_lens.components import MLP, GatedMLP

    mlp = mlp_module(model, block)
    if not isinstance(mlp, (MLP, GatedMLP)):
        raise ValueError(
            f"block {block}'s MLP is a {type(mlp).__name__}; only MLP and GatedMLP can be copied"
        )
    if model.cfg.use_normalization_before_and_after or model.cfg.original_architecture in (
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
    ):
        raise ValueError(
            f"{model.cfg.model_name} normalises the MLP output before hook_mlp_out; an MxD cannot copy "
            "that MLP exactly (it can still be trained on it)"
        )
    if model.cfg.is_layer_norm_activation():
        raise ValueError(f"act_fn={model.cfg.act_fn!r} has a LayerNorm inside the MLP; not supported")
    return mlp


def layer_metadata(model: HookedTransformer, block: int) -> SAEMetadata:
    """SAELens metadata for a layer that replaces block ``block``'s MLP of ``model``."""
    from sae_lens.saes.sae import SAEMetadata

    check_block(model, block)
    return SAEMetadata(
        model_name=model.cfg.model_name,
        model_class_name=type(model).__name__,
        hook_name=mlp_in_hook(block),
        hook_name_out=mlp_out_hook(block),
        hook_layer=block,
    )


def block_of(layer: MLPReplacement[Any]) -> int:
    """Which block a layer replaces, read from ``cfg.metadata.hook_name_out``."""
    hook = layer.cfg.metadata.hook_name_out
    match = _OUT_HOOK.match(hook or "")
    if match is None:
        raise ValueError(
            f"{type(layer).__name__} has metadata.hook_name_out={hook!r}, not 'blocks.L.hook_mlp_out': "
            "build it with .for_model(model, block, ...) / MxD.from_mlp, or set "
            "layer.cfg.metadata = mxd_lens.hooks.layer_metadata(model, block)"
        )
    return int(match.group(1))


def check_fits(model: HookedTransformer, layer: MLPReplacement[Any], block: int) -> None:
    """Raise unless ``layer`` was made for block ``block`` of a model like ``model``: same widths, and
    the same ``model_name`` when the layer records one."""
    check_block(model, block)
    trained_on = layer.cfg.metadata.model_name
    if trained_on and trained_on != model.cfg.model_name:
        # One model loaded from another source (a .gguf and its Hugging Face folder) has another name
        # but the same architecture: the recorded shape decides, when the layer has one.
        from mxd_lens.records import TrainingRecord, model_shape

        recorded = TrainingRecord.of(layer).model_source.get("shape")
        if recorded is None or recorded != model_shape(model):
            why = (
                "and records no model shape to compare"
                if recorded is None
                else f"and its recorded shape {recorded} differs from this model's {model_shape(model)}"
            )
            raise ValueError(
                f"{type(layer).__name__} was trained on {trained_on!r}, but this model is {model.cfg.model_name!r} "
                f"{why}; set layer.cfg.metadata.model_name if they are the same model under another name"
            )
    d_model = model.cfg.d_model
    if layer.cfg.d_in != d_model or layer.cfg.d_out != d_model:
        raise ValueError(
            f"{type(layer).__name__} maps {layer.cfg.d_in} -> {layer.cfg.d_out} but "
            f"{model.cfg.model_name}'s MLPs map {d_model} -> {d_model}: it was built for another model"
        )


@contextmanager
def capture_mlp_io(
    model: HookedTransformer, blocks: Sequence[int]
) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Record (MLP input, hook_mlp_out) of each block in ``blocks`` during forwards inside the block:
    ``with capture_mlp_io(model, [3]) as io: model(tokens)`` then ``io[3]["in"], io[3]["out"]``."""
    io: dict[int, dict[str, torch.Tensor]] = {block: {} for block in blocks}
    handles = []
    fwd_hooks = []
    try:
        for block in blocks:
            slot = io[block]
            handles.append(mlp_module(model, block).register_forward_pre_hook(_store_input(slot)))

            def store_out(out: torch.Tensor, hook: Any, slot: dict[str, torch.Tensor] = slot) -> None:
                slot["out"] = out

            fwd_hooks.append((mlp_out_hook(block), store_out))
        with model.hooks(fwd_hooks=fwd_hooks):
            yield io
    finally:
        for handle in handles:
            handle.remove()


def _store_input(slot: dict[str, torch.Tensor]):
    def pre_hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        slot["in"] = args[0]

    return pre_hook


@contextmanager
def splice(
    model: HookedTransformer, *layers: MLPReplacement[Any], error_term: bool = False
) -> Iterator[HookedTransformer]:
    """Run ``model`` with each layer's output in place of its block's ``hook_mlp_out``.

    Each layer reads the exact input of the MLP it replaces and later blocks see its output. With
    ``error_term=True`` the residual ``mlp_out - layer(x)`` (detached) is added back, so logits are
    the clean ones while gradients and code edits flow through the layer. Hooks are removed on exit,
    also when the block raises.
    """
    placed: dict[int, MLPReplacement[Any]] = {}
    for layer in layers:
        index = block_of(layer)
        if index in placed or index in _SPLICED.get(model, {}):
            raise ValueError(f"two layers target block {index}'s MLP; splice at most one per block")
        check_fits(model, layer, index)
        if not isinstance(model.hook_dict.get(mlp_out_hook(index)), HookPoint):
            raise ValueError(
                f"{mlp_out_hook(index)} is not a plain HookPoint (an SAE is attached there?): "
                "call model.reset_saes() first"
            )
        placed[index] = layer

    handles = []
    fwd_hooks = []
    try:
        for index, layer in placed.items():
            slot: dict[str, torch.Tensor] = {}
            handles.append(mlp_module(model, index).register_forward_pre_hook(_store_input(slot)))
            fwd_hooks.append((mlp_out_hook(index), _replace_output(layer, slot, error_term)))
        active = _SPLICED.setdefault(model, {})
        active.update(placed)
        with model.hooks(fwd_hooks=fwd_hooks):
            yield model
    finally:
        for handle in handles:
            handle.remove()
        for index in placed:
            _SPLICED.get(model, {}).pop(index, None)


def spliced_layers(model: HookedTransformer) -> dict[int, MLPReplacement[Any]]:
    """The layers spliced into ``model`` right now, by block (inside ``splice`` contexts)."""
    return dict(_SPLICED.get(model, {}))


def _replace_output(layer: MLPReplacement[Any], slot: dict[str, torch.Tensor], error_term: bool):
    def hook(mlp_out: torch.Tensor, hook: Any) -> torch.Tensor:
        x = slot.pop("in")
        out = layer(x).to(mlp_out.dtype)
        if error_term:
            with torch.no_grad():
                clean = layer._forward_fast(x).to(mlp_out.dtype) if layer._code_hooks_active() else out
                error = mlp_out - clean
            out = out + error
        return out

    return hook

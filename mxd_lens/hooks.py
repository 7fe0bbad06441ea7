"""Where block L's MLP reads and writes (the hook names a layer's metadata records), and splicing.

Where a layer reads: the exact input of ``blocks.L.mlp`` (after ln2 and its affine weights). SAELens's
``HookedSAETransformer`` names it ``blocks.L.mlp.hook_in``, which is what a layer's metadata records.
A plain ``HookedTransformer`` has no such hook (``ln2.hook_normalized`` is pre-affine unless LayerNorm
is folded; ``hook_mlp_in`` is before ln2), so we read the MLP module's own input with a forward
pre-hook: exact with LN folded or not, for sequential and parallel (Pythia, GPT-J) blocks alike.

Where a layer writes (its ``metadata.hook_name_out``, a :data:`Writes`):

- ``blocks.L.hook_mlp_out`` ("hook_mlp_out"): the block's MLP output as the residual stream receives it.
  In a plain pre-norm block that is the MLP module's output itself.
- ``blocks.L.mlp.hook_out`` ("mlp"): the MLP module's own output, the name TransformerLens's
  ``TransformerBridge`` and circuit-tracer give it (the bridge too points a Gemma-2/3 block's
  ``hook_mlp_out`` at the norm after the MLP, ``ln2_post.hook_out``). Gemma-2/3 (``cfg.use_normalization_before_and_after``)
  and OLMo-2/3 (``POST_NORM_ARCHITECTURES``) blocks normalise the MLP's output before ``hook_mlp_out``
  (``hook_mlp_out = ln2_post(MLP(x))``; OLMo: ``ln2(MLP(x))``); a layer writing here replaces the MLP
  module, and the host's norm still runs after it, as after the MLP. Only this is in MxD's function
  class on those hosts (``MxD.from_mlp`` copies the MLP exactly), so it is their default
  (:func:`default_writes`); other hosts keep ``hook_mlp_out``, where the two are the same tensor.

A layer saved before the second site existed records ``hook_mlp_out`` and loads unchanged, writing there.
A plain ``HookedTransformer`` has no ``mlp.hook_out``: :func:`splice` writes there with a forward hook on
the MLP module; ``mxd_lens.models.add_mlp_out_hooks`` adds the hook point for SAELens's
``HookedSAETransformer.add_sae`` (``load_model(..., cls=HookedSAETransformer)`` does it itself).

Which positions a splice replaces: those the layer trained on. The trainer leaves out position 0 of
every row when the model prepends BOS (``mxd_lens.activations``: there the residual stream is an
attention sink, far from every other token's), and records it as SAELens does, ``cfg.metadata.seqpos_slice
= [1, None]``; a splice then keeps the MLP's own output at position 0 and writes the layer's from
position 1 on (:func:`first_position`), as circuit-tracer zeroes features at position 0. Splicing the
untrained position too broke Gemma-3 (KL 1-2.6 nats at block 3 from FVU 0.07-0.15). Positions count
from the start of the row, also in ``model.generate`` with a key-value cache; rows padded on the left
are not handled (their BOS is not at position 0). ``seqpos_slice = [None]`` splices every position.

Layers from elsewhere (any SAELens ``SAE`` whose cfg says it reads an MLP's input and writes
``blocks.L.hook_mlp_out``: SAELens's transcoders, loaded with ``SAE.from_pretrained`` /
``SAE.load_from_disk``) splice and evaluate too: :func:`replacement` is the one place that tells them
from ours, and ``mxd_lens.foreign`` says where they read (their ``metadata.hook_name``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from mxd_lens.hook_names import (
    Reads,
    Writes,
    mlp_in_hook,
    mlp_module_out_hook,
    mlp_out_hook,
    out_hook,
    parse_in_hook,
    parse_out_hook,
)
from mxd_lens.records import check_dense, first_position

if TYPE_CHECKING:
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    from transformer_lens import HookedTransformer

    from mxd_lens.layers.base import MLPReplacement

# model -> {block: layer} for the splices active on it (what steering checks)
_SPLICED: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def normalises_mlp_output(model: HookedTransformer) -> bool:
    """True when ``model``'s blocks normalise the MLP's output before ``hook_mlp_out``: Gemma-2/3
    (``use_normalization_before_and_after``: ln2_post) and OLMo-2/3 (``POST_NORM_ARCHITECTURES``:
    ln2 follows the MLP)."""
    from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

    cfg = model.cfg
    return (
        bool(cfg.use_normalization_before_and_after) or cfg.original_architecture in POST_NORM_ARCHITECTURES
    )


def default_writes(model: HookedTransformer) -> Writes:
    """Where a new layer for ``model`` writes: the MLP module ("mlp") where the block normalises the MLP
    output (only the module is in MxD's function class there), else ``hook_mlp_out`` (the same tensor)."""
    return "mlp" if normalises_mlp_output(model) else "hook_mlp_out"


def post_norms(model: HookedTransformer, block: int) -> list[nn.Module]:
    """The norms block ``block`` applies to the MLP's output before ``hook_mlp_out``, in order (TL's
    ``apply_mlp``): ln2_post (Gemma-2/3), ln2 (OLMo-2/3); none in other blocks."""
    from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

    module = model.blocks[block]
    norms = [module.ln2_post] if model.cfg.use_normalization_before_and_after else []
    return norms + ([module.ln2] if model.cfg.original_architecture in POST_NORM_ARCHITECTURES else [])


def check_block(model: HookedTransformer, block: int) -> None:
    """Raise a clear error unless block ``block`` of ``model`` exists and has a dense MLP (not a mixture
    of experts: :func:`check_dense`)."""
    n_layers = model.cfg.n_layers
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < n_layers:
        raise ValueError(
            f"block {block!r} does not exist: {model.cfg.model_name} has blocks 0..{n_layers - 1}"
        )
    check_dense(model)
    if model.cfg.attn_only or not hasattr(model.blocks[block], "mlp"):
        raise ValueError(f"{model.cfg.model_name} is attention-only: block {block} has no MLP to replace")


def mlp_module(model: HookedTransformer, block: int) -> nn.Module:
    check_block(model, block)
    return model.blocks[block].mlp


def dense_mlp(model: HookedTransformer, block: int, writes: Writes = "mlp") -> nn.Module:
    """Block ``block``'s MLP when what a layer writing at ``writes`` replaces is exactly ``W_out
    act(...) + b_out`` of a plain or gated MLP (what ``MxD.from_mlp`` can copy); a clear error
    otherwise. The MLP module's output always is; ``hook_mlp_out`` is not where the block normalises
    the MLP output (Gemma-2/3, OLMo-2/3)."""
    from transformer_lens.components import MLP, GatedMLP

    mlp = mlp_module(model, block)
    if not isinstance(mlp, (MLP, GatedMLP)):
        raise ValueError(
            f"block {block}'s MLP is a {type(mlp).__name__}; only MLP and GatedMLP can be copied"
        )
    if writes != "mlp" and normalises_mlp_output(model):
        raise ValueError(
            f"{model.cfg.model_name} normalises the MLP output before hook_mlp_out, so a layer writing "
            f"{out_hook(block, writes)} cannot copy its MLP exactly; a layer that replaces the MLP module "
            f"(metadata.hook_name_out = {mlp_module_out_hook(block)!r}: what .for_model / MxD.from_mlp / "
            "hooks.layer_metadata give on this model) can"
        )
    if model.cfg.is_layer_norm_activation():
        raise ValueError(f"act_fn={model.cfg.act_fn!r} has a LayerNorm inside the MLP; not supported")
    return mlp


def layer_metadata(model: HookedTransformer, block: int, writes: Writes | None = None) -> SAEMetadata:
    """SAELens metadata for a layer that replaces block ``block``'s MLP of ``model``: it reads
    ``blocks.L.mlp.hook_in`` and writes at ``writes`` (default: :func:`default_writes`, the MLP module
    on hosts that normalise its output, else ``hook_mlp_out``). Its ``model_name`` is one to load the
    host by (``mxd_lens.records.loadable_name``: ``"smollm2-135m"`` for the default model)."""
    from sae_lens.saes.sae import SAEMetadata

    from mxd_lens.records import loadable_name

    check_block(model, block)
    return SAEMetadata(
        model_name=loadable_name(model),
        model_class_name=type(model).__name__,
        hook_name=mlp_in_hook(block),
        hook_name_out=out_hook(block, default_writes(model) if writes is None else writes),
        hook_layer=block,
    )


def block_of(layer: MLPReplacement[Any] | SAE[Any]) -> int:
    """Which block a layer replaces, read from ``cfg.metadata.hook_name_out`` (and, for a layer from
    elsewhere, checked against ``hook_name``: :class:`mxd_lens.foreign.ForeignLayer`)."""
    return replacement(layer).block


def writes_of(layer: MLPReplacement[Any] | SAE[Any]) -> Writes:
    """Where a layer writes (:data:`Writes`), read from ``cfg.metadata.hook_name_out``."""
    return replacement(layer).writes


def by_block(
    layers: Mapping[str, Any] | Sequence[Any], model: Any = None, every: bool = False
) -> dict[int, Any]:
    """``layers`` keyed and sorted by the block each replaces; two for one block are refused, and with
    ``every`` so is a model block without one (a replacement model replaces every MLP)."""
    found: dict[int, list[str]] = {}
    placed: dict[int, Any] = {}
    items = layers.items() if isinstance(layers, Mapping) else enumerate(layers)
    for name, layer in items:
        block = block_of(layer)
        found.setdefault(block, []).append(str(getattr(layer, "mxd_lens_folder", None) or name))
        placed[block] = layer
    doubled = {b: names for b, names in found.items() if len(names) > 1}
    if doubled:
        block, names = next(iter(doubled.items()))
        raise ValueError(
            f"{len(names)} layers replace block {block} ({', '.join(names)}): a replacement model has one "
            "layer per block; give one folder per block (e.g. one run's final/ for one method)"
        )
    if every and model is not None:
        missing = sorted(set(range(model.cfg.n_layers)) - set(placed))
        if missing:
            raise ValueError(
                f"no layer for block(s) {missing} of the model's {model.cfg.n_layers}: a replacement model "
                "replaces every MLP (train them with `mxd-lens train --blocks all`)"
            )
    return dict(sorted(placed.items()))


def check_fits(model: HookedTransformer, layer: MLPReplacement[Any] | SAE[Any], block: int) -> None:
    """Raise unless ``layer`` was made for block ``block`` of a model like ``model``: same widths, and
    the same ``model_name`` when the layer records one (a layer from elsewhere: also a read site this
    model has, see :class:`mxd_lens.foreign.ForeignLayer`)."""
    check_block(model, block)
    rep = replacement(layer)
    check_model_name(model, rep)
    rep.check_fits(model, block)


def check_model_name(model: HookedTransformer, rep: Any) -> None:
    """Raise unless the ``model_name`` the layer of ``rep`` (a :func:`replacement`) records, if any, is
    one of ``model``'s names (``mxd_lens.records.model_names``: its TransformerLens name, the name it was
    loaded by, its hub id, every spelling of the default model; in any case, with or without an
    organisation prefix). One model loaded from another source (a .gguf and its Hugging Face folder)
    has another name but the same architecture: then the model shape the layer's training record holds
    decides, when it has one."""
    from mxd_lens.records import TrainingRecord, is_named, loadable_name, model_shape

    layer = rep.layer
    trained_on, here = layer.cfg.metadata.model_name, model.cfg.model_name
    if not trained_on or is_named(model, trained_on):
        return
    recorded = TrainingRecord.of(layer).model_source.get("shape")
    if recorded is not None and recorded == model_shape(model):
        return
    name = type(layer).__name__
    if not isinstance(rep, OurLayer):  # a layer from elsewhere
        raise ValueError(
            f"{name} was trained on {trained_on!r}, but this model is {here!r}; if they are the same "
            f"model under another name, set layer.cfg.metadata.model_name = {loadable_name(model)!r} (for a "
            "folder: metadata.model_name in its cfg.json)"
        )
    why = (
        "and records no model shape to compare"
        if recorded is None
        else f"and its recorded shape {recorded} differs from this model's {model_shape(model)}"
    )
    raise ValueError(
        f"{name} was trained on {trained_on!r}, but this model is {here!r} {why}; set "
        "layer.cfg.metadata.model_name if they are the same model under another name"
    )


def keep_first(original: torch.Tensor, new: torch.Tensor, keep: int) -> torch.Tensor:
    """``new`` [..., positions, d] with its first ``keep`` positions taken from ``original``."""
    if keep <= 0:
        return new
    return torch.cat((original[..., :keep, :], new[..., keep:, :]), dim=-2)


def replacement(layer: Any) -> Any:
    """How ``splice`` and ``evaluate`` use ``layer``: an :class:`OurLayer` for a layer with mxd-lens's
    sparse interface (``forward_sparse``, ``output_from_codes``: every ``MLPReplacement``), used as it
    is; any other SAELens ``SAE`` through :class:`mxd_lens.foreign.ForeignLayer`, which reads its cfg
    (a clear ValueError when it does not replace an MLP).

    Both give: ``layer``, ``block``, ``reads`` ("mlp": the exact input of the MLP module; "resid":
    ``hook_mlp_in``'s value, the residual before ln2), ``writes`` (:data:`Writes`), ``k`` (None when the layer has none),
    ``default_name``, ``first`` (:func:`first_position`), ``check_fits(model, block)``, ``layer_output(x)`` (what the splice writes, code
    hooks run), ``unhooked(x)`` (the output without code hooks, None when ``layer_output``'s already
    is), ``forward_sparse(x)`` -> (output, code values, code indices) and ``output_from_codes(x, values,
    indices)`` (None when the layer's output cannot be rebuilt from chosen codes)."""
    # ducks, not isinstance: mxd_lens.layers imports this module, so it cannot import them
    if all(callable(getattr(layer, name, None)) for name in ("forward_sparse", "output_from_codes")):
        return OurLayer(layer)
    from mxd_lens.foreign import ForeignLayer

    metadata = getattr(getattr(layer, "cfg", None), "metadata", None)
    reads_at = parse_in_hook(getattr(metadata, "hook_name", None))
    foreign = ForeignLayer(layer, reads_at, parse_out_hook(getattr(metadata, "hook_name_out", None)))
    foreign.first = first_position(layer)
    return foreign


class OurLayer:
    """An mxd-lens layer (``MLPReplacement``) as ``splice`` and ``evaluate`` use it: its own methods.
    It reads the exact input of the MLP module (its ``hook_name`` is ``blocks.L.mlp.hook_in``) and
    writes where its ``hook_name_out`` says (``blocks.L.hook_mlp_out`` or ``blocks.L.mlp.hook_out``)."""

    reads: Reads = "mlp"

    def __init__(self, layer: MLPReplacement[Any]):
        self.layer = layer
        hook = layer.cfg.metadata.hook_name_out
        parsed = parse_out_hook(hook)
        if parsed is None:
            raise ValueError(
                f"{type(layer).__name__} has metadata.hook_name_out={hook!r}, not 'blocks.L.hook_mlp_out' "
                "or 'blocks.L.mlp.hook_out': build it with .for_model(model, block, ...) / MxD.from_mlp, or "
                "set layer.cfg.metadata = mxd_lens.hooks.layer_metadata(model, block)"
            )
        self.block, self.writes = parsed

    @property
    def k(self) -> int:
        return self.layer.cfg.k

    @property
    def first(self) -> int:
        return first_position(self.layer)

    @property
    def default_name(self) -> str:
        return f"L{self.block}.{self.layer.cfg.architecture().removeprefix('mxd_lens.')}.k{self.k}"

    def check_fits(self, model: HookedTransformer, block: int) -> None:
        """Raise unless the layer's widths are the MLP's (its model name: :func:`check_model_name`)."""
        layer = self.layer
        d_model = model.cfg.d_model
        if layer.cfg.d_in != d_model or layer.cfg.d_out != d_model:
            raise ValueError(
                f"{type(layer).__name__} maps {layer.cfg.d_in} -> {layer.cfg.d_out} but "
                f"{model.cfg.model_name}'s MLPs map {d_model} -> {d_model}: it was built for another model"
            )

    def layer_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def unhooked(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.layer._forward_fast(x) if self.layer._code_hooks_active() else None

    def forward_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layer.forward_sparse(x)

    def output_from_codes(self, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return self.layer.output_from_codes(x, values, indices)

    # -- what the studies read (probing, inspect, attribution) -----------------------------------------
    @property
    def d_sae(self) -> int:
        return self.layer.cfg.d_sae

    def encode_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(code values, code indices) [..., K] of inputs x [..., d_in]."""
        return self.layer.encode_sparse(x)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's / encoder's pre-activations ``x W_enc + b_enc`` [..., d_sae] (MxD: x G + b_G)."""
        x = self.layer.process_sae_in(x)
        return x @ self.layer.W_enc + self.layer.b_enc

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact per-unit split of the output on inputs x [T, d_in]: (indices [T, K], values [T, K],
        vectors [T, K, d_out], rest [T, d_out]) with vectors.sum(1) + rest the output (see
        ``mxd_lens.attribution``): each unit's a_n W_dec[n] through the layer's output map, minus its value
        at no unit."""
        layer = self.layer
        x2 = layer.process_sae_in(x).reshape(-1, layer.cfg.d_in)
        values, indices = layer.encode_sparse(x2)
        context = layer.decode_context(x2)
        zero = torch.zeros(x2.shape[0], layer.cfg.d_out, dtype=layer.W_dec.dtype, device=x2.device)
        rest = layer.output(zero, context)
        rows = layer.W_dec[indices] * values[..., None]  # a_n W_dec[n], [T, K, d_out]
        vectors = torch.stack([layer.output(rows[:, j], context) - rest for j in range(rows.shape[1])], dim=1)
        return indices, values, vectors, rest


def layer_input(io: dict[int, dict[str, torch.Tensor]], rep: Any) -> torch.Tensor:
    """What the layer behind ``rep`` (a :func:`replacement`) reads, from :func:`capture_mlp_io`'s record:
    the MLP's input, or for a layer that reads "resid" the residual before ln2 (capture its block with
    ``resid=[block]``: see :func:`resid_blocks`)."""
    slot = io[rep.block]
    if rep.reads == "resid":
        if "resid" not in slot:
            raise KeyError(
                f"block {rep.block}'s layer reads the residual before ln2: capture it with "
                f"capture_mlp_io(model, blocks, resid=[{rep.block}])"
            )
        return slot["resid"]
    return slot["in"]


def resid_blocks(reps: Sequence[Any]) -> list[int]:
    """The blocks among ``reps`` (replacements) whose layer reads the residual before ln2 (what
    :func:`capture_mlp_io` must also record for :func:`layer_input`)."""
    return sorted({rep.block for rep in reps if rep.reads == "resid"})


def read_module(model: HookedTransformer, block: int, reads: Reads = "mlp") -> nn.Module:
    """The module of block ``block`` whose input is what a layer that ``reads`` is given: "mlp": the
    MLP module itself (its exact input); "resid": ``hook_mlp_in``'s value, the residual stream before
    ln2, which is ln2's input (in OLMo 2/3's post-norm blocks ln2 follows the MLP and ``hook_mlp_in``
    feeds the MLP directly: there it is the MLP's input). Read with a forward pre-hook, so
    ``cfg.use_hook_mlp_in`` need not be on."""
    mlp = mlp_module(model, block)
    if reads == "mlp":
        return mlp
    if reads != "resid":
        raise ValueError(f"reads={reads!r}: choose 'mlp' or 'resid'")
    from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

    return mlp if model.cfg.original_architecture in POST_NORM_ARCHITECTURES else model.blocks[block].ln2


def host_map(model: HookedTransformer, block: int, reads: Reads = "mlp", writes: Writes = "mlp"):
    """Block ``block``'s map, token by token ([T, d] -> [T, d]), from what a layer that ``reads`` is
    given to what a layer that ``writes`` replaces: the MLP itself, or for "resid" ln2 then the MLP
    (what the layer's Jacobian is compared with); for ``writes="hook_mlp_out"`` followed by the block's
    post-MLP norms (:func:`post_norms`, none in a pre-norm block)."""
    mlp, module = mlp_module(model, block), read_module(model, block, reads)
    after = post_norms(model, block) if writes == "hook_mlp_out" else []

    def host(v: torch.Tensor) -> torch.Tensor:
        y = mlp(v[None] if module is mlp else module(v[None]))
        for norm in after:
            y = norm(y)
        return y[0]

    return host


def output_key(writes: Writes) -> str:
    """The key of :func:`capture_mlp_io`'s record that holds what a layer writing at ``writes``
    replaces (its training and FVU target): "out" (``hook_mlp_out``) or "module_out"."""
    return "module_out" if writes == "mlp" else "out"


@contextmanager
def capture_mlp_io(
    model: HookedTransformer,
    blocks: Sequence[int],
    resid: Sequence[int] = (),
    module_out: Sequence[int] = (),
) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Record (MLP input, hook_mlp_out) of each block in ``blocks`` during forwards inside the block:
    ``with capture_mlp_io(model, [3]) as io: model(tokens)`` then ``io[3]["in"], io[3]["out"]``; for
    the blocks in ``resid`` (among ``blocks``) also ``io[b]["resid"]``, ``hook_mlp_in``'s value (the
    residual before ln2, see :func:`read_module`); for those in ``module_out`` also
    ``io[b]["module_out"]``, the MLP module's own output (before the post-MLP norm of Gemma-2/3 and
    OLMo-2/3 blocks: what a layer writing "mlp" replaces, see :func:`output_key`)."""
    io: dict[int, dict[str, torch.Tensor]] = {block: {} for block in blocks}
    handles = []
    fwd_hooks = []
    try:
        for block in blocks:
            slot = io[block]
            handles.append(mlp_module(model, block).register_forward_pre_hook(_store_input(slot)))
            if block in resid:
                module = read_module(model, block, "resid")
                handles.append(module.register_forward_pre_hook(_store_input(slot, "resid")))
            if block in module_out:
                handles.append(mlp_module(model, block).register_forward_hook(_store_output(slot)))

            def store_out(out: torch.Tensor, hook: Any, slot: dict[str, torch.Tensor] = slot) -> None:
                slot["out"] = out

            fwd_hooks.append((mlp_out_hook(block), store_out))
        with model.hooks(fwd_hooks=fwd_hooks):
            yield io
    finally:
        for handle in handles:
            handle.remove()


def _store_input(slot: dict[str, torch.Tensor], key: str = "in"):
    def pre_hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        slot[key] = args[0]

    return pre_hook


def _store_output(slot: dict[str, torch.Tensor], key: str = "module_out"):
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        slot[key] = output

    return hook


@contextmanager
def replacing_outputs(
    model: HookedTransformer, replace: Mapping[tuple[int, Writes], Callable[[torch.Tensor], torch.Tensor]]
) -> Iterator[HookedTransformer]:
    """While inside, block L's output at write site ``writes`` is ``fn(its value)`` for each
    ``(L, writes): fn``: ``hook_mlp_out`` through a TransformerLens hook, the MLP module's output
    through a forward hook on ``blocks[L].mlp`` (so the block's post-MLP norm, if any, runs after it,
    as after the MLP). Removed on exit, also when the block raises."""
    handles = []
    fwd_hooks = []
    try:
        for (block, writes), fn in replace.items():
            if writes == "mlp":
                hook = mlp_module(model, block).register_forward_hook(lambda m, args, out, fn=fn: fn(out))
                handles.append(hook)
            elif writes == "hook_mlp_out":
                fwd_hooks.append((mlp_out_hook(block), lambda out, hook, fn=fn: fn(out)))
            else:
                raise ValueError(f"writes={writes!r}: choose 'hook_mlp_out' or 'mlp'")
        with model.hooks(fwd_hooks=fwd_hooks):
            yield model
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def splice(
    model: HookedTransformer, *layers: MLPReplacement[Any] | SAE[Any], error_term: bool = False
) -> Iterator[HookedTransformer]:
    """Run ``model`` with each layer's output in place of its block's MLP output, where the layer
    writes: ``hook_mlp_out``, or the MLP module's own output (``metadata.hook_name_out =
    blocks.L.mlp.hook_out``; the block's post-MLP norm then runs after it, as after the MLP).

    Each layer reads the exact input of the MLP it replaces and later blocks see its output. With
    ``error_term=True`` the residual ``mlp_out - layer(x)`` (detached, at the layer's write site) is
    added back, so logits are the clean ones while gradients and code edits flow through the layer.
    Hooks are removed on exit, also when the block raises.

    A layer from elsewhere (a SAELens transcoder: :mod:`mxd_lens.foreign`) reads where its
    ``metadata.hook_name`` says: ``blocks.L.mlp.hook_in`` (or ``blocks.L.ln2.hook_normalized`` in a
    model whose LayerNorm is folded), the MLP's input as above; ``blocks.L.hook_mlp_in``, the residual
    stream *before* ln2, which it is given as it was trained (the host's ln2 normalises only the MLP's
    input, not the layer's). Its output is SAELens's forward, ``decode(encode(x))`` (+ ``x @ W_skip.T``
    for skip transcoders).
    """
    placed: dict[int, Any] = {}
    for layer in layers:
        rep = replacement(layer)
        index = rep.block
        if index in placed or index in _SPLICED.get(model, {}):
            raise ValueError(f"two layers target block {index}'s MLP; splice at most one per block")
        check_block(model, index)
        check_model_name(model, rep)
        rep.check_fits(model, index)
        # an SAE attached by HookedSAETransformer.add_sae at either output site would override the splice
        sites = {
            mlp_out_hook(index): model.blocks[index].hook_mlp_out,
            mlp_module_out_hook(index): getattr(model.blocks[index].mlp, "hook_out", None),
        }
        for name, point in sites.items():
            if point is not None and not isinstance(point, HookPoint):
                raise ValueError(
                    f"{name} is not a plain HookPoint (an SAE is attached there?): call model.reset_saes() first"
                )
        placed[index] = rep

    handles = []
    replace = {}
    try:
        for index, rep in placed.items():
            slot: dict[str, torch.Tensor] = {}
            handles.append(read_module(model, index, rep.reads).register_forward_pre_hook(_store_input(slot)))
            if rep.first:  # where the row starts: a key-value cache (generate) runs later positions alone
                hook = model.blocks[index].register_forward_pre_hook(_store_offset(slot), with_kwargs=True)
                handles.append(hook)
            replace[index, rep.writes] = _replace_output(rep, slot, error_term)
        active = _SPLICED.setdefault(model, {})
        active.update({index: rep.layer for index, rep in placed.items()})
        with replacing_outputs(model, replace):
            yield model
    finally:
        for handle in handles:
            handle.remove()
        for index in placed:
            _SPLICED.get(model, {}).pop(index, None)


def spliced_layers(model: HookedTransformer) -> dict[int, Any]:
    """The layers spliced into ``model`` right now, by block (inside ``splice`` contexts)."""
    return dict(_SPLICED.get(model, {}))


def _store_offset(slot: dict[str, Any]):
    """A block's forward pre-hook recording the row position of its input's first position: the length
    of its key-value cache entry (TransformerLens passes ``past_kv_cache_entry``), else 0."""

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        entry = kwargs.get("past_kv_cache_entry")
        slot["offset"] = 0 if entry is None else int(entry.past_keys.shape[1])

    return pre_hook


def _replace_output(rep: Any, slot: dict[str, Any], error_term: bool):
    first = rep.first

    def replace(mlp_out: torch.Tensor) -> torch.Tensor:
        x = slot.pop("in")
        out = rep.layer_output(x).to(mlp_out.dtype)
        if error_term:
            with torch.no_grad():
                clean = rep.unhooked(x)
                clean = out if clean is None else clean.to(mlp_out.dtype)
                error = mlp_out - clean
            out = out + error
        return keep_first(mlp_out, out, first - slot.pop("offset", 0))

    return replace

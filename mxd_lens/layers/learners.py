"""The learners of a run, built once: what to train (``LearnerSpec``, one per architecture x K x width x
block, ``learner_specs``), the architectures checked before any heavy work (``check_archs``), and each
spec turned into its layer on the run's stream, or a caller's layer checked against it
(``build_learners``). ``mxd_lens.training.Trainer`` then trains the layers it is handed here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from mxd_lens import hooks
from mxd_lens.config import WIDTH_MULTIPLIER, LearnersConfig
from mxd_lens.layers.base import MLPReplacement
from mxd_lens.layers.registry import architecture_key, get_architecture

if TYPE_CHECKING:
    from mxd_lens.activations import StreamInfo

log = logging.getLogger(__name__)


def check_archs(archs: Sequence[str]) -> None:
    """Refuse an architecture no one registered (after loading installed plug-ins), before any heavy
    work (at run time rather than parse time, so that ``--help`` stays light)."""
    from mxd_lens.layers import ARCHITECTURES, parse_arch
    from mxd_lens.layers.registry import load_plugins

    if any(parse_arch(a)[0] not in ARCHITECTURES for a in archs):
        load_plugins()
    unknown = [a for a in archs if parse_arch(a)[0] not in ARCHITECTURES]
    if unknown:
        raise ValueError(
            f"--arch {' '.join(unknown)}: not a key of mxd_lens.ARCHITECTURES {list(ARCHITECTURES)} "
            "(a third-party architecture: `mxd-lens --import MODULE train ...`, or install its plug-in)"
        )


def learner_specs(learners: LearnersConfig, blocks: Sequence[int]) -> list[LearnerSpec]:
    """Every combination of ``learners``' architectures x K x width multipliers at every block."""
    return [
        LearnerSpec(
            arch,
            block,
            k,
            m,
            init=learners.init if get_architecture(arch.partition(":")[0]).copies_host_mlp else "default",
        )  # fmt: skip
        for block in blocks
        for arch in learners.arch
        for k in learners.k
        for m in learners.width_multiplier or [None]
    ]


@dataclass
class LearnerSpec:
    """One layer to train. ``width_multiplier`` m sets the transcoder width H = m * d_in; an MxD gets
    the experts that match that transcoder's parameters (``match_experts``). None (the default): the
    run's stream chooses it, ``StreamInfo.default_width_multiplier`` (8, or more on hosts whose MLP is too
    wide for a width-8 match), set by the Trainer on the spec itself and logged. ``d_sae`` instead sets
    the number of units (experts / latents) directly."""

    arch: str  # a key of mxd_lens.ARCHITECTURES (the built-in ones, or one registered)
    block: int  # the transformer block whose MLP it replaces
    k: int
    width_multiplier: int | None = None
    init: Literal["default", "mlp", "given"] = "default"  # "mlp": the host MLP's weights in the layer's
    # dense path (an architecture with ``copies_host_mlp``: MxD's E, b_E, D);
    # "given": a layer built by the caller (Trainer takes the layer itself in place of a spec)
    d_sae: int | None = None
    normalize_decoder: bool | None = (
        None  # None: the architecture's unit_norm_decoder (off for the skip transcoder)
    )
    lr: float | None = None  # this learner's peak rate (None: the run's ``TrainConfig.lr``); same schedule
    options: dict[str, Any] = field(default_factory=dict)
    """config fields of the architecture, e.g. {"gate": "topk"} for MxD; ``arch`` may carry them as
    ``"mxd:gate=topk,balance_rate=0.001"`` (``mxd_lens.layers.parse_arch``)"""

    def __post_init__(self) -> None:
        from mxd_lens.layers import parse_arch

        key, options = parse_arch(self.arch)
        if options:
            clash = sorted(set(options) & set(self.options))
            if clash:
                raise ValueError(f"{self.arch!r}: {clash} given twice (in the arch string and in options)")
            self.arch, self.options = key, {**options, **self.options}
        for name in ("k", "width_multiplier", "d_sae"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"{name}={value} ({option}) must be positive")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise ValueError(f"{self.arch}: lr={self.lr!r} must be a positive number (None: the run's rate)")
        layer_cls = get_architecture(self.arch)  # a clear error for an unknown key
        allowed = _option_fields(layer_cls)
        unknown = sorted(set(self.options) - allowed)
        if unknown:
            raise ValueError(
                f"{self.arch}: {unknown} cannot be set as options; {layer_cls.config_class.__name__}'s "
                f"options are {sorted(allowed) or 'none'}"
            )
        if self.init == "mlp" and not layer_cls.copies_host_mlp:
            raise ValueError(
                f"init='mlp' copies the host MLP's weights into the layer; {self.arch} has no part that takes "
                "them: use init='default'"
            )

    @property
    def name(self) -> str:
        init = "" if self.init == "default" else f".init-{self.init}"
        if self.d_sae is not None:
            size = f"n{self.d_sae}"
        elif self.width_multiplier is None:
            raise ValueError(
                f"LearnerSpec({self.arch!r}, block {self.block}): its width multiplier is chosen from the stream, "
                "so it has no name until a Trainer (or LearnerSpec.size_for(stream info)) has sized it; or give "
                "width_multiplier"
            )
        else:
            size = f"m{self.width_multiplier}"
        method = self.method.replace(":", "-").replace(",", "-")  # a folder name anywhere
        lr = "" if self.lr is None else f".lr{self.lr:g}"
        return f"L{self.block}.{method}.k{self.k}.{size}{lr}{init}"

    @property
    def method(self) -> str:
        """The architecture key with its options, as ``parse_arch`` reads it: ``mxd``, ``mxd:gate=topk``."""
        from mxd_lens.layers import format_arch

        return format_arch(self.arch, self.options)

    @classmethod
    def of(cls, layer: MLPReplacement) -> LearnerSpec:
        """The spec of a layer built elsewhere (``init="given"``)."""
        from mxd_lens import hooks

        key = architecture_key(layer)
        defaults = {f.name: f.default for f in dataclasses.fields(layer.cfg)}
        options = {
            name: getattr(layer.cfg, name)
            for name in layer.cfg.variant_fields
            if getattr(layer.cfg, name) != defaults[name]
        }
        return cls(
            key, hooks.block_of(layer), layer.cfg.k, init="given", d_sae=layer.cfg.d_sae, options=options
        )

    def size_for(self, info: StreamInfo) -> bool:
        """Set the width multiplier, if not given, to the one the stream ``info`` describes chooses
        (``StreamInfo.default_width_multiplier``: every learner of a run gets the same m). In place, as
        the Trainer does for the specs it is given, so that ``spec.name`` then names the trained layer.
        True if it was chosen here."""
        if self.width_multiplier is not None:
            return False
        self.width_multiplier = info.default_width_multiplier
        return True

    @property
    def normalizes_decoder(self) -> bool:
        if self.normalize_decoder is None:
            return get_architecture(self.arch).unit_norm_decoder
        return self.normalize_decoder


def build_layer(
    spec: LearnerSpec, info: StreamInfo, seed: int, dtype: str = "float32", device: str = "cpu"
) -> MLPReplacement:
    """A fresh layer for ``spec`` on the stream ``info`` describes, initialised from ``seed``."""
    from sae_lens.saes.sae import SAEMetadata

    if spec.block not in info.blocks:
        raise ValueError(f"{spec.name}: the stream holds blocks {info.blocks}, not {spec.block}")
    spec.size_for(info)
    width = spec.width_multiplier * info.d_in
    hook_in, hook_out = info.hook_names[str(spec.block)]
    common = dict(
        d_in=info.d_in,
        d_out=info.d_out,
        k=spec.k,
        dtype=dtype,
        device=device,
        metadata=SAEMetadata(
            model_name=info.model_name, hook_name=hook_in, hook_name_out=hook_out, hook_layer=spec.block
        ),
    )
    torch.manual_seed(seed)
    layer_cls = get_architecture(spec.arch)
    cfg = layer_cls.config_for_stream(info, width, **common, **spec.options)
    if spec.d_sae is not None:
        cfg = dataclasses.replace(cfg, d_sae=spec.d_sae)
    return layer_cls(cfg)


def build_learners(
    items: Sequence[LearnerSpec | MLPReplacement],
    info: StreamInfo,
    seed: int,
    model: Any = None,
    device: str = "cpu",
) -> tuple[list[tuple[LearnerSpec, MLPReplacement]], int | None]:
    """Every learner of a run as its (spec, layer), once: every spec is sized for the stream ``info``
    describes (``LearnerSpec.size_for``), then built into a fresh layer; a caller's layer is checked
    against the stream (``_admit``). Also the width multiplier chosen from the stream for the specs that
    left it unset (logged; None if none did). Refuses an empty list or two learners of one name."""
    specs = [item for item in items if isinstance(item, LearnerSpec)]
    chosen = sorted({spec.width_multiplier for spec in specs if spec.size_for(info) and spec.d_sae is None})
    admitted = [_admit(item, i, info, seed, model, device) for i, item in enumerate(items)]
    names = [spec.name for spec, _ in admitted]
    if chosen:
        log.info("width multiplier m = %d (%s; width_multiplier / --width-multiplier sets it)", chosen[0],
                 "the default" if chosen[0] == WIDTH_MULTIPLIER else
                 f"raised from {WIDTH_MULTIPLIER}: this host's MLP ({info.d_hidden} wide"
                 f"{', GLU' if info.gated else ''}) would leave a width-{WIDTH_MULTIPLIER} match fewer "
                 f"than d_model = {info.d_in} experts")  # fmt: skip
    if not admitted or len(set(names)) != len(names):
        raise ValueError(f"need one or more learners with distinct names, got {names}")
    return admitted, chosen[0] if chosen else None


def _admit(
    item: LearnerSpec | MLPReplacement, index: int, info: StreamInfo, seed: int, model: Any, device: str
) -> tuple[LearnerSpec, MLPReplacement]:
    """A learner's spec and its layer: a spec (sized: ``build_learners``) is built into a fresh layer
    (seeded by the run's seed and its place in the list), a caller's layer is checked against the
    stream and described by a spec."""
    if isinstance(item, MLPReplacement):
        spec = LearnerSpec.of(item)
        _check_given(item, spec, info)
        return spec, item.to(device)
    if item.init == "given":
        raise ValueError(
            f"{item.name}: init='given' means a layer built by the caller; pass the layer itself"
        )
    layer = build_layer(item, info, seed=seed * 7919 + index, device=device)
    if item.init == "mlp":
        if model is None:
            raise ValueError(
                f"{item.name}: init='mlp' needs the model (from a cache: give --model, the model the cache was made with)"
            )
        layer.copy_hidden_from_mlp(model, item.block)  # rescaled once the scales are known
    return item, layer


def _check_given(layer: MLPReplacement, spec: LearnerSpec, info: StreamInfo) -> None:
    """A caller's layer must fit the stream: its block, widths and model."""
    if spec.block not in info.blocks:
        raise ValueError(f"{spec.name}: the stream holds blocks {info.blocks}, not {spec.block}")
    if (layer.cfg.d_in, layer.cfg.d_out) != (info.d_in, info.d_out):
        raise ValueError(
            f"{spec.name}: the layer maps {layer.cfg.d_in} -> {layer.cfg.d_out}, the stream {info.d_in} -> {info.d_out}"
        )
    model_name = layer.cfg.metadata.model_name
    if model_name and model_name != info.model_name:
        raise ValueError(
            f"{spec.name}: the layer was built for {model_name!r}, the stream is {info.model_name!r}"
        )
    targets = info.writes(spec.block)
    writes = hooks.writes_of(layer)
    if writes != targets:
        raise ValueError(
            f"{spec.name}: the layer writes {hooks.out_hook(spec.block, writes)}, but the stream's targets are "
            f"{hooks.out_hook(spec.block, targets)} (on Gemma-2/3 and OLMo-2/3 these differ: the block "
            "normalises the MLP output between them): "
            f"build the layer with writes={targets!r} (.for_model / MxD.from_mlp), or stream the other "
            f"output (ModelActivations(..., writes={writes!r}))"
        )


def _option_fields(layer_cls: type) -> set[str]:
    """The fields an architecture adds to LayerConfig: what LearnerSpec.options may set."""
    from mxd_lens.layers import LayerConfig

    return {f.name for f in dataclasses.fields(layer_cls.config_class)} - {
        f.name for f in dataclasses.fields(LayerConfig)
    }

"""What every mxd-lens layer shares: the SAELens ``SAE`` contract for an MLP replacement.

A layer maps the MLP input x [..., d_in] to the MLP output y [..., d_out] through K-sparse codes:

    codes = encode(x)            # [..., d_sae], at most K non-zeros per token (TopK layers)
    y     = decode(codes)        # uses what the matching encode stashed (MxD: z; skip: x)
    y     = forward(x)           # == decode(encode(x)), bit for bit, without the dense codes

Subclasses say what decode needs from x (``decode_context``) and how the K-row mixture
``sum_n a_n W_dec[n]`` becomes the output (``output``); the other methods a new architecture may
override are grouped under "what subclasses provide" below (docs/custom_layers.md). Everything else
lives here.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import torch
from sae_lens import SAE, SAEConfig
from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME
from safetensors.torch import save_file
from torch import nn
from typing_extensions import override

from mxd_lens import fileio
from mxd_lens.layers import ops

if TYPE_CHECKING:
    from mxd_lens.hook_names import Writes

C = TypeVar("C", bound="LayerConfig")


@dataclass
class LayerConfig(SAEConfig):
    """Fields shared by all our layers. ``d_sae`` is the code width (MxD: the number of experts N)."""

    d_out: int = 0
    k: int = 32
    apply_b_dec_to_input: bool = False
    # fields that make a variant of the architecture (MxD's gate): shown in learner names and labels
    variant_fields: ClassVar[tuple[str, ...]] = ()

    @override
    @classmethod
    def architecture(cls) -> str:  # pragma: no cover - abstract in spirit
        """The SAELens architecture name written to ``cfg.json`` (namespace it: ``my_project.layer``)."""
        raise NotImplementedError

    @override
    def __post_init__(self) -> None:
        for name in ("d_in", "d_out", "d_sae"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if not isinstance(self.k, int) or not 0 < self.k <= self.d_sae:
            raise ValueError(
                f"{type(self).__name__}.k must satisfy 0 < k <= d_sae={self.d_sae}, got k={self.k!r}"
            )
        if self.apply_b_dec_to_input:
            raise ValueError(
                "apply_b_dec_to_input=True subtracts an output-space bias from the input; "
                "it has no meaning for an MLP replacement: leave it False"
            )
        if self.normalize_activations != "none":
            raise ValueError(
                f"normalize_activations={self.normalize_activations!r} is not supported by "
                f"{type(self).__name__}: the layer must read the raw MLP input; use 'none'"
            )
        super().__post_init__()


class TrainStepOutput(NamedTuple):
    """One training batch through a layer: ``loss`` is what to backpropagate, ``losses`` its terms
    (``mse``, and ``auxk`` when dead units were given), ``metrics`` floats to log (``loss``, ``fvu``,
    ``l0``, ``auxk``)."""

    output: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    loss: torch.Tensor
    losses: dict[str, torch.Tensor]
    metrics: dict[str, float]


@dataclass
class _Stash:
    """What ``encode`` leaves for ``decode``: the tensor it returned (by weak reference: decode may
    use the stash only for that very tensor), the decode context and, while the returned codes are
    the TopK codes themselves and untouched, their indices (so decode gathers instead of searching)."""

    lead_shape: torch.Size
    context: Any
    returned: weakref.ref
    topk: bool  # the returned tensor is the TopK codes (no hook replaced them) and has a version counter
    codes_version: int
    indices: torch.Tensor


class MLPReplacement(SAE[C]):
    """Base class of MxD and the transcoders. Not registered; use a subclass.

    A subclass names its config class (``config_class``), how tables and plots name it (``label``)
    and whether the trainer keeps its decoder rows at unit norm (``unit_norm_decoder``); it is
    registered under a key with ``mxd_lens.register_architecture`` (docs/custom_layers.md)."""

    cfg: C
    config_class: ClassVar[type[LayerConfig]]
    label: ClassVar[str]
    unit_norm_decoder: ClassVar[bool] = True
    needs_decode_context = True

    def __init__(self, cfg: C, use_error_term: bool = False):
        super().__init__(cfg, use_error_term=use_error_term)
        self._stash: _Stash | None = None
        self.pre_moments: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @classmethod
    def for_model(cls, model: Any, block: int, writes: Writes | None = None, **cfg_fields: Any):
        """A fresh layer sized for block ``block``'s MLP of a HookedTransformer, with its hook
        metadata set; ``cfg_fields`` are the remaining config fields (``d_sae``, ``k``, ...).
        ``writes`` ("hook_mlp_out" or "mlp", the MLP module's output) is where it writes; by default
        the MLP module where the block normalises the MLP's output (Gemma-2/3, OLMo-2/3), else
        ``hook_mlp_out`` (``mxd_lens.hooks.default_writes``)."""
        from mxd_lens import hooks

        hooks.check_block(model, block)
        fields = {
            "d_in": model.cfg.d_model,
            "d_out": model.cfg.d_model,
            "dtype": str(model.cfg.dtype).removeprefix("torch."),
            "device": str(model.cfg.device or "cpu"),
            "metadata": hooks.layer_metadata(model, block, writes),
            **cls.model_defaults(model),
            **cfg_fields,
        }
        return cls(cls.config_class(**fields))

    @override
    @classmethod
    def get_sae_config_class_for_architecture(cls, architecture: str) -> type[SAEConfig]:
        return _registry()[architecture][1]

    def init_dictionary(self, zero_decoder: bool = False) -> None:
        """Create the parameters every layer has (call it from ``initialize_weights``): the TopK encoder
        W_enc (d_in, d_sae) as ``nn.Linear`` would draw it, b_enc (d_sae,) = 0, and the dictionary W_dec
        (d_sae, d_out) (uniform(-1, 1) rows scaled to unit norm, or zero), b_dec (d_out,) = 0."""
        cfg, kw = self.cfg, {"dtype": self.dtype, "device": self.device}
        self.W_enc = nn.Parameter(uniform_(torch.empty(cfg.d_in, cfg.d_sae, **kw), cfg.d_in**-0.5))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, **kw))
        W_dec = torch.zeros(cfg.d_sae, cfg.d_out, **kw)
        if not zero_decoder:
            unit_rows_(uniform_(W_dec, 1.0))
        self.W_dec = nn.Parameter(W_dec)
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_out, **kw))

    # -- what subclasses provide (the extension points: docs/custom_layers.md) ------------------
    @classmethod
    def config_for_stream(cls, info: Any, width: int, **common: Any) -> LayerConfig:
        """The config of a layer for an activation stream (``info``: an ``activations.StreamInfo``)
        costing about as many parameters as a TopK transcoder of ``width`` latents; ``common`` are the
        fields every layer has (d_in, d_out, k, dtype, device, metadata). Default: ``width`` units."""
        return cls.config_class(d_sae=width, **common)

    @classmethod
    def model_defaults(cls, model: Any) -> dict[str, Any]:
        """Config fields that ``for_model`` reads from the host ``model`` (a HookedTransformer) besides
        the widths, dtype, device and hook metadata (MxD: the hidden width, activation, MLP form).
        Nothing by default."""
        return {}

    @property
    def relu_codes(self) -> bool:
        """True when the codes are TopK(ReLU(x W_enc + b_enc)) (non-negative; every built-in layer by
        default); False for a plain TopK of x W_enc + b_enc, whose codes are signed (MxD's
        ``gate="topk"``). A unit is *active* on a token where its code is non-zero."""
        return True

    wants_pre_moments: bool = False
    """True when ``after_step`` reads ``self.pre_moments``: the per-unit mean and mean square of
    x W_enc + b_enc over the last training batch (MxD's gate standardisation)."""

    copies_host_mlp: bool = False
    """True when the layer has a dense path that ``copy_hidden_from_mlp`` can set to the host MLP's
    weights (a trainer's ``init="mlp"`` warm start; MxD's hidden layer)."""

    def copy_hidden_from_mlp(self, model: Any, block: int) -> MLPReplacement:
        """In place: set the layer's dense path to block ``block``'s MLP weights (where
        ``copies_host_mlp``; refused otherwise). Returns self."""
        raise ValueError(
            f"{type(self).__name__} has no dense path to copy the host MLP into; use init='default'"
        )

    @torch.no_grad()
    def scale_copied_mlp(self, input_scale: float, output_scale: float) -> None:
        """In place: the parts ``copy_hidden_from_mlp`` set, which read the raw MLP input and write at
        the raw output scale, made to read ``input_scale * x`` and write ``output_scale * y`` (how a
        trainer on normalised activations uses a warm start). Nothing to do by default."""

    @torch.no_grad()
    def after_step(self, values: torch.Tensor, indices: torch.Tensor) -> dict[str, float]:
        """Called by the trainer after each optimiser step, outside the gradient: where a layer adjusts
        state that no loss trains (MxD's usage controller and gate standardisation, the BatchTopK
        threshold).

        values, indices: (T, k'), the step's codes as ``training_encode`` chose them -> metrics to log
        (none by default)."""
        return {}

    def decode_context(self, x: torch.Tensor) -> Any:
        """What decode needs from the input besides the codes: None by default (a layer whose output
        needs nothing from x also sets the class attribute ``needs_decode_context = False``).

        x: (T, d_in), after ``process_sae_in`` -> anything ``output`` takes, e.g. a (T, d_out) tensor
        (MxD: the hidden layer's z D; the skip transcoder: x itself)."""
        return None

    def output(self, mixture: torch.Tensor, context: Any) -> torch.Tensor:
        """The layer output from the codes' decoder mixture and the decode context.

        mixture: (T, d_out), ``sum_n a_n W_dec[n]`` over each token's codes; context: what
        ``decode_context`` returned for the same T tokens -> (T, d_out)."""
        raise NotImplementedError

    def aux_output(self, mixture: torch.Tensor, context: Any) -> torch.Tensor:
        """What the AuxK units' mixture adds to the output (no bias), for the AuxK loss: the mixture
        itself by default; MxD modulates it by its hidden layer, held fixed.

        mixture: (T, d_out), ``sum_n a_n W_dec[n]`` over the AuxK units; context: ``decode_context``'s
        -> (T, d_out)."""
        return mixture

    def fold_dense(self, input_scale: float, output_scale: float) -> None:
        """In place, for ``fold_activation_scales``: the parameters outside the TopK dictionary, trained
        to map ``input_scale * x`` to ``output_scale * y``, made to map raw x to raw y (the base class
        has already divided the codes by ``output_scale``). Nothing to fold by default."""

    def select_codes(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode``'s selection of the codes among the pre-activations (after their hook),
        differentiable in ``pre``. Default: TopK_K(ReLU(pre)) (no ReLU where ``relu_codes`` is False).
        A layer with another selection overrides this, ``sparse_codes`` and ``training_encode`` alike.

        pre: (..., d_sae) -> (values, indices), each (..., k'); k' = K by default."""
        values, indices = pre.topk(self.cfg.k, dim=-1, sorted=True)
        return (values.clamp_min(0.0) if self.relu_codes else values), indices

    def sparse_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes from the sparse encoder (one matmul, a backward through the selected entries only):
        what ``forward``, ``forward_sparse`` and ``encode_sparse`` use. Default: TopK.

        x: (T, d_in), after ``process_sae_in`` -> (values, indices), each (T, k'); k' = K by default
        (a variable number per token: padded with zero values)."""
        return ops.topk_encode(x, self.W_enc, self.b_enc, self.cfg.k, relu=self.relu_codes)[:2]

    def training_encode(
        self, x: torch.Tensor, aux_mask: torch.Tensor | None, k_aux: int, pre_moments: list | None
    ) -> ops.EncoderOutput:
        """``training_forward_pass``'s encoder: the training batch's codes and the AuxK selection.
        Default: the same TopK as at inference.

        x: (T, d_in); aux_mask: (d_sae,) bool, the dead units AuxK may pick (None: no AuxK); k_aux: how
        many; pre_moments: a list to append the per-unit (mean, mean square) (d_sae,) of the
        pre-activations to (None: not wanted) -> ``ops.EncoderOutput`` with values, indices (T, k') and
        aux_values, aux_indices (T, k_aux)."""
        return ops.topk_encode(
            x,
            self.W_enc,
            self.b_enc,
            self.cfg.k,
            aux_mask,
            k_aux,
            relu=self.relu_codes,
            pre_moments=pre_moments,
        )

    # -- the SAELens contract ------------------------------------------------------------------
    @override
    def process_sae_in(self, sae_in: torch.Tensor) -> torch.Tensor:
        if sae_in.shape[-1] != self.cfg.d_in:
            raise ValueError(
                f"{type(self).__name__} expects inputs of width d_in={self.cfg.d_in}, got shape "
                f"{tuple(sae_in.shape)}; feed it the MLP input of the layer it was built for"
            )
        sae_in = sae_in.to(self.dtype)
        return self.hook_sae_input(sae_in)

    @override
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense codes [..., d_sae] with at most K non-zeros: TopK_K(ReLU(x W_enc + b_enc)) (without the
        ReLU where ``relu_codes`` is False)."""
        x = self.process_sae_in(x)
        lead, x2 = x.shape[:-1], x.reshape(-1, self.cfg.d_in)
        pre = torch.addmm(self.b_enc, x2, self.W_enc).reshape(*lead, self.cfg.d_sae)
        pre = self.hook_sae_acts_pre(pre)
        values, indices = self.select_codes(pre)
        codes = torch.zeros_like(pre).scatter(-1, indices, values)
        out = self.hook_sae_acts_post(codes)
        self._stash = _Stash(
            lead_shape=lead,
            context=self.decode_context(x2) if self.needs_decode_context else None,
            returned=weakref.ref(out),
            # inference tensors (TL's generate) have no version counter to detect in-place edits:
            # decode them by their non-zeros instead of trusting the indices chosen here
            topk=out is codes and not out.is_inference(),
            codes_version=-1 if out.is_inference() else out._version,
            indices=indices.reshape(-1, indices.shape[-1]),
        )
        return out

    @override
    def decode(self, feature_acts: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The output [..., d_out] for codes [..., d_sae] (edited codes are fine: steering).

        A pure function of its arguments. MxD's and the skip transcoder's output depend on the input
        too: pass it as ``x``, or decode the very tensor the last ``encode`` returned (edited in place
        or not), whose input ``encode`` kept. Any other codes without ``x`` are refused, so codes of
        one input are never decoded with another input's hidden layer."""
        if feature_acts.shape[-1] != self.cfg.d_sae:
            raise ValueError(
                f"{type(self).__name__}.decode expects codes of width d_sae={self.cfg.d_sae}, "
                f"got shape {tuple(feature_acts.shape)}"
            )
        lead = feature_acts.shape[:-1]
        codes = feature_acts.reshape(-1, self.cfg.d_sae)
        stash = self._stash
        mine = stash is not None and stash.returned() is feature_acts
        context = None
        if self.needs_decode_context:
            if x is not None:
                x = self.process_sae_in(x)
                if x.shape[:-1] != lead:
                    raise ValueError(
                        f"{type(self).__name__}.decode got codes for batch shape {tuple(lead)} and an input "
                        f"of batch shape {tuple(x.shape[:-1])}"
                    )
                context = self.decode_context(x.reshape(-1, self.cfg.d_in))
            elif mine:
                context = stash.context
            else:
                raise RuntimeError(
                    f"{type(self).__name__}.decode needs the input these codes came from (its output depends "
                    "on x, not only on the codes): pass decode(codes, x=x), or decode the tensor the last "
                    "encode(x) returned, or call forward(x)"
                )
        fresh = mine and x is None and stash.topk and feature_acts._version == stash.codes_version
        if fresh:
            indices = stash.indices
            mixture = ops.decode_rows(codes.gather(-1, indices), indices, self.W_dec)
        else:
            sparse = ops.sparsify(codes)
            if sparse is None:
                mixture = ops.decode_dense(codes, self.W_dec)
            else:
                mixture = ops.decode_rows(sparse[0], sparse[1], self.W_dec)
        out = self.hook_sae_recons(self.output(mixture, context))
        return out.reshape(*lead, self.cfg.d_out)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer output, equal to ``decode(encode(x))`` but never building the dense codes."""
        if self.use_error_term:
            raise RuntimeError(
                "use_error_term needs the true MLP output, which a layer alone does not see: use "
                "mxd_lens.splice(model, layer, error_term=True) or HookedSAETransformer.add_sae"
            )
        if self._code_hooks_active():
            return self.hook_sae_output(self.decode(self.encode(x)))
        return self.hook_sae_output(self._forward_fast(x))

    def _forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_sparse(x)[0]

    def forward_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [..., d_out], code values [..., K], code indices [..., K]) in one sparse pass:
        what a trainer needs (the output and which units fired), without the code hook points."""
        x = self.process_sae_in(x)
        lead, x2 = x.shape[:-1], x.reshape(-1, self.cfg.d_in)
        values, indices = self.sparse_codes(x2)
        mixture = ops.decode_rows(values, indices, self.W_dec)
        out = self.output(mixture, self.decode_context(x2))
        k = values.shape[-1]
        return out.reshape(*lead, self.cfg.d_out), values.reshape(*lead, k), indices.reshape(*lead, k)

    def encode_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as (values [..., K], indices [..., K]), values sorted descending (a layer with a
        variable number of codes per token: [..., m] padded with zeros)."""
        x = self.process_sae_in(x)
        lead, x2 = x.shape[:-1], x.reshape(-1, self.cfg.d_in)
        values, indices = self.sparse_codes(x2)
        k = values.shape[-1]
        return values.reshape(*lead, k), indices.reshape(*lead, k)

    def output_from_codes(self, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The output [..., d_out] for sparse codes (values, indices [..., k'], any k') on input x
        [..., d_in]: e.g. each token's largest code alone (``evaluate``'s top-1 FVU)."""
        x = self.process_sae_in(x)
        lead, x2 = x.shape[:-1], x.reshape(-1, self.cfg.d_in)
        k = values.shape[-1]
        mixture = ops.decode_rows(values.reshape(-1, k), indices.reshape(-1, k), self.W_dec)
        context = self.decode_context(x2) if self.needs_decode_context else None
        return self.output(mixture, context).reshape(*lead, self.cfg.d_out)

    # -- training ----------------------------------------------------------------------------------
    def training_forward_pass(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        loss_scale: float | None = None,
        objective: str = "nmse",
        dead_mask: torch.Tensor | None = None,
        k_aux: int = 0,
        aux_coefficient: float = 0.0,
    ) -> TrainStepOutput:
        """The loss terms and metrics of one batch (x [T, d_in], y [T, d_out]); the SAELens pattern.

        ``mse``: with ``objective="nmse"``, sum_d (y_hat - y)^2 per token, averaged over tokens and divided
        by ``loss_scale`` (the trainer's fixed per-token target variance; default: this batch's), so it
        reads as FVU and, being a mean of per-token terms, splits exactly over data-parallel ranks;
        ``"paper"``: the reference code's mean_{t,d} (y_hat - y)^2 / ||y_t||.
        ``auxk`` (Gao et al. 2024; sparsify): the ``k_aux`` largest pre-activations among the units in
        ``dead_mask`` reconstruct the residual e = y - y_hat (held fixed) through the same decoder
        (``aux_output``), ``min(n_dead / k_aux, 1) * mean_t ||e_hat - e||^2 / loss_scale``; it is added
        with ``aux_coefficient``. Its gradient reaches only the dead units' encoder columns and
        decoder rows. The pre-activations come from the TopK matmul itself (no second [T, N] product).
        """
        x2 = self.process_sae_in(x).reshape(-1, self.cfg.d_in)
        y2 = y.reshape(-1, self.cfg.d_out).to(self.dtype)
        if loss_scale is None:
            loss_scale = float((y2 - y2.mean(0)).pow(2).sum(-1).mean())
        loss_scale = max(loss_scale, 1e-12)
        n_dead = int(dead_mask.sum()) if dead_mask is not None else 0
        use_aux = aux_coefficient > 0 and k_aux > 0 and n_dead > 0
        moments: list | None = [] if self.wants_pre_moments else None
        enc = self.training_encode(x2, dead_mask if use_aux else None, k_aux if use_aux else 0, moments)
        self.pre_moments = (*moments[0], x2.shape[0]) if moments else None
        context = self.decode_context(x2)
        out = self.output(ops.decode_rows(enc.values, enc.indices, self.W_dec), context)
        sq = (out - y2).pow(2)
        if objective == "nmse":
            mse = sq.sum(-1).mean() / loss_scale
        elif objective == "paper":
            mse = (sq / y2.norm(dim=-1, keepdim=True).clamp_min(1e-12)).mean()
        else:
            raise ValueError(f"objective {objective!r}: choose 'nmse' or 'paper'")
        losses = {"mse": mse}
        loss = mse
        if use_aux:
            residual = (y2 - out).detach()
            e_hat = self.aux_output(ops.decode_rows(enc.aux_values, enc.aux_indices, self.W_dec), context)
            scale = min(n_dead / k_aux, 1.0)
            losses["auxk"] = scale * (e_hat - residual).pow(2).sum(-1).mean() / loss_scale
            loss = loss + aux_coefficient * losses["auxk"]
        with torch.no_grad():
            total_var = (y2 - y2.mean(0)).pow(2).sum().clamp_min(1e-12)
            metrics = {
                "loss": float(loss),
                "fvu": float(sq.sum() / total_var),
                "l0": float((enc.values != 0).sum(-1).float().mean()),
                **({"auxk": float(losses["auxk"])} if use_aux else {}),
            }
        return TrainStepOutput(out, enc.values, enc.indices, loss, losses, metrics)

    @torch.no_grad()
    def fold_activation_scales(self, input_scale: float, output_scale: float = 1.0) -> MLPReplacement:
        """In place: a layer trained to map ``input_scale * x`` to ``output_scale * y`` becomes one that
        maps raw x to raw y, with the same units selected. The codes are divided by ``output_scale``
        (TopK and ReLU commute with a positive scale), so unit-norm decoder rows stay unit-norm:
        W_enc *= s_in / s_out, b_enc /= s_out, b_dec /= s_out, and each subclass folds its own dense
        parts (``fold_dense``). Returns self."""
        if not (input_scale > 0 and output_scale > 0):
            raise ValueError(f"scales must be positive, got input {input_scale}, output {output_scale}")
        self.W_enc.mul_(input_scale / output_scale)
        self.b_enc.div_(output_scale)
        self.b_dec.div_(output_scale)
        self.fold_dense(input_scale, output_scale)
        self._stash = None
        return self

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same map in its dense textbook form (full (T, d_sae) codes, plain autograd), for tests
        and benchmarks; slow at real widths. A layer with another selection than TopK overrides it.

        x: (..., d_in) -> (..., d_out)."""
        x = self.process_sae_in(x)
        lead, x2 = x.shape[:-1], x.reshape(-1, self.cfg.d_in)
        codes = ops.topk_encode_dense(x2, self.W_enc, self.b_enc, self.cfg.k, relu=self.relu_codes)
        out = self.output(ops.decode_dense(codes, self.W_dec), self.decode_context(x2))
        return out.reshape(*lead, self.cfg.d_out)

    def _code_hooks_active(self) -> bool:
        return any(
            hp._forward_hooks or hp._forward_pre_hooks
            for hp in (self.hook_sae_acts_pre, self.hook_sae_acts_post, self.hook_sae_recons)
        )

    # -- persistence -----------------------------------------------------------------------------
    @override
    def save_model(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``cfg.json`` and ``sae_weights.safetensors`` (SAELens's format), each atomically."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state_dict = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        weights_path, cfg_path = path / SAE_WEIGHTS_FILENAME, path / SAE_CFG_FILENAME
        fileio.atomic_write(
            weights_path,
            lambda tmp: save_file(state_dict, tmp, metadata={"architecture": self.cfg.architecture()}),
        )
        text = json.dumps(self.cfg.to_dict(), indent=2)
        fileio.atomic_write(cfg_path, lambda tmp: Path(tmp).write_text(text))
        return weights_path, cfg_path

    @override
    def process_state_dict_for_loading(self, state_dict: dict[str, Any]) -> None:
        expected = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state_dict.items()}
        if expected != got:
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            shapes = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
            raise ValueError(
                f"weights do not fit {type(self).__name__}({self.cfg.architecture()!r}): "
                f"missing {missing}, unexpected {extra}, wrong shape "
                f"{[(k, got[k], expected[k]) for k in shapes]}; was the folder saved by another architecture?"
            )


def _registry() -> dict[str, Any]:
    from sae_lens.registry import SAE_CLASS_REGISTRY

    return SAE_CLASS_REGISTRY


def uniform_(t: torch.Tensor, bound: float) -> torch.Tensor:
    """In-place uniform(-bound, bound); a no-op on the meta device (SAELens builds layers there)."""
    if t.device.type != "meta":
        torch.nn.init.uniform_(t, -bound, bound)
    return t


def unit_rows_(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "meta":
        t.div_(t.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return t

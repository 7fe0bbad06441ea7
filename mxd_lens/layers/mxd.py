"""Mixture of Decoders (Oldfield et al., NeurIPS 2025, arXiv 2505.21364).

    z = phi(x E + b_E)                                   MLP form, dense, phi = the host's activation
    z = psi(x E_gate + b_gate) * (x E + b_E)             GLU form (Llama, Gemma, SmolLM, Qwen)
    a = TopK_K(ReLU(x G + b_G))                          N expert coefficients: the codes
    y = (z D) * (a C) + b  =  sum_n a_n (D diag(c_n))^T z + b

Expert n is the full-rank linear map W_n = D diag(c_n) [d_hidden, d_out]. Parameter names:
E = ``W_in``, b_E = ``b_in``, E_gate = ``W_in_gate``, b_gate = ``b_in_gate``, D = ``W_out``,
G = ``W_enc``, b_G = ``b_enc``, C = ``W_dec``, b = ``b_dec`` (SAELens's names where they apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from mxd_lens.layers.activations import get_activation
from mxd_lens.layers.base import LayerConfig, MLPReplacement, uniform_

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer


@dataclass
class MxDConfig(LayerConfig):
    """``d_sae`` is the number of experts N; ``d_hidden`` the dense hidden width H* (the host's)."""

    d_hidden: int = 0
    activation: str = "gelu"
    hidden_form: Literal["mlp", "glu"] = "mlp"

    @classmethod
    def architecture(cls) -> str:
        return "mxd_lens.mxd"

    def __post_init__(self) -> None:
        if not isinstance(self.d_hidden, int) or self.d_hidden <= 0:
            raise ValueError(
                f"MxDConfig.d_hidden must be a positive int (the host MLP width), got {self.d_hidden!r}"
            )
        get_activation(self.activation)
        if self.hidden_form not in ("mlp", "glu"):
            raise ValueError(f"MxDConfig.hidden_form must be 'mlp' or 'glu', got {self.hidden_form!r}")
        super().__post_init__()

    @property
    def n_experts(self) -> int:
        return self.d_sae


class MxD(MLPReplacement[MxDConfig]):
    """A sparse mixture of N full-rank linear experts over the host MLP's hidden layer."""

    config_class = MxDConfig
    label = "MxD"

    W_in: nn.Parameter
    b_in: nn.Parameter
    W_out: nn.Parameter
    W_enc: nn.Parameter
    b_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter

    def initialize_weights(self) -> None:
        cfg, kw = self.cfg, {"dtype": self.dtype, "device": self.device}
        self.phi = get_activation(cfg.activation)
        # E, G: nn.Linear's default scale; biases zero; D = 0 so step 0 outputs b and only D, b learn.
        self.W_in = nn.Parameter(uniform_(torch.empty(cfg.d_in, cfg.d_hidden, **kw), cfg.d_in**-0.5))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_hidden, **kw))
        if cfg.hidden_form == "glu":
            self.W_in_gate = nn.Parameter(uniform_(torch.empty(cfg.d_in, cfg.d_hidden, **kw), cfg.d_in**-0.5))
            self.b_in_gate = nn.Parameter(torch.zeros(cfg.d_hidden, **kw))
        self.W_out = nn.Parameter(torch.zeros(cfg.d_hidden, cfg.d_out, **kw))
        # G as nn.Linear; C with unit-norm rows (the a_n * c_n scale symmetry makes this free).
        self._init_dictionary()

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """z [..., d_hidden]: the dense hidden layer, phi(x E + b_E) or its GLU form."""
        up = x @ self.W_in + self.b_in
        if self.cfg.hidden_form == "glu":
            return self.phi(x @ self.W_in_gate + self.b_in_gate) * up
        return self.phi(up)

    def _decode_context(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden(x) @ self.W_out  # z D [T, d_out]: all that decode needs from x

    def _output(self, mixture: torch.Tensor, zD: torch.Tensor) -> torch.Tensor:
        return zD * mixture + self.b_dec

    def _aux_output(self, mixture: torch.Tensor, zD: torch.Tensor) -> torch.Tensor:
        # AuxK for MxD: the dead experts' coefficients through the same hidden layer, held fixed so
        # that only the dead experts' gate columns and C rows learn from it.
        return zD.detach() * mixture

    def _fold_dense(self, input_scale: float, output_scale: float) -> None:
        # z = phi(s x E + b_E) reads raw x with E *= s; D and C are untouched (the codes carry 1/s_out).
        self.W_in.mul_(input_scale)
        if self.cfg.hidden_form == "glu":
            self.W_in_gate.mul_(input_scale)

    def expert_weights(self, n: int) -> torch.Tensor:
        """W_n = D diag(c_n) [d_hidden, d_out]: expert n as the linear map it applies to z."""
        return self.W_out * self.W_dec[n]

    @classmethod
    def config_for_stream(cls, info: Any, width: int, **common: Any) -> MxDConfig:
        """The experts that cost as many parameters as a ``width``-latent transcoder (``match_experts``),
        over a hidden layer as wide as the host's, in its form (GLU for gated hosts)."""
        from mxd_lens.matching import match_experts

        n = match_experts(width, info.d_in, info.d_out, info.d_hidden, glu=info.gated)
        return MxDConfig(
            d_sae=n,
            d_hidden=info.d_hidden,
            activation=info.activation,
            hidden_form="glu" if info.gated else "mlp",
            **common,
        )

    @classmethod
    def _model_defaults(cls, model: HookedTransformer) -> dict[str, object]:
        return {
            "d_hidden": model.cfg.d_mlp,
            "activation": model.cfg.act_fn,
            "hidden_form": "glu" if model.cfg.gated_mlp else "mlp",
        }

    @classmethod
    def from_mlp(cls, model: HookedTransformer, block: int, n_experts: int | None = None, k: int = 1) -> MxD:
        """An MxD that computes block ``block``'s MLP exactly: E copied, D = sqrt(d_out) W_out and
        every c_n = 1 / sqrt(d_out) (unit rows, as training keeps them), expert 0 always on with
        coefficient 1 (G = 0, b_G = e_0). It shows MxD contains the MLP, and is a warm start for
        training (hand it to ``Trainer`` as it is)."""
        from mxd_lens import hooks

        mlp = hooks.dense_mlp(model, block)
        n_experts = k if n_experts is None else n_experts
        gated = bool(model.cfg.gated_mlp)
        cfg = MxDConfig(
            d_in=model.cfg.d_model,
            d_out=model.cfg.d_model,
            d_sae=n_experts,
            k=k,
            d_hidden=model.cfg.d_mlp,
            activation=model.cfg.act_fn,
            hidden_form="glu" if gated else "mlp",
            dtype=str(mlp.W_in.dtype).removeprefix("torch."),
            device=str(mlp.W_in.device),
            metadata=hooks.layer_metadata(model, block),
        )
        mxd = cls(cfg)
        mxd.copy_hidden_from_mlp(model, block)
        with torch.no_grad():
            mxd.W_enc.zero_()
            mxd.b_enc.zero_()
            mxd.b_enc[0] = 1.0
            mxd.W_dec.fill_(cfg.d_out**-0.5)
            mxd.W_out.mul_(cfg.d_out**0.5)
            mlp = hooks.dense_mlp(model, block)
            # TransformerLens's gated MLP adds b_in after the product: (act(x Wg) * (x Wi) + b_in) W_out.
            # Our b_E sits inside the product, so it stays 0 and b_in W_out is folded into b.
            mxd.b_dec.copy_(mlp.b_out + mlp.b_in @ mlp.W_out if gated else mlp.b_out)
        return mxd

    @torch.no_grad()
    def copy_hidden_from_mlp(self, model: HookedTransformer, block: int) -> MxD:
        """Set E, b_E (and the GLU gate) and D to block ``block``'s MLP weights: the warm start."""
        from mxd_lens import hooks

        mlp = hooks.dense_mlp(model, block)
        gated = bool(model.cfg.gated_mlp)
        if (self.cfg.hidden_form == "glu") != gated or tuple(mlp.W_in.shape) != tuple(self.W_in.shape):
            raise ValueError(
                f"this MxD ({self.cfg.hidden_form}, W_in {tuple(self.W_in.shape)}) does not match block {block}'s "
                f"MLP ({'gated' if gated else 'plain'}, W_in {tuple(mlp.W_in.shape)})"
            )
        self.W_in.copy_(mlp.W_in)
        self.W_out.copy_(mlp.W_out)
        if gated:
            self.W_in_gate.copy_(mlp.W_gate)
            self.b_in.zero_()
            self.b_in_gate.zero_()
        else:
            self.b_in.copy_(mlp.b_in)
        return self

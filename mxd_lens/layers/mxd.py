"""Mixture of Decoders (Oldfield et al., NeurIPS 2025, arXiv 2505.21364).

    z = phi(x E + b_E)                                   MLP form, dense, phi = the host's activation
    z = psi(x E_gate + b_gate) * (x E + b_E)             GLU form (Llama, Gemma, SmolLM, Qwen)
    a = TopK_K(ReLU(x G + b_G))                          N expert coefficients: the codes (gate "relu_topk")
    a = TopK_K(x G + b_G)                                signed codes (gate "topk")
    y = (z D) * (a C) + b  =  sum_n a_n (D diag(c_n))^T z + b

Expert n is the full-rank linear map W_n = D diag(c_n) [d_hidden, d_out]. Parameter names:
E = ``W_in``, b_E = ``b_in``, E_gate = ``W_in_gate``, b_gate = ``b_in_gate``, D = ``W_out``,
G = ``W_enc``, b_G = ``b_enc``, C = ``W_dec``, b = ``b_dec`` (SAELens's names where they apply).

Why the gate matters (measured, docs/results.md): z D has the host MLP's form and width, so it can fit
the target with one always-on expert; the experts then act as a per-token gain, and with a ReLU before
the TopK an expert pushed below zero on a token gets no gradient there. The paper's gate
(``relu_topk``) decays to about a dozen always-on experts and an L0 far below K. Two remedies, each an
option that leaves the equations as they are at inference:

- ``gate="topk"``: no ReLU. Every selected code is non-zero (signed) and passes its gradient.
- ``balance_rate`` > 0: the auxiliary-loss-free load balancing of MoE routers (Wang et al. 2024,
  DeepSeek-V3): after each optimiser step, outside the gradient, b_G[n] += rate * sign(target - u_n),
  with u_n the fraction of the step's tokens on which expert n is active (non-zero code) and the
  target ``balance_target`` (default K / N: every expert on equally often). An expert used too often
  is made harder to select, a dead one easier, and (with the ReLU) a pushed-out one positive again.
- ``gate_standardize`` = r > 0: after each optimiser step, outside the gradient, each expert's gate
  column is moved a fraction r of the way toward zero mean and unit variance of its pre-activation
  over the step's tokens (b_G[n] -= r mu_n, then G[:, n], b_G[n] /= s_n^r, s_n the std): the TopK
  then compares z-scores, and an expert can be in a token's TopK only where it is unusually high.
  With every pre-activation at mean 0 and variance 1, an expert above a threshold t > 0 on a
  fraction p of tokens needs p <= 1 / (1 + t^2) (Cantelli), and t is about 2.2 for the 32nd largest
  of 2,302 standard normals: an always-on expert (p > 1/2) is ruled out unless most others collapse
  too. A training-time constraint (like unit-norm decoder rows): the saved layer is the same map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn
from typing_extensions import override

from mxd_lens.layers.base import LayerConfig, MLPReplacement, uniform_
from mxd_lens.layers.nonlinearity import get_activation
from mxd_lens.saved_layers import BUILT_IN  # the built-in labels, spelled once (read without torch)

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

    from mxd_lens.hooks import Writes


@dataclass
class MxDConfig(LayerConfig):
    """``d_sae`` is the number of experts N; ``d_hidden`` the dense hidden width H* (the host's)."""

    d_hidden: int = 0
    activation: str = "gelu"
    hidden_form: Literal["mlp", "glu"] = "mlp"
    gate: Literal["relu_topk", "topk"] = "relu_topk"  # layers saved before the option load as "relu_topk"
    balance_rate: float = 0.0  # the usage controller's step on b_G per optimiser step (0: off)
    balance_target: float | None = None  # each expert's target fraction of tokens, in (0, 1]; None: K / N
    gate_standardize: float = 0.0  # per step, the fraction of the way to standardised gate pre-activations
    variant_fields: ClassVar[tuple[str, ...]] = ("gate", "balance_rate", "balance_target", "gate_standardize")

    @override
    @classmethod
    def architecture(cls) -> str:
        return "mxd_lens.mxd"

    @override
    def __post_init__(self) -> None:
        if not isinstance(self.d_hidden, int) or self.d_hidden <= 0:
            raise ValueError(
                f"MxDConfig.d_hidden must be a positive int (the host MLP width), got {self.d_hidden!r}"
            )
        get_activation(self.activation)
        if self.hidden_form not in ("mlp", "glu"):
            raise ValueError(f"MxDConfig.hidden_form must be 'mlp' or 'glu', got {self.hidden_form!r}")
        if self.gate not in GATES:
            raise ValueError(
                f"MxDConfig.gate {self.gate!r} is unknown: choose {' or '.join(map(repr, GATES))} "
                "(relu_topk: the paper's TopK(ReLU(x G + b_G)); topk: TopK(x G + b_G), signed codes)"
            )
        if not (isinstance(self.balance_rate, (int, float)) and 0 <= self.balance_rate < float("inf")):
            raise ValueError(
                f"MxDConfig.balance_rate must be a finite number >= 0 (0 turns the usage controller off), "
                f"got {self.balance_rate!r}"
            )
        if self.balance_target is not None and not (
            isinstance(self.balance_target, (int, float)) and 0 < self.balance_target <= 1
        ):
            raise ValueError(
                f"MxDConfig.balance_target must be a fraction of tokens in (0, 1] (or None for K / N), "
                f"got {self.balance_target!r}"
            )
        if not (isinstance(self.gate_standardize, (int, float)) and 0 <= self.gate_standardize <= 1):
            raise ValueError(
                "MxDConfig.gate_standardize must be a fraction in [0, 1] (the step toward zero mean and unit "
                f"variance of each expert's gate pre-activation; 0: off), got {self.gate_standardize!r}"
            )
        super().__post_init__()

    @property
    def n_experts(self) -> int:
        return self.d_sae

    @property
    def usage_target(self) -> float:
        """The fraction of tokens the usage controller steers each expert toward."""
        return self.balance_target if self.balance_target is not None else self.k / self.d_sae


GATES = ("relu_topk", "topk")


class MxD(MLPReplacement[MxDConfig]):
    """A sparse mixture of N full-rank linear experts over the host MLP's hidden layer."""

    config_class = MxDConfig
    label = BUILT_IN["mxd_lens.mxd"].label

    W_in: nn.Parameter
    b_in: nn.Parameter
    W_out: nn.Parameter
    W_enc: nn.Parameter
    b_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter

    @override
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
        self.init_dictionary()

    @property
    @override
    def relu_codes(self) -> bool:
        return self.cfg.gate == "relu_topk"

    @property
    @override
    def wants_pre_moments(self) -> bool:  # type: ignore[override]
        return self.cfg.gate_standardize > 0

    @override
    @torch.no_grad()
    def after_step(self, values: torch.Tensor, indices: torch.Tensor) -> dict[str, float]:
        """The gate standardisation (``gate_standardize`` > 0, from the step's pre-activation moments),
        then the usage controller (``balance_rate`` > 0): b_G[n] += rate * sign(target - u_n), u_n the
        fraction of these tokens on which expert n is active. Under torch.distributed the counts and
        moments are summed over ranks, so every rank applies the same step. Logs the step's largest usage
        (``usage_max``) and the fraction of experts off on every token of it (``usage_off``)."""
        metrics = self._standardize_gate() if self.cfg.gate_standardize > 0 else {}
        if self.cfg.balance_rate <= 0:
            return metrics
        import torch.distributed as dist

        active = indices[values != 0]
        counts = torch.bincount(active.reshape(-1), minlength=self.cfg.d_sae).to(self.b_enc.dtype)
        tokens = torch.tensor(float(values.reshape(-1, values.shape[-1]).shape[0]), device=counts.device)
        if dist.is_initialized():
            dist.all_reduce(counts)
            dist.all_reduce(tokens)
        usage = counts / tokens
        self.b_enc.add_(torch.sign(self.cfg.usage_target - usage), alpha=self.cfg.balance_rate)
        return {**metrics, "usage_max": float(usage.max()), "usage_off": float((usage == 0).float().mean())}

    def _standardize_gate(self) -> dict[str, float]:
        """b_G -= r mu; (G, b_G) /= s^r with mu, s^2 the mean and variance of each expert's gate
        pre-activation over the last training batch (``pre_moments``, measured before the optimiser
        step; r = ``gate_standardize``). Logs the spread it corrected: the largest |mu| and |log s|."""
        if self.pre_moments is None:
            raise RuntimeError(
                "MxD(gate_standardize > 0).after_step needs the gate's pre-activation moments of the step: "
                "call training_forward_pass first (the Trainer does)"
            )
        import torch.distributed as dist

        mean, mean_sq, n_tokens = self.pre_moments
        moments = torch.stack([mean * n_tokens, mean_sq * n_tokens]).to(self.b_enc.dtype)
        count = torch.tensor(float(n_tokens), dtype=moments.dtype, device=moments.device)
        if dist.is_initialized():
            dist.all_reduce(moments)
            dist.all_reduce(count)
        mean, mean_sq = moments / count
        std = (mean_sq - mean.square()).clamp_min(1e-12).sqrt()
        rate = self.cfg.gate_standardize
        scale = std.pow(-rate)
        self.b_enc.sub_(rate * mean).mul_(scale)
        self.W_enc.mul_(scale)
        self.pre_moments = None
        return {"gate_mean_max": float(mean.abs().max()), "gate_log_std_max": float(std.log().abs().max())}

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """z [..., d_hidden]: the dense hidden layer, phi(x E + b_E) or its GLU form."""
        up = x @ self.W_in + self.b_in
        if self.cfg.hidden_form == "glu":
            return self.phi(x @ self.W_in_gate + self.b_in_gate) * up
        return self.phi(up)

    @override
    def decode_context(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, d_in) -> z D: (T, d_out), all that decode needs from x."""
        return self.hidden(x) @ self.W_out

    @override
    def output(self, mixture: torch.Tensor, zD: torch.Tensor) -> torch.Tensor:
        """mixture: (T, d_out) = a C, zD: (T, d_out) -> (z D) * (a C) + b: (T, d_out)."""
        return zD * mixture + self.b_dec

    @override
    def aux_output(self, mixture: torch.Tensor, zD: torch.Tensor) -> torch.Tensor:
        """mixture: (T, d_out), the dead experts' a C; zD: (T, d_out) -> (z D) * (a C): (T, d_out), the
        hidden layer held fixed so that only the dead experts' gate columns and C rows learn from it."""
        return zD.detach() * mixture

    @override
    def fold_dense(self, input_scale: float, output_scale: float) -> None:
        # z = phi(s x E + b_E) reads raw x with E *= s; D and C are untouched (the codes carry 1/s_out).
        self.W_in.mul_(input_scale)
        if self.cfg.hidden_form == "glu":
            self.W_in_gate.mul_(input_scale)

    copies_host_mlp = True

    @override
    @torch.no_grad()
    def scale_copied_mlp(self, input_scale: float, output_scale: float) -> None:
        # The host MLP reads raw x and writes raw y: on s_in x, E / s_in; to write s_out y, D * s_out.
        self.W_in.div_(input_scale)
        if self.cfg.hidden_form == "glu":
            self.W_in_gate.div_(input_scale)
        self.W_out.mul_(output_scale)
        self._stash = None

    def expert_weights(self, n: int) -> torch.Tensor:
        """W_n = D diag(c_n) [d_hidden, d_out]: expert n as the linear map it applies to z."""
        return self.W_out * self.W_dec[n]

    @override
    @classmethod
    def config_for_stream(cls, info: Any, width: int, **common: Any) -> MxDConfig:
        """The experts that cost as many parameters as a ``width``-latent transcoder (``match_experts``),
        over a hidden layer as wide as the host's (or ``d_hidden`` in ``common``: then N grows to keep
        the parameters matched), in its form (GLU for gated hosts); other ``common`` fields (``gate``,
        ``balance_rate``) pass through."""
        from mxd_lens.matching import match_experts

        d_hidden = common.pop("d_hidden", info.d_hidden)  # a narrower dense path gets more experts
        n = match_experts(width, info.d_in, info.d_out, d_hidden, glu=info.gated)
        common.setdefault("activation", info.activation)
        common.setdefault("hidden_form", "glu" if info.gated else "mlp")
        return MxDConfig(d_sae=n, d_hidden=d_hidden, **common)

    @override
    @classmethod
    def model_defaults(cls, model: HookedTransformer) -> dict[str, object]:
        return {
            "d_hidden": model.cfg.d_mlp,
            "activation": model.cfg.act_fn,
            "hidden_form": "glu" if model.cfg.gated_mlp else "mlp",
        }

    @classmethod
    def from_mlp(
        cls,
        model: HookedTransformer,
        block: int,
        n_experts: int | None = None,
        k: int = 1,
        writes: Writes | None = None,
    ) -> MxD:
        """An MxD that computes block ``block``'s MLP exactly: E copied, D = sqrt(d_out) W_out and
        every c_n = 1 / sqrt(d_out) (unit rows, as training keeps them), expert 0 always on with
        coefficient 1 (G = 0, b_G = e_0). It shows MxD contains the MLP, and is a warm start for
        training (hand it to ``Trainer`` as it is). It writes at ``writes`` (default
        ``mxd_lens.hooks.default_writes``: the MLP module on Gemma-2/3 and OLMo-2/3, whose blocks
        normalise the MLP's output before ``hook_mlp_out``, which no MxD computes; else hook_mlp_out)."""
        from mxd_lens import hooks

        writes = hooks.default_writes(model) if writes is None else writes
        mlp = hooks.dense_mlp(model, block, writes)
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
            metadata=hooks.layer_metadata(model, block, writes),
        )
        mxd = cls(cfg)
        mxd.copy_hidden_from_mlp(model, block)
        with torch.no_grad():
            mxd.W_enc.zero_()
            mxd.b_enc.zero_()
            mxd.b_enc[0] = 1.0
            mxd.W_dec.fill_(cfg.d_out**-0.5)
            mxd.W_out.mul_(cfg.d_out**0.5)
            # TransformerLens's gated MLP adds b_in after the product: (act(x Wg) * (x Wi) + b_in) W_out.
            # Our b_E sits inside the product, so it stays 0 and b_in W_out is folded into b.
            mxd.b_dec.copy_(mlp.b_out + mlp.b_in @ mlp.W_out if gated else mlp.b_out)
        return mxd

    @override
    @torch.no_grad()
    def copy_hidden_from_mlp(self, model: HookedTransformer, block: int) -> MxD:
        """Set E, b_E (and the GLU gate) and D to block ``block``'s MLP weights: the warm start. Refused
        for a layer writing ``hook_mlp_out`` of a block that normalises the MLP's output (the copy would
        not be what it is trained to write: ``mxd_lens.hooks.dense_mlp``)."""
        from mxd_lens import hooks

        parsed = hooks.parse_out_hook(self.cfg.metadata.hook_name_out)
        mlp = hooks.dense_mlp(model, block, parsed[1] if parsed else hooks.default_writes(model))
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

"""BatchTopK transcoder: a transcoder whose sparsity is kept over the training batch, not per token
(Bussmann et al. 2024, "BatchTopK Sparse Autoencoders"; SAELens's ``batchtopk`` architecture, which
SAELens recommends over plain TopK).

    pre = x W_enc + b_enc                                  [T, d_sae]
    training:   f = BatchTopK_{T*K}(ReLU(pre))             the T*K largest entries of the whole batch
    inference:  f = ReLU(pre) * 1[pre > threshold]         JumpReLU at the learned threshold
    y = f W_dec + b_dec

In training a batch of T tokens keeps T*K codes, so L0 is K on average and varies per token. The
threshold makes inference per token (a token's codes do not depend on the rest of its batch): after
each optimiser step, outside the gradient, it moves toward the smallest positive code the step kept,

    threshold <- (1 - r) * threshold + r * min_{kept f > 0} f,      r = topk_threshold_lr (0.01), start 0,

SAELens's ``BatchTopKTrainingSAE.update_topk_threshold`` rule (``sae_lens/saes/batchtopk_sae.py``).
SAELens keeps one scalar (``topk_threshold``) and writes it as the per-unit ``threshold`` [d_sae] of
the JumpReLU SAE it saves; here the layer keeps that per-unit ``threshold`` buffer itself (every entry
equal in training), saved with the weights in ``sae_weights.safetensors``, so a checkpoint resumes it
and ``fold_W_dec_norm`` can scale it per unit. Before any training step the threshold is 0 and
inference is a plain ReLU (every positive unit fires), as in SAELens.

Selection reads the raw pre-activations, like our TopK transcoder; SAELens's default
(``rescale_acts_by_decoder_norm``) multiplies them by the decoder row norms first, which is the same
thing with the unit-norm decoder rows the trainer keeps (``unit_norm_decoder``).

Codes come as (values, indices) [T, m] padded with zeros (``ops.select_rows``), m the most codes any
token of the batch has, so the K-row decoder (``ops.decode_rows``) and the sparse encoder backward
serve both modes without a dense [T, d_sae] product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from mxd_lens.layers import ops
from mxd_lens.layers.base import LayerConfig, MLPReplacement
from mxd_lens.saved_layers import BUILT_IN  # the built-in labels, spelled once (read without torch)


@dataclass
class BatchTopKTranscoderConfig(LayerConfig):
    """``k``: the codes per token on average over a training batch (an int, as everywhere here; SAELens
    also takes fractions). ``topk_threshold_lr``: the step of the threshold's moving average."""

    topk_threshold_lr: float = 0.01
    variant_fields: ClassVar[tuple[str, ...]] = ("topk_threshold_lr",)

    @override
    @classmethod
    def architecture(cls) -> str:
        return "mxd_lens.batchtopk_transcoder"

    @override
    def __post_init__(self) -> None:
        rate = self.topk_threshold_lr
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(
                f"BatchTopKTranscoderConfig.topk_threshold_lr must be in (0, 1] (the step of the threshold's "
                f"moving average), got {rate!r}"
            )
        super().__post_init__()


class BatchTopKTranscoder(MLPReplacement[BatchTopKTranscoderConfig]):
    """BatchTopK transcoder: batch-level TopK in training, JumpReLU at the learned threshold otherwise."""

    config_class = BatchTopKTranscoderConfig
    label = BUILT_IN["mxd_lens.batchtopk_transcoder"].label
    needs_decode_context = False
    W_enc: nn.Parameter
    b_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter
    threshold: torch.Tensor

    @override
    def initialize_weights(self) -> None:
        self.init_dictionary()
        self.register_buffer("threshold", torch.zeros(self.cfg.d_sae, dtype=self.dtype, device=self.device))

    @override
    def output(self, mixture: torch.Tensor, context: None) -> torch.Tensor:
        """mixture: (T, d_out) -> mixture + b_dec: (T, d_out)."""
        return mixture + self.b_dec

    # -- inference: JumpReLU ---------------------------------------------------------------------
    @override
    def select_codes(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pre: (..., d_sae) -> (values, indices), each (..., m): the entries above the threshold, m the
        most of any row (padded with zero values)."""
        return ops.select_rows(pre, pre.detach() > self.threshold)

    @override
    def sparse_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, d_in) -> (values, indices), each (T, m): JumpReLU at the threshold, padded as above."""
        return ops.threshold_encode(x, self.W_enc, self.b_enc, self.threshold)[:2]

    @override
    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The inference map in its dense textbook form: ``(ReLU(pre) * 1[pre > threshold]) W_dec + b_dec``.

        x: (..., d_in) -> (..., d_out)."""
        x = self.process_sae_in(x)
        codes = ops.threshold_dense(x, self.W_enc, self.b_enc, self.threshold)
        return self.output(ops.decode_dense(codes, self.W_dec), None)

    # -- training: BatchTopK -------------------------------------------------------------------------
    @override
    def training_encode(
        self, x: torch.Tensor, aux_mask: torch.Tensor | None, k_aux: int, pre_moments: list | None
    ) -> ops.EncoderOutput:
        """x: (T, d_in) -> the T*K largest of ReLU(x W_enc + b_enc) over the whole batch as values,
        indices (T, m) (padded), with the AuxK selection (T, k_aux)."""
        import torch.distributed as dist

        return ops.batch_topk_encode(
            x, self.W_enc, self.b_enc, self.cfg.k, aux_mask, k_aux, distributed=dist.is_initialized()
        )

    @override
    @torch.no_grad()
    def after_step(self, values: torch.Tensor, indices: torch.Tensor) -> dict[str, float]:
        """The threshold's step toward the smallest positive code of the training batch (``values``
        [T, m], the codes ``training_forward_pass`` kept): SAELens's rule, in float64. Under
        torch.distributed the smallest over all ranks, so every rank keeps the same threshold. Logs the
        threshold."""
        import torch.distributed as dist

        positive = values[values > 0]
        smallest = (positive.min() if positive.numel() else values.new_tensor(float("inf"))).double()
        if dist.is_initialized():
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        if torch.isfinite(smallest):
            rate = self.cfg.topk_threshold_lr
            self.threshold.copy_((1 - rate) * self.threshold.double() + rate * smallest)
        return {"threshold": float(self.threshold.max())}

    # -- scales and folds ------------------------------------------------------------------------
    @override
    def fold_dense(self, input_scale: float, output_scale: float) -> None:
        # the pre-activations are divided by output_scale (base class): the threshold with them
        self.threshold.div_(output_scale)

    @override
    @torch.no_grad()
    def fold_W_dec_norm(self) -> None:
        """Unit-norm decoder rows with the same map: W_dec[n] /= s_n, W_enc[:, n] and b_enc[n] *= s_n
        (SAELens's fold), and the threshold[n] *= s_n with them, as SAELens's JumpReLU transcoder does."""
        norms = self.fold_and_get_W_dec_norm()
        self.threshold.mul_(norms)
        self._stash = None

    @override
    def process_state_dict_for_loading(self, state_dict: dict[str, Any]) -> None:
        super().process_state_dict_for_loading(state_dict)
        threshold = state_dict["threshold"]
        if not bool(torch.isfinite(threshold).all()) or bool((threshold < 0).any()):
            raise ValueError(
                "the saved BatchTopK threshold must be finite and >= 0 (the moving average of positive codes); "
                f"got values from {float(threshold.min())} to {float(threshold.max())}"
            )

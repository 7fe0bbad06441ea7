"""TopK transcoder and skip transcoder: the paper's baselines.

    f = TopK_K(ReLU(x W_enc + b_enc))     [..., d_sae] latents: the codes
    y = f W_dec + b_dec                    TopKTranscoder
    y = f W_dec + b_dec + x W_skip         TopKSkipTranscoder (W_skip [d_in, d_out], no bias)

Unlike SAELens's inference-only ``skip_transcoder``, ``decode(encode(x))`` includes the skip term
(encode stashes x), so splicing through ``HookedSAETransformer`` gives the same output as forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from typing_extensions import override

from mxd_lens.layers.base import LayerConfig, MLPReplacement
from mxd_lens.saved_layers import BUILT_IN  # the built-in labels, spelled once (read without torch)


@dataclass
class TopKTranscoderConfig(LayerConfig):
    @override
    @classmethod
    def architecture(cls) -> str:
        return "mxd_lens.topk_transcoder"


@dataclass
class TopKSkipTranscoderConfig(TopKTranscoderConfig):
    @override
    @classmethod
    def architecture(cls) -> str:
        return "mxd_lens.skip_transcoder"


class TopKTranscoder(MLPReplacement[TopKTranscoderConfig]):
    """TopK transcoder: a sparse dictionary from the MLP input to the MLP output."""

    config_class = TopKTranscoderConfig
    label = BUILT_IN["mxd_lens.topk_transcoder"].label
    needs_decode_context = False
    W_enc: nn.Parameter
    b_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter

    @override
    def initialize_weights(self) -> None:
        self.init_dictionary()

    @override
    def output(self, mixture: torch.Tensor, context: None) -> torch.Tensor:
        """mixture: (T, d_out) -> mixture + b_dec: (T, d_out)."""
        return mixture + self.b_dec


class TopKSkipTranscoder(MLPReplacement[TopKSkipTranscoderConfig]):
    """TopK transcoder plus a dense linear skip path ``x W_skip``."""

    config_class = TopKSkipTranscoderConfig
    label = BUILT_IN["mxd_lens.skip_transcoder"].label
    # The decoder starts at zero: unit rows are undefined there (NaN in the reference).
    unit_norm_decoder = False

    W_enc: nn.Parameter
    b_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter
    W_skip: nn.Parameter

    @override
    def initialize_weights(self) -> None:
        # Zero decoder and skip, as in the reference; unit-norm upkeep must skip zero rows (NaN otherwise).
        self.init_dictionary(zero_decoder=True)
        self.W_skip = nn.Parameter(
            torch.zeros(self.cfg.d_in, self.cfg.d_out, dtype=self.dtype, device=self.device)
        )

    @override
    def decode_context(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, d_in) -> x itself, for the skip path."""
        return x

    @override
    def fold_dense(self, input_scale: float, output_scale: float) -> None:
        self.W_skip.mul_(input_scale / output_scale)

    @override
    def output(self, mixture: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """mixture: (T, d_out), x: (T, d_in) -> mixture + b_dec + x W_skip: (T, d_out)."""
        return mixture + self.b_dec + x @ self.W_skip

"""Hidden-layer activations, by the names TransformerLens uses in ``cfg.act_fn``.

The functions are TransformerLens's own, so an MxD built from a host MLP applies bit-for-bit the
same nonlinearity (``gelu_new`` and ``gelu_pytorch_tanh`` differ in rounding, for instance).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformer_lens.utilities.activation_functions import gelu_fast, gelu_new, gelu_pytorch_tanh

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_new": gelu_new,  # GPT-2's tanh approximation
    "gelu_fast": gelu_fast,
    "gelu_pytorch_tanh": gelu_pytorch_tanh,  # Gemma's tanh approximation
    "silu": F.silu,  # Llama, SmolLM, Qwen (SwiGLU gate)
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)} "
            "(the host MLP's TransformerLens `cfg.act_fn`)"
        ) from None

"""Hidden-layer activations, by the names TransformerLens uses in ``cfg.act_fn``.

The functions are TransformerLens's own (``SUPPORTED_ACTIVATIONS``), so an MxD built from a host MLP
applies bit-for-bit the same nonlinearity (``gelu_new`` and ``gelu_pytorch_tanh`` differ in rounding, for
instance): every parameter-free one TL builds (``relu2``, ReLU², and ``solu``, over the hidden vector, as
TL applies it). Two of TL's are not functions of the hidden layer alone: ``xielu`` (Apertus) has trained
parameters per MLP, and ``solu_ln`` a LayerNorm inside the MLP; a host with either is refused for MxD,
whose hidden layer holds neither (the transcoders do not read the host's activation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

# TL's activations with trained parameters or a norm inside the MLP (the factory builds ``xielu`` as TL's
# XIELU module, alpha_p / alpha_n loaded per block), which an MxD hidden layer cannot hold: why, by name.
_NOT_PARAMETER_FREE = {
    "xielu": "xIELU (Apertus) has trained parameters in each MLP (alpha_p, alpha_n)",
    "solu_ln": "solu_ln has a LayerNorm inside the MLP",
}

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    name: fn for name, fn in SUPPORTED_ACTIVATIONS.items() if name not in _NOT_PARAMETER_FREE
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        pass
    if name in _NOT_PARAMETER_FREE:
        from mxd_lens.layers import ARCHITECTURES

        transcoders = ", ".join(a for a in ARCHITECTURES if a != "mxd")
        raise ValueError(
            f"activation {name!r}: {_NOT_PARAMETER_FREE[name]}, which an MxD's hidden layer does not hold, so no "
            f"MxD is built on this host; the transcoders ({transcoders}) do not use the host's activation and "
            "work on it"
        )
    raise ValueError(
        f"unknown activation {name!r}: not one of TransformerLens's; choose one of {sorted(ACTIVATIONS)} "
        "(the host MLP's TransformerLens `cfg.act_fn`)"
    ) from None

"""Every TransformerLens hook name the project spells, in one place (``mxd_lens.hooks`` says what the MLP
sites mean and splices there; this module only names them, and imports nothing of the project, so the
lowest modules, ``mxd_lens.foreign`` among them, can parse names too).

A block's hook is ``blocks.L.SUFFIX``; the suffixes:

- ``mlp.hook_in`` (:data:`MLP_IN`): the MLP's exact input, what a layer reads (SAELens's name);
- ``hook_mlp_out`` (:data:`MLP_OUT`): the MLP's output as the residual stream receives it;
- ``mlp.hook_out`` (:data:`MLP_MODULE_OUT`): the MLP module's own output (before a post-MLP norm);
- ``ln2.hook_normalized`` and ``hook_mlp_in``: where layers from elsewhere may read (``mxd_lens.foreign``);
- ``mlp.hook_pre``, ``mlp.hook_pre_linear``, ``mlp.hook_post``, ``attn.hook_q/k/v/z``, ``hook_attn_out``,
  ``attn.hook_pattern``, ``hook_resid_pre``: what probing and SPD read and write.
"""

from __future__ import annotations

import re
from typing import Literal

Reads = Literal["mlp", "resid"]
Writes = Literal["hook_mlp_out", "mlp"]
"""Where a layer writes (``mxd_lens.hooks``'s docstring): "hook_mlp_out", ``blocks.L.hook_mlp_out``; "mlp",
the MLP module's own output, ``blocks.L.mlp.hook_out`` (the host's post-MLP norm, if any, runs after it)."""

MLP_IN = "mlp.hook_in"
MLP_OUT = "hook_mlp_out"
MLP_MODULE_OUT = "mlp.hook_out"
WRITE_SUFFIXES: dict[str, str] = {"hook_mlp_out": MLP_OUT, "mlp": MLP_MODULE_OUT}
"""The hook suffix a layer writing at each ``Writes`` site writes (circuit-tracer's ``feature_output_hook``)."""

_OUT_HOOK = re.compile(r"^blocks\.(\d+)\.(hook_mlp_out|mlp\.hook_out)$")
_IN_HOOK = re.compile(r"^blocks\.(\d+)\.(mlp\.hook_in|ln2\.hook_normalized|hook_mlp_in)$")
_WRITES: dict[str, Writes] = {MLP_OUT: "hook_mlp_out", MLP_MODULE_OUT: "mlp"}

EMBED_HOOKS: dict[str, str] = {"embed": "hook_embed", "pos_embed": "hook_pos_embed"}
"""The hooks of what the embeddings add to the residual stream, by kind: the token embedding and the
learned positional embedding (a model with rotary or no positional embeddings never runs the second)."""


def block_hook(block: int, suffix: str) -> str:
    """``blocks.{block}.{suffix}``."""
    return f"blocks.{block}.{suffix}"


def mlp_in_hook(block: int) -> str:
    return block_hook(block, MLP_IN)


def mlp_out_hook(block: int) -> str:
    return block_hook(block, MLP_OUT)


def mlp_module_out_hook(block: int) -> str:
    """The name of the MLP module's own output (``TransformerBridge``'s and circuit-tracer's name)."""
    return block_hook(block, MLP_MODULE_OUT)


def mlp_pre_hook(block: int, linear: bool = False) -> str:
    """The MLP's pre-activation (``mlp.hook_pre``); of a gated MLP's linear branch with ``linear``."""
    return block_hook(block, "mlp.hook_pre_linear" if linear else "mlp.hook_pre")


def mlp_post_hook(block: int) -> str:
    """The MLP's hidden activation, the input of its output weight (``mlp.hook_post``)."""
    return block_hook(block, "mlp.hook_post")


def attn_hook(block: int, kind: Literal["q", "k", "v", "z", "pattern"]) -> str:
    """``blocks.L.attn.hook_{kind}``: queries, keys, values, the heads' outputs before W_O, the pattern."""
    return block_hook(block, f"attn.hook_{kind}")


def attn_out_hook(block: int) -> str:
    return block_hook(block, "hook_attn_out")


def resid_pre_hook(block: int) -> str:
    """The residual stream entering block ``block`` (what a forward with ``start_at_layer=block`` starts from)."""
    return block_hook(block, "hook_resid_pre")


def is_pattern_or_scale(name: str) -> bool:
    """True for the hook of an attention pattern (``blocks.L.attn.hook_pattern``) or of a norm's scale
    (``blocks.L.ln1.hook_scale``, ``ln_final.hook_scale``, ...): what a linearisation at a prompt freezes."""
    return name.endswith(("hook_pattern", "hook_scale"))


def out_hook(block: int, writes: Writes) -> str:
    """The hook name a layer writing at ``writes`` records as ``metadata.hook_name_out``."""
    if writes not in WRITE_SUFFIXES:
        raise ValueError(f"writes={writes!r}: choose 'hook_mlp_out' or 'mlp'")
    return block_hook(block, WRITE_SUFFIXES[writes])


def parse_out_hook(name: object) -> tuple[int, Writes] | None:
    """(block, write site) of an output hook name ``blocks.L.hook_mlp_out`` / ``blocks.L.mlp.hook_out``;
    None for any other name (or None)."""
    match = _OUT_HOOK.match(name) if isinstance(name, str) else None
    return None if match is None else (int(match.group(1)), _WRITES[match.group(2)])


def parse_in_hook(name: object) -> tuple[int, str] | None:
    """(block, suffix) of a name where an MLP replacement may read: ``blocks.L.mlp.hook_in``,
    ``blocks.L.ln2.hook_normalized`` or ``blocks.L.hook_mlp_in``; None for any other name (or None)."""
    match = _IN_HOOK.match(name) if isinstance(name, str) else None
    return None if match is None else (int(match.group(1)), match.group(2))

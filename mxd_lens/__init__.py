"""mxd-lens: sparse, faithful MLP replacements (Mixture of Decoders and transcoders) for
TransformerLens models, in SAELens's format.

    import mxd_lens
    mxd = mxd_lens.MxD.for_model(model, layer=6, d_sae=mxd_lens.match_experts(24576, 768, 768, 3072), k=32)
    with mxd_lens.splice(model, mxd):
        loss = model(tokens, return_type="loss")
"""

from mxd_lens import layers as _layers
from mxd_lens import logs  # noqa: F401 (the mxd_lens logger's default handler)
from mxd_lens.hooks import capture_mlp_io, layer_metadata, splice
from mxd_lens.layers import *  # noqa: F403 (the layer classes and configs, the architecture table)
from mxd_lens.layers.io import load_layer, load_layers
from mxd_lens.matching import match_experts

register()  # noqa: F405

__version__ = "0.1.0"


def __getattr__(name: str):
    from mxd_lens.layers.transcoder import deprecated_name

    return deprecated_name(__name__, name)


__all__ = [
    *_layers.__all__,
    "capture_mlp_io",
    "layer_metadata",
    "load_layer",
    "load_layers",
    "match_experts",
    "splice",
]

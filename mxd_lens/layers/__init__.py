"""Our layers: each a SAELens ``SAE`` subclass with its config, in the one architecture table.

A built-in architecture is its file (the layer and its config class) and, here, the line importing both,
its entry in ``BUILT_IN`` and their two names in ``__all__`` (the one list of names: ``mxd_lens`` resolves
its layer names from it).
"""

from mxd_lens.layers.base import LayerConfig, MLPReplacement
from mxd_lens.layers.batchtopk import BatchTopKTranscoder, BatchTopKTranscoderConfig
from mxd_lens.layers.mxd import MxD, MxDConfig
from mxd_lens.layers.registry import (
    ARCHITECTURES,
    arch_label,
    architecture_key,
    format_arch,
    get_architecture,
    parse_arch,
    register_architecture,
)
from mxd_lens.layers.transcoder import (
    TopKSkipTranscoder,
    TopKSkipTranscoderConfig,
    TopKTranscoder,
    TopKTranscoderConfig,
)

BUILT_IN: dict[str, type[MLPReplacement]] = {
    "mxd": MxD,
    "transcoder": TopKTranscoder,
    "skip_transcoder": TopKSkipTranscoder,
    "batchtopk_transcoder": BatchTopKTranscoder,
}


def register() -> None:
    """Register our architectures (here and with SAELens, so ``SAE.load_from_disk`` /
    ``from_pretrained`` build them). Idempotent, and a re-import replaces stale classes."""
    from mxd_lens.layers.io import name_damaged_files_in_sae_lens_loaders

    for key, layer_cls in BUILT_IN.items():
        register_architecture(key, layer_cls)
    name_damaged_files_in_sae_lens_loaders()


register()  # importing the layers registers them: `import mxd_lens` arranges it when SAELens loads

__all__ = [  # what ``mxd_lens`` resolves from here (tests/test_imports.py: every BUILT_IN class and config)
    "ARCHITECTURES",
    "BUILT_IN",
    "BatchTopKTranscoder",
    "BatchTopKTranscoderConfig",
    "LayerConfig",
    "MLPReplacement",
    "MxD",
    "MxDConfig",
    "TopKSkipTranscoder",
    "TopKSkipTranscoderConfig",
    "TopKTranscoder",
    "TopKTranscoderConfig",
    "arch_label",
    "architecture_key",
    "format_arch",
    "get_architecture",
    "parse_arch",
    "register",
    "register_architecture",
]

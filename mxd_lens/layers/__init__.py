"""Our layers: each a SAELens ``SAE`` subclass with its config, in the one architecture table."""

from mxd_lens import LAYER_NAMES

# Re-exported (``__all__`` is ``mxd_lens.LAYER_NAMES``, so the top-level lazy namespace and this one agree):
from mxd_lens.layers.base import LayerConfig, MLPReplacement  # noqa: F401
from mxd_lens.layers.batchtopk import BatchTopKTranscoder, BatchTopKTranscoderConfig  # noqa: F401
from mxd_lens.layers.mxd import MxD, MxDConfig  # noqa: F401
from mxd_lens.layers.registry import (  # noqa: F401
    ARCHITECTURES,
    arch_label,
    architecture_key,
    format_arch,
    get_architecture,
    parse_arch,
    register_architecture,
)
from mxd_lens.layers.transcoder import (  # noqa: F401
    TopKSkipTranscoder,
    TopKSkipTranscoderConfig,
    TopKTranscoder,
    TopKTranscoderConfig,
)

BUILT_IN = {
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


__all__ = list(LAYER_NAMES)

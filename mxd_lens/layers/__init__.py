"""Our layers: each a SAELens ``SAE`` subclass with its config, registered by ``register()``."""

from mxd_lens.layers.base import LayerConfig, MLPReplacement
from mxd_lens.layers.mxd import MxD, MxDConfig
from mxd_lens.layers.transcoder import SkipTranscoder, SkipTranscoderConfig, Transcoder, TranscoderConfig

LAYER_TYPES: tuple[tuple[type[MLPReplacement], type[LayerConfig]], ...] = (
    (MxD, MxDConfig),
    (Transcoder, TranscoderConfig),
    (SkipTranscoder, SkipTranscoderConfig),
)


def register() -> None:
    """Register our architectures with SAELens so ``SAE.load_from_disk`` / ``from_pretrained`` build
    them. Idempotent, and a re-import (notebook autoreload) replaces stale classes."""
    from sae_lens.registry import SAE_CLASS_REGISTRY

    for layer_cls, config_cls in LAYER_TYPES:
        name = config_cls.architecture()
        current = SAE_CLASS_REGISTRY.get(name)
        if current is not None and current[0].__module__ != layer_cls.__module__:
            raise RuntimeError(f"SAELens architecture {name!r} is already taken by {current[0]!r}")
        SAE_CLASS_REGISTRY[name] = (layer_cls, config_cls)


__all__ = [
    "LayerConfig",
    "MLPReplacement",
    "MxD",
    "MxDConfig",
    "SkipTranscoder",
    "SkipTranscoderConfig",
    "Transcoder",
    "TranscoderConfig",
    "register",
]

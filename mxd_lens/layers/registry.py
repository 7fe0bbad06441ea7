"""The one table of architectures: a key (what the trainer, the CLI, the frontier and tables use) to a
layer class. A layer class carries everything else about its architecture: its config class
(``config_class``, whose ``architecture()`` is the SAELens name in ``cfg.json``), how tables name it
(``label``), whether the trainer keeps its decoder rows at unit norm (``unit_norm_decoder``) and how
to size it for an activation stream (``config_for_stream``).

Adding an architecture is one new file (the layer and its config) and one ``register_architecture``
call (docs/custom_layers.md works one through).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# format_arch (the inverse of parse_arch) and the labels' words live with what reads saved folders
from mxd_lens.saved_layers import format_arch, label_with_options

if TYPE_CHECKING:
    from mxd_lens.layers.base import MLPReplacement

ARCHITECTURES: dict[str, type[MLPReplacement]] = {}


def register_architecture(key: str, layer_cls: type[MLPReplacement]) -> type[MLPReplacement]:
    """Add ``layer_cls`` under ``key`` here and under its config's ``architecture()`` in SAELens's
    registry (so ``SAE.load_from_disk`` builds it). Idempotent; a re-import (notebook autoreload)
    replaces a stale class of the same module. Returns the class, so it can decorate one."""
    from sae_lens.registry import SAE_CLASS_REGISTRY

    from mxd_lens.layers.base import LayerConfig, MLPReplacement

    if not (isinstance(layer_cls, type) and issubclass(layer_cls, MLPReplacement)):
        raise TypeError(f"{layer_cls!r} is not an MLPReplacement subclass")
    config_cls = getattr(layer_cls, "config_class", None)
    if not (isinstance(config_cls, type) and issubclass(config_cls, LayerConfig)):
        raise TypeError(
            f"{layer_cls.__name__}.config_class must be a LayerConfig subclass, not {config_cls!r}"
        )
    if not key.isidentifier():
        raise ValueError(f"architecture key {key!r} must be an identifier (it names files and options)")
    name = config_cls.architecture()
    for other_key, other in ARCHITECTURES.items():
        stale = other.__module__ == layer_cls.__module__ and other.__qualname__ == layer_cls.__qualname__
        if (
            other is not layer_cls
            and not stale
            and (other_key == key or other.config_class.architecture() == name)
        ):
            raise RuntimeError(f"architecture {key!r} / {name!r} is already taken by {other!r}")
    current = SAE_CLASS_REGISTRY.get(name)
    if current is not None and current[0].__module__ != layer_cls.__module__:
        raise RuntimeError(f"SAELens architecture {name!r} is already taken by {current[0]!r}")
    ARCHITECTURES[key] = layer_cls
    SAE_CLASS_REGISTRY[name] = (layer_cls, config_cls)
    return layer_cls


def get_architecture(key: str) -> type[MLPReplacement]:
    """The layer class registered under ``key`` (installed plug-ins are loaded first if it is not
    there yet); a clear error naming the choices otherwise."""
    if key not in ARCHITECTURES:
        load_plugins()
    try:
        return ARCHITECTURES[key]
    except KeyError:
        raise ValueError(
            f"architecture {key!r} unknown; choose one of {list(ARCHITECTURES)} (a third-party one: install "
            "its package, which declares an 'mxd_lens.architectures' entry point, or `mxd-lens --import MODULE`)"
        ) from None


PLUGIN_GROUP = "mxd_lens.architectures"
_PLUGINS_LOADED = False


def load_plugins() -> list[str]:
    """Register the architectures installed packages declare under the entry-point group
    ``mxd_lens.architectures`` (once per process): ``name = "pkg.module:LayerClass"`` registers the class
    under ``name``; ``name = "pkg.module"`` imports the module, which registers its own. Returns the
    names loaded now. A plug-in that fails to load or to register (a taken key or name) is skipped with
    a :class:`mxd_lens.plugins.PluginWarning` naming it, so it breaks no other architecture or verb."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return []
    _PLUGINS_LOADED = True
    from mxd_lens.layers.base import MLPReplacement
    from mxd_lens.plugins import entry_point_objects, skip_plugin

    loaded = []
    for name, value, target in entry_point_objects(PLUGIN_GROUP):
        if isinstance(target, type) and issubclass(target, MLPReplacement) and name not in ARCHITECTURES:
            try:
                register_architecture(name, target)
            except (TypeError, ValueError, RuntimeError) as err:
                skip_plugin(PLUGIN_GROUP, name, value, str(err))
                continue
        loaded.append(name)
    return loaded


def architecture_key(layer: Any) -> str:
    """The key of a layer (an instance or a class); for a SAELens layer from elsewhere (an instance),
    ``sae_lens.<its architecture>``."""
    cls = layer if isinstance(layer, type) else type(layer)
    for key, registered in ARCHITECTURES.items():
        if registered is cls:
            return key
    architecture = getattr(getattr(layer, "cfg", None), "architecture", None)
    if not isinstance(layer, type) and callable(architecture):
        # a SAELens layer from elsewhere (mxd_lens.foreign): its SAELens architecture, prefixed so that
        # SAELens's 'transcoder' (ReLU) is not taken for ours (TopK)
        return f"sae_lens.{architecture()}"
    raise ValueError(f"{cls.__name__} is not a registered architecture; call register_architecture first")


def layer_arch(layer: Any) -> str:
    """The architecture key of a built layer with the options it was built with (its config's variant
    fields that differ from their defaults), as ``parse_arch`` reads it: ``mxd``, ``mxd:gate=topk``."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(layer.cfg)}
    options = {
        name: getattr(layer.cfg, name)
        for name in getattr(layer.cfg, "variant_fields", ())
        if getattr(layer.cfg, name) != defaults[name]
    }
    return format_arch(architecture_key(layer), options)


def parse_arch(text: str) -> tuple[str, dict[str, Any]]:
    """``"KEY"`` or ``"KEY:field=value,field=value"`` as (key, options): an architecture with config
    fields set, e.g. ``"mxd:gate=topk,balance_rate=0.001"`` (what ``--arch`` and the frontier's
    ``archs`` take). Values read as int, float, true/false, none, or else a string."""
    key, sep, rest = text.partition(":")
    options: dict[str, Any] = {}
    if sep:
        for item in rest.split(","):
            name, eq, value = item.partition("=")
            if not eq or not name.strip() or not value.strip():
                raise ValueError(
                    f"architecture {text!r}: write KEY:field=value[,field=value...], e.g. 'mxd:gate=topk'"
                )
            options[name.strip()] = _parse_value(value.strip())
    return key.strip(), options


def arch_label(text: str) -> str:
    """How tables and plots name an architecture with options: ``MxD``, ``MxD (gate=topk)``."""
    key, options = parse_arch(text)
    return label_with_options(ARCHITECTURES[key].label if key in ARCHITECTURES else key, options)


def _parse_value(value: str) -> Any:
    lowered = value.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return value

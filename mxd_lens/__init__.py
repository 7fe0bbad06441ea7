"""mxd-lens: sparse, faithful MLP replacements (Mixture of Decoders and transcoders) for
TransformerLens models, in SAELens's format.

    import mxd_lens
    mxd = mxd_lens.MxD.for_model(model, 6, d_sae=mxd_lens.match_experts(24576, 768, 768, 3072), k=32)
    with mxd_lens.splice(model, mxd):
        loss = model(tokens, return_type="loss")

Importing the package is light (the command line's help answers at once): its names load their modules
on first use, the few in ``_WHERE`` below and every name of ``mxd_lens.layers.__all__`` (``MxD``,
``ARCHITECTURES``, ...), which that package alone lists; ``__all__`` and ``dir()`` import the layers.
Our architectures are registered with SAELens as soon as SAELens is imported (at once if it already
is), so after ``import mxd_lens`` ``SAE.load_from_disk`` / ``SAE.from_pretrained`` build our layers
whichever of the two was imported first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from mxd_lens import logs  # noqa: F401 (the mxd_lens logger's default handler)

__version__ = "0.2.0"

_WHERE = {  # public name -> the module that defines it (every other public name: mxd_lens.layers.__all__)
    **dict.fromkeys(["capture_mlp_io", "layer_metadata", "splice"], "mxd_lens.hooks"),
    **dict.fromkeys(["load_layer", "load_layers"], "mxd_lens.layers.io"),
    "match_experts": "mxd_lens.matching",
}


def _layers() -> Any:
    return importlib.import_module("mxd_lens.layers")  # torch, SAELens: only when a layer name is asked for


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name == "__all__":
        value = sorted({*_WHERE, *_layers().__all__})
    elif name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a private name, or a submodule not imported yet (``from mxd_lens import data`` asks here first):
        # not a layer name, so the (heavy) layers are not imported to look for it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    elif name in _layers().__all__:
        value = getattr(_layers(), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # next time without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_layers().__all__})


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once the module ``name`` has been executed (imported), wherever it is
    imported from; removes itself on first use."""

    def __init__(self, name: str, callback: Any):
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, callback = loader.exec_module, self.callback

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            callback()

        loader.exec_module = exec_then_call
        return spec


def _register() -> None:
    importlib.import_module("mxd_lens.layers")  # registers the built-in architectures with SAELens


if "sae_lens" in sys.modules:
    _register()
elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport("sae_lens", _register))

"""The package root's lazy namespace (issue 45): ``mxd_lens.layers`` alone lists the layer names (its
``__all__``); the root resolves them on first use, and importing the root or its light modules loads no
torch."""

from __future__ import annotations

import subprocess
import sys

HEAVY = "[m for m in ('torch', 'sae_lens', 'transformer_lens', 'pandas') if m in sys.modules]"


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_root_resolves_every_layer_name_from_the_layers_package():
    import mxd_lens
    import mxd_lens.layers as layers
    from mxd_lens import MxD  # noqa: F401 (the from-import form)

    assert mxd_lens.MxD is layers.MxD and mxd_lens.ARCHITECTURES is layers.ARCHITECTURES
    assert set(layers.__all__) <= set(mxd_lens.__all__) and set(mxd_lens.__all__) <= set(dir(mxd_lens))
    for name in layers.__all__:
        assert getattr(mxd_lens, name) is getattr(layers, name), name
    assert {"splice", "load_layer", "match_experts"} <= set(mxd_lens.__all__)
    namespace: dict = {}
    exec("from mxd_lens import *", namespace)
    assert {"MxD", "splice", "TopKTranscoderConfig"} <= set(namespace)


def test_every_built_in_layer_and_its_config_are_exported():
    """Adding a built-in layer: its file, and in layers/__init__.py its import, BUILT_IN entry and names."""
    import mxd_lens.layers as layers

    for key, layer_cls in layers.BUILT_IN.items():
        assert layers.ARCHITECTURES[key] is layer_cls
        for cls in (layer_cls, layer_cls.config_class):
            assert cls.__name__ in layers.__all__ and getattr(layers, cls.__name__) is cls
    assert all(hasattr(layers, name) for name in layers.__all__)
    assert not hasattr(__import__("mxd_lens"), "LAYER_NAMES")  # no second list at the root


def test_importing_the_root_and_its_submodules_stays_light():
    """``import mxd_lens``, ``from mxd_lens import SUBMODULE`` and private look-ups do not import the layers
    (torch): only a layer name does."""
    code = (
        "import sys\nimport mxd_lens\nfrom mxd_lens import cli, config, plugins\n"
        "assert not hasattr(mxd_lens, '_nothing') and not hasattr(mxd_lens, '__wrapped__')\n"
        f"print({HEAVY})\nmxd_lens.MxD\nprint({HEAVY})\n"
    )
    light, heavy = _run(code).splitlines()
    assert light == "[]" and "torch" in heavy and "sae_lens" in heavy


def test_an_unknown_name_is_an_attribute_error():
    import pytest

    import mxd_lens

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        mxd_lens.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        from mxd_lens import no_such_thing  # noqa: F401

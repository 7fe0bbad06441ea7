"""docs/custom_layers.md's worked example, executed as written: a fourth architecture registered with
one line trains from a stream beside the built-in ones, folds its normalisation exactly, saves and
loads through SAELens, and appears wherever the architecture table is read."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import make_model
from sae_lens import SAE
from sae_lens.registry import SAE_CLASS_REGISTRY
from test_activations import random_rows

import mxd_lens
from mxd_lens.activations import ModelActivations
from mxd_lens.cli import build_parser, main
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.layers.registry import layer_arch
from mxd_lens.training import TrainConfig, Trainer

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_layers.md"
KEY = "lowrank_skip_transcoder"


@pytest.fixture
def example():
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    module = types.ModuleType("custom_layers_example")  # a real module: dataclasses look it up
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, str(DOC), "exec"), module.__dict__)
        yield module.__dict__
    finally:
        layer_cls = mxd_lens.ARCHITECTURES.pop(KEY, None)
        if layer_cls is not None:
            SAE_CLASS_REGISTRY.pop(layer_cls.config_class.architecture(), None)
        del sys.modules[module.__name__]


def test_the_documented_architecture_trains_folds_saves_and_loads(example, tmp_path):
    layer_cls = example["LowRankSkipTranscoder"]
    assert mxd_lens.ARCHITECTURES[KEY] is layer_cls
    model = make_model("gated")
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=16)
    specs = [LearnerSpec(KEY, 1, k=4), LearnerSpec("mxd", 1, k=4)]  # beside a built-in, one stream
    config = TrainConfig(total_tokens=2 * 64, batch_tokens=64, lr=3e-3, warmup_steps=1, log_every=1)
    trainer = Trainer(specs, source, config, tmp_path, progress=False)
    metrics = trainer.fit()
    name = specs[0].name
    assert name == "L1.lowrank_skip_transcoder.k4.m8" and metrics[name]["fvu"] > 0
    trained = trainer.learners[name].layer
    assert float(trained.W_skip_v.detach().abs().sum()) > 0  # the skip path learned (it starts at zero)

    # The saved layer reads raw activations: the normalisation is folded exactly (its fold_dense).
    s_in, s_out = trainer.scales[1]
    x, _ = next(source.shards())[1]
    loaded = SAE.load_from_disk(tmp_path / "final" / name)
    assert type(loaded) is layer_cls and loaded.cfg.skip_rank == 8
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trained(x * s_in) / s_out, rtol=1e-5, atol=1e-5)
        # decode(encode(x)) is the same function as forward (the SAELens contract)
        torch.testing.assert_close(loaded.decode(loaded.encode(x)), loaded(x), rtol=1e-5, atol=1e-6)

    # The table is the one place: CLI choices and labels read it.
    args = build_parser().parse_args(
        ["train", "--out", "o", "--cache", "c", "--epochs", "1", "--arch", KEY, "mxd"]
    )
    assert args.run.learners.arch == [KEY, "mxd"]
    # refused before anything is opened (the cache "c" does not exist)
    with pytest.raises(SystemExit, match=f"--arch nope: not a key of mxd_lens.ARCHITECTURES .*'{KEY}'"):
        main(["train", "--out", str(tmp_path / "o"), "--cache", "c", "--epochs", "1", "--arch", "nope"])
    assert layer_arch(loaded) == KEY and mxd_lens.arch_label(KEY) == "Low-rank skip transcoder"


def test_a_taken_name_is_refused(example):
    with pytest.raises(RuntimeError, match="already taken"):
        mxd_lens.register_architecture("mxd", example["LowRankSkipTranscoder"])
    with pytest.raises(TypeError, match="not an MLPReplacement"):
        mxd_lens.register_architecture("other", dict)


def test_the_old_class_names_are_gone():
    """``Transcoder`` & co. (they shadowed SAELens's classes) were renamed ``TopK...`` with no alias."""
    import mxd_lens.layers

    for name in ("Transcoder", "TranscoderConfig", "SkipTranscoder", "SkipTranscoderConfig"):
        assert not hasattr(mxd_lens, name) and not hasattr(mxd_lens.layers, name)
    with pytest.raises(ImportError):
        from mxd_lens.layers import SkipTranscoderConfig  # noqa: F401
    with pytest.raises(AttributeError):
        mxd_lens.NoSuchThing  # noqa: B018


def test_the_documented_architecture_trains_from_the_shell(tmp_path):
    """`mxd-lens --import MODULE train --arch KEY`: the doc's example as a module file, trained by the CLI
    in a subprocess from a small cache."""
    import subprocess

    from mxd_lens.activations import write_cache

    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (tmp_path / "my_layers.py").write_text(block)
    source = ModelActivations(make_model("gated"), [1], random_rows(), context_size=12, rows_per_shard=16)
    write_cache(source, tmp_path / "cache", n_shards=4, progress=False)
    argv = ["--import", "my_layers", "train", "--cache", "cache", "--arch", KEY, "--k", "4", "--tokens", "640",
            "--batch-tokens", "64", "--norm-tokens", "64", "--no-progress", "--out", "run"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "mxd_lens.cli", *argv], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "final" / f"L1.{KEY}.k4.m8" / "cfg.json").is_file()
    refused = subprocess.run(
        [sys.executable, "-m", "mxd_lens.cli", *argv[2:]], cwd=tmp_path, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "--import MODULE" in refused.stderr


def test_an_installed_plugin_is_registered_from_its_entry_point(monkeypatch):
    """An 'mxd_lens.architectures' entry point naming a class registers it on first use of an unknown key."""
    import importlib.metadata

    from mxd_lens.layers import registry

    module = types.ModuleType("plugin_pkg")
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    sys.modules["plugin_pkg"] = module  # a real module: dataclasses look it up
    exec(compile(block.replace("mxd_lens.register_architecture(", "(lambda *a: None)("), "plugin", "exec"),
         module.__dict__)  # fmt: skip
    point = importlib.metadata.EntryPoint(
        "plugged", "plugin_pkg:LowRankSkipTranscoder", registry.PLUGIN_GROUP
    )
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: [point] if group == registry.PLUGIN_GROUP else []
    )
    monkeypatch.setattr(registry, "_PLUGINS_LOADED", False)
    try:
        assert "plugged" not in mxd_lens.ARCHITECTURES
        assert registry.get_architecture("plugged") is module.LowRankSkipTranscoder
        assert LearnerSpec("plugged", 1, k=4, width_multiplier=8).name == "L1.plugged.k4.m8"
    finally:
        layer_cls = mxd_lens.ARCHITECTURES.pop("plugged", None)
        if layer_cls is not None:
            SAE_CLASS_REGISTRY.pop(layer_cls.config_class.architecture(), None)
        del sys.modules["plugin_pkg"]


def test_a_broken_architecture_plugin_is_skipped_with_a_warning_naming_it(monkeypatch):
    """An 'mxd_lens.architectures' entry point that fails to load breaks no other architecture: it is
    skipped with a warning naming it and its error, and its key is then unknown like any other."""
    import importlib.metadata

    from mxd_lens.layers import registry
    from mxd_lens.plugins import PluginWarning

    point = importlib.metadata.EntryPoint("broken_arch", "no_such_package_xyz:Layer", registry.PLUGIN_GROUP)
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: [point] if group == registry.PLUGIN_GROUP else []
    )
    monkeypatch.setattr(registry, "_PLUGINS_LOADED", False)
    skipped = (
        r"skipped the mxd_lens.architectures plug-in 'broken_arch' \(no_such_package_xyz:Layer\): it failed"
    )
    with pytest.warns(PluginWarning, match=skipped) as caught:
        with pytest.raises(ValueError, match="architecture 'broken_arch' unknown"):
            registry.get_architecture("broken_arch")
    assert "ModuleNotFoundError" in str(caught[0].message) and "Traceback" in caught[0].message.details
    assert registry.get_architecture("transcoder") is mxd_lens.TopKTranscoder

"""circuit-tracer export: the exported tensors, applied as circuit-tracer's SingleLayerTranscoder
computes (written out here from its source: F.linear encode, TopK without ReLU, acts @ W_dec + b_dec
+ x @ W_skip.T), reproduce our layers' outputs; the folder is what circuit-tracer 0.5.0's loader
reads (the keys, file names and path resolution below are those of its circuit_tracer/utils/
hf_utils.py, utils/caching.py and transcoder/single_layer_transcoder.py)."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import make_model, randomise
from safetensors.torch import load_file

from mxd_lens.cli import main
from mxd_lens.export import export_circuit_tracer
from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder

# config.yaml keys circuit-tracer 0.5.0 reads for a transcoder set, with the value or type it needs
REQUIRED_KEYS = {
    # hf_utils.py load_transcoders and caching.py load_transcoders_from_cache: config["model_kind"];
    # "transcoder_set" selects per-layer transcoders (else "cross_layer_transcoder", or ValueError)
    "model_kind": "transcoder_set",
    # hf_utils.py load_transcoders: config["scan"] (a KeyError without it), passed to
    # single_layer_transcoder.py load_transcoder_set(scan=) -> TranscoderSet.scan; caching.py
    # load_transcoders_from_cache: config.get("scan", <folder>); hf_utils.py load_transcoder_from_hub
    # overwrites it with the repo id when loading from a hub repository
    "scan": str,
    # hf_utils.py load_transcoders and caching.py load_transcoders_from_cache:
    # config["feature_input_hook"] / config["feature_output_hook"] -> TranscoderSet; the
    # ReplacementModel hooks blocks.{L}.<hook> (mlp.hook_in: its ReplacementMLP's input hook)
    "feature_input_hook": "mlp.hook_in",
    "feature_output_hook": "hook_mlp_out",
}
READ_IF_PRESENT = {
    # __main__.py run_attribution: config.get("model_name") is `circuit-tracer attribute`'s --model
    "model_name": str,
    # hf_utils.py load_transcoders (upstream source after 0.5.0; the 0.5.0 release ignores both):
    # config.get("activation") / config.get("k") -> load_transcoder_set builds TopK(k) for "topk"
    "activation": "topk",
    "k": int,
}
# hf_utils.py resolve_transcoder_paths: a "transcoders" list is read as paths taken verbatim (hf://
# URIs, or paths relative to the working directory, not to config.yaml); without it the loader reads
# layer_{i}.safetensors beside config.yaml. So we write none.
ABSENT_KEYS = {"transcoders"}
# single_layer_transcoder.py load_relu_transcoder: load_state_dict(strict) into SingleLayerTranscoder
TENSORS = {"W_enc", "W_dec", "b_enc", "b_dec"}


def circuit_tracer_cache_path(ref: str, cache_dir: Path) -> Path:
    """Where circuit-tracer 0.5.0 looks for a local set named ``ref`` (caching.py get_cached_path,
    reached from hf_utils.py load_transcoder_from_hub through is_cached): ``ref`` joined onto its
    cache folder ($CIRCUIT_TRACER_CACHE_DIR or ~/.cache/circuit_tracer); it is used if it holds
    config.yaml, and otherwise ``ref`` is tried as a hub repository id."""
    return cache_dir / ref


def local_layer_paths(folder: Path) -> dict[int, str]:
    """caching.py load_transcoders_from_cache: the layer files of a local set and their blocks."""
    return {int(f.stem.split("_")[1]): str(f) for f in sorted(folder.glob("layer_*.safetensors"))}


def hub_layer_paths(snapshot: Path) -> dict[int, str]:
    """hf_utils.py resolve_transcoder_paths without "transcoders": layer_{i} for i below the count
    of layer_*.safetensors in the downloaded repository (snapshot)."""
    count = len(glob.glob(os.path.join(snapshot, "layer_*.safetensors")))
    return {i: os.path.join(snapshot, f"layer_{i}.safetensors") for i in range(count)}


def circuit_tracer_forward(t: dict, x: torch.Tensor, k: int) -> torch.Tensor:
    pre = F.linear(x, t["W_enc"], t["b_enc"])
    _, idx = torch.topk(pre, k=k, dim=-1)
    acts = pre * torch.zeros_like(pre).scatter_(-1, idx, 1.0)
    out = acts @ t["W_dec"] + t["b_dec"]
    return out + x @ t["W_skip"].T if "W_skip" in t else out


@pytest.mark.parametrize("cls", [TopKTranscoder, TopKSkipTranscoder])
def test_export_reproduces_the_layers(cls, tmp_path):
    model = make_model("gated")
    layers = {
        block: randomise(cls.for_model(model, block, d_sae=32, k=4), block, scale=0.2) for block in (0, 1)
    }
    for block, layer in layers.items():
        with torch.no_grad():
            layer.b_enc.fill_(3.0)  # every pre-activation positive: circuit-tracer's TopK (no ReLU) agrees
        layer.save_model(tmp_path / "final" / f"L{block}")
    assert main(["export", str(tmp_path / "final"), "--out", str(tmp_path / "ct")]) == 0
    config = yaml.safe_load((tmp_path / "ct/config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set" and config["activation"] == "topk" and config["k"] == 4
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp.hook_in", "hook_mlp_out")
    x = torch.randn(50, model.cfg.d_model)
    for block, layer in layers.items():
        tensors = load_file(tmp_path / "ct" / f"layer_{block}.safetensors")
        assert tensors["W_enc"].shape == tensors["W_dec"].shape == (32, model.cfg.d_model)
        with torch.no_grad():
            torch.testing.assert_close(circuit_tracer_forward(tensors, x, 4), layer(x), rtol=1e-5, atol=1e-5)


def test_where_fewer_than_k_are_positive_circuit_tracer_keeps_negatives(tmp_path):
    """The documented difference, measured: our TopK runs after a ReLU, circuit-tracer's does not."""
    model = make_model("gated")
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=32, k=4), 1, scale=0.2)
    with torch.no_grad():
        layer.b_enc.fill_(-50.0)  # nothing positive: ours outputs b_dec, circuit-tracer's the 4 largest
    layer.save_model(tmp_path / "L1")
    main(["export", str(tmp_path / "L1"), "--out", str(tmp_path / "ct")])
    tensors = load_file(tmp_path / "ct/layer_1.safetensors")
    x = torch.randn(8, model.cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.b_dec.expand(8, -1))
        assert not torch.allclose(circuit_tracer_forward(tensors, x, 4), layer(x))


def test_mxd_and_mixed_sets_are_refused(tmp_path):
    model = make_model("gated")
    MxD.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "mxd" / "L1")
    with pytest.raises(SystemExit, match="MxD has no transcoder-set form.*input-dependent"):
        main(["export", str(tmp_path / "mxd"), "--out", str(tmp_path / "o")])
    TopKTranscoder.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path / "mixed" / "a")
    TopKTranscoder.for_model(model, 1, d_sae=8, k=3).save_model(tmp_path / "mixed" / "b")
    with pytest.raises(SystemExit, match="one architecture, K and width"):
        main(["export", str(tmp_path / "mixed"), "--out", str(tmp_path / "o2")])


def test_an_earlier_export_is_replaced_whole_and_other_folders_are_refused(tmp_path):
    model = make_model("gated")
    for block in (0, 1):
        TopKTranscoder.for_model(model, block, d_sae=8, k=2).save_model(tmp_path / "both" / f"L{block}")
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "one" / "L1")
    assert main(["export", str(tmp_path / "both"), "--out", str(tmp_path / "ct")]) == 0
    assert main(["export", str(tmp_path / "one"), "--out", str(tmp_path / "ct")]) == 0
    assert sorted(p.name for p in (tmp_path / "ct").iterdir()) == ["config.yaml", "layer_1.safetensors"]
    assert yaml.safe_load((tmp_path / "ct/config.yaml").read_text())["blocks"] == [1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="mine is not empty and is not an earlier mxd-lens export"):
        main(["export", str(tmp_path / "one"), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="file is a file; give a folder"):
        main(["export", str(tmp_path / "one"), "--out", str(tmp_path / "file")])


def test_layers_trained_on_different_models_are_refused(tmp_path):
    model = make_model("gated")
    for block, digest in ((0, "a"), (1, "b")):
        layer = TopKTranscoder.for_model(model, block, d_sae=8, k=2)
        layer.cfg.metadata.training = {"model": {"kind": "gguf", "sha256": digest * 64}}
        layer.save_model(tmp_path / "two" / f"L{block}")
    with pytest.raises(SystemExit, match="for one model, but these layers were trained on different ones"):
        main(["export", str(tmp_path / "two"), "--out", str(tmp_path / "ct")])
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("cls", [TopKTranscoder, TopKSkipTranscoder])
def test_the_folder_is_what_circuit_tracers_loader_reads(cls, tmp_path, monkeypatch):
    model = make_model("gated")
    for block in (0, 1):
        cls.for_model(model, block, d_sae=16, k=3).save_model(tmp_path / "final" / f"L{block}")
    out = export_circuit_tracer(tmp_path / "final", tmp_path / "ct")
    assert out == tmp_path / "ct" and out.is_absolute()
    files = {"config.yaml", "layer_0.safetensors", "layer_1.safetensors"}
    assert {p.name for p in out.iterdir()} == files
    config = yaml.safe_load((out / "config.yaml").read_text())
    for key, want in {**REQUIRED_KEYS, **READ_IF_PRESENT}.items():
        assert key in config, key
        if isinstance(want, type):
            assert isinstance(config[key], want) and config[key] != "", (key, config[key])
        else:
            assert config[key] == want, (key, config[key])
    assert config["k"] == 3 and config["model_name"] == model.cfg.model_name
    assert not ABSENT_KEYS & set(config)
    assert set(config) - set(REQUIRED_KEYS) - set(READ_IF_PRESENT) == {"exported_by", "blocks"}
    # scan: one path-free token (the graph viewer splits a scan at "//" and "@"), naming the set
    assert re.fullmatch(r"[A-Za-z0-9._-]+", config["scan"]), config["scan"]
    kind = "topk-skip-transcoder" if cls is TopKSkipTranscoder else "topk-transcoder"
    assert config["scan"].startswith("mxd-lens-") and config["scan"].endswith(f"{kind}-k3-w16")
    # the layer files, found as circuit-tracer finds them locally and in a hub repository
    expected = {block: str(out / f"layer_{block}.safetensors") for block in (0, 1)}
    assert local_layer_paths(out) == hub_layer_paths(out) == expected
    d = model.cfg.d_model
    for path in expected.values():
        tensors = load_file(path)
        assert set(tensors) == TENSORS | ({"W_skip"} if cls is TopKSkipTranscoder else set())
        assert tensors["W_enc"].shape == tensors["W_dec"].shape == (16, d)
        assert tensors["b_enc"].shape == (16,) and tensors["b_dec"].shape == (d,)
        if cls is TopKSkipTranscoder:
            assert tensors["W_skip"].shape == (d, d)
        assert all(t.dtype == torch.float32 for t in tensors.values())
    # the absolute folder is found as a local set, wherever circuit-tracer's cache folder is
    cache = tmp_path / "ct-cache"
    monkeypatch.setenv("CIRCUIT_TRACER_CACHE_DIR", str(cache))
    assert circuit_tracer_cache_path(str(out), cache) == out and (out / "config.yaml").is_file()
    assert circuit_tracer_cache_path(str(out), Path.home() / ".cache" / "circuit_tracer") == out


def test_a_relative_out_is_returned_absolute_since_circuit_tracer_reads_relative_paths_in_its_cache(
    tmp_path, monkeypatch, capsys
):
    model = make_model("gated")
    TopKTranscoder.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path / "L0")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "L0", "--out", "ct"]) == 0
    printed = capsys.readouterr().out
    assert f"load_transcoder_from_hub({str(tmp_path / 'ct')!r})" in printed and "TopK(config['k'])" in printed
    out = export_circuit_tracer("L0", "ct")
    assert out == tmp_path / "ct" and out.is_absolute()
    # circuit-tracer resolves "ct" against its cache folder, not the working directory: not our folder
    cache = tmp_path / "ct-cache"
    assert circuit_tracer_cache_path("ct", cache) == cache / "ct" != out
    assert not (cache / "ct" / "config.yaml").exists()
    assert circuit_tracer_cache_path(str(out), cache) == out
    assert local_layer_paths(out) == {0: str(out / "layer_0.safetensors")}

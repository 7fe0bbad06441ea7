"""circuit-tracer export: the exported tensors, applied as circuit-tracer's SingleLayerTranscoder
computes (written out here from its source: F.linear encode, TopK without ReLU, acts @ W_dec + b_dec
+ x @ W_skip.T), reproduce our layers' outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import make_model, randomise
from safetensors.torch import load_file

from mxd_lens.cli import main
from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder


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

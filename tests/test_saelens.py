"""SAELens format: save, load through SAELens, splice through HookedSAETransformer."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model, randomise
from sae_lens import SAE, HookedSAETransformer

import mxd_lens
from mxd_lens import BatchTopKTranscoder, MxD, TopKSkipTranscoder, TopKTranscoder

LAYER_TYPES = [MxD, TopKTranscoder, TopKSkipTranscoder, BatchTopKTranscoder]


@pytest.mark.parametrize("kind", ["gpt2", "gated"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_save_load_round_trip_gives_identical_layer_and_logits(tmp_path, tokens, kind, layer_type):
    model = make_model(kind)
    layer = randomise(layer_type.for_model(model, 1, d_sae=24, k=4))
    layer.save_model(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["architecture"].startswith("mxd_lens.")
    assert cfg["metadata"]["hook_name"] == "blocks.1.mlp.hook_in"
    assert cfg["metadata"]["hook_name_out"] == "blocks.1.hook_mlp_out"
    assert cfg["metadata"]["model_name"] == f"tiny-{kind}"

    loaded = SAE.load_from_disk(tmp_path)
    assert type(loaded) is layer_type
    assert loaded.cfg == layer.cfg
    for name, param in layer.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], param), name
    x = torch.randn(5, model.cfg.d_model)
    assert torch.equal(loaded(x), layer(x))
    with mxd_lens.splice(model, layer):
        before = model(tokens)
    with mxd_lens.splice(model, loaded):
        after = model(tokens)
    assert torch.equal(before, after)
    assert type(mxd_lens.load_layer(tmp_path)) is layer_type


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("error_term", [False, True])
def test_hooked_sae_transformer_add_sae_equals_splice(tokens, kind, layer_type, error_term):
    model = make_model(kind)
    hsat = make_model(kind, cls=HookedSAETransformer)
    hsat.load_state_dict(model.state_dict())
    torch.testing.assert_close(hsat(tokens), model(tokens), rtol=0, atol=0)
    layer = randomise(layer_type.for_model(model, 2, d_sae=24, k=4))
    with mxd_lens.splice(model, layer, error_term=error_term):
        spliced = model(tokens)
    hsat.add_sae(layer, use_error_term=error_term)
    try:
        added = hsat(tokens)
    finally:
        hsat.reset_saes()
    assert torch.equal(spliced, added)
    torch.testing.assert_close(hsat(tokens), model(tokens), rtol=0, atol=0)


def test_splice_also_works_on_hooked_sae_transformer(tokens):
    hsat = make_model("gated", cls=HookedSAETransformer)
    layer = randomise(MxD.for_model(hsat, 0, d_sae=24, k=4))
    clean = hsat(tokens)
    with mxd_lens.splice(hsat, layer, error_term=True):
        torch.testing.assert_close(hsat(tokens), clean, rtol=1e-5, atol=1e-5)
    hsat.add_sae(layer)
    with pytest.raises(ValueError, match="reset_saes"):
        with mxd_lens.splice(hsat, layer):
            pass


def test_registration_is_idempotent_and_names_are_ours():
    from sae_lens.registry import SAE_CLASS_REGISTRY

    mxd_lens.register()
    mxd_lens.register()
    assert SAE_CLASS_REGISTRY["mxd_lens.mxd"][0] is MxD
    assert SAE_CLASS_REGISTRY["transcoder"][0] is not TopKTranscoder  # SAELens's own stays


def test_bad_folders_are_refused(tmp_path):
    model = make_model("gpt2")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        mxd_lens.load_layer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="lacks"):
        mxd_lens.load_layer(tmp_path)
    # A foreign SAELens architecture.
    from sae_lens import StandardSAE, StandardSAEConfig

    StandardSAE(StandardSAEConfig(d_in=16, d_sae=8)).save_model(tmp_path / "standard")
    with pytest.raises(ValueError, match="'standard', not one of mxd-lens's"):
        mxd_lens.load_layer(tmp_path / "standard")
    # Weights of another of our architectures under an MxD config.
    TopKTranscoder.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path / "tc")
    MxD.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path / "mxd")
    (tmp_path / "mxd" / "sae_weights.safetensors").replace(tmp_path / "mxd" / "tc_weights")
    (tmp_path / "tc" / "sae_weights.safetensors").replace(tmp_path / "mxd" / "sae_weights.safetensors")
    with pytest.raises(ValueError, match="missing \\['W_in', 'W_out', 'b_in'\\]"):
        SAE.load_from_disk(tmp_path / "mxd")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "cfg.json").write_text("{not json")
    (tmp_path / "bad" / "sae_weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not valid JSON"):
        mxd_lens.load_layer(tmp_path / "bad")


def test_saved_files_get_the_mode_open_would_give(tmp_path):
    """Atomic writes go through mkstemp (0600); shared weights must be readable as a plain file is."""
    import os
    import stat

    model = make_model("gpt2")
    TopKTranscoder.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path / "tc")
    (tmp_path / "plain").write_text("x")
    expected = stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)
    for name in ("cfg.json", "sae_weights.safetensors"):
        assert stat.S_IMODE(os.stat(tmp_path / "tc" / name).st_mode) == expected


def test_a_truncated_or_garbled_weights_file_is_named_with_what_is_wrong(tmp_path):
    model = make_model("gpt2")
    MxD.for_model(model, 0, d_sae=8, k=2).save_model(tmp_path)
    weights = tmp_path / "sae_weights.safetensors"
    data = weights.read_bytes()
    for broken in (data[: len(data) // 2], b"\xff" * 64 + data[64:]):  # cut short; header overwritten
        weights.write_bytes(broken)
        with pytest.raises(ValueError, match=r"sae_weights\.safetensors is not a readable safetensors file"):
            mxd_lens.load_layer(tmp_path)

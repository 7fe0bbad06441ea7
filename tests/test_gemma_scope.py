"""Gemma Scope 2 offline: a local Hugging Face cache laid out as google/gemma-scope-2-270m-pt is (random
tensors in its files' format, shaped for a tiny Gemma-3 model), loaded through SAELens's own Gemma 3
converter with the hub offline (``mxd_lens.foreign.from_pretrained``), then spliced and evaluated, and
compared with our layers in one ``mxd-lens eval --compare`` table."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import mxd_lens
from mxd_lens.foreign import from_pretrained

RELEASE = "gemma-scope-2-270m-pt-transcoders"
SAE_ID = "transcoder/layer_9_width_16k_l0_small_affine"  # listed in SAELens 6.54's pretrained_saes.yaml
REPO = "google/gemma-scope-2-270m-pt"
D_SAE = 24


def tiny_gemma3(folder):
    """A 10-block Gemma-3 Hugging Face folder (block 9 exists) named like the model the release names."""
    import transformers
    from conftest import WORDS, make_tokenizer

    tok = make_tokenizer([" ".join(WORDS)])
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=10, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return len(tok)


def gemma_scope_cache(cache, d_model, seed=0):
    """``cache``/models--google--gemma-scope-2-270m-pt as huggingface_hub lays out a download: refs/main
    naming a snapshot that holds the layer's config.json and params.safetensors (keys w_enc [d_in, F],
    w_dec [F, d_out], b_enc, b_dec, threshold, affine_skip_connection [d_in, d_out]). Returns the
    tensors."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "w_enc": torch.randn(d_model, D_SAE, generator=g) * 0.3,
        "w_dec": torch.randn(D_SAE, d_model, generator=g) * 0.3,
        "b_enc": torch.randn(D_SAE, generator=g) * 0.3,
        "b_dec": torch.randn(d_model, generator=g) * 0.3,
        "threshold": torch.rand(D_SAE, generator=g) * 0.3,
        "affine_skip_connection": torch.randn(d_model, d_model, generator=g) * 0.1,
    }
    commit = "0" * 40
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / commit / SAE_ID
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(params, str(snapshot / "params.safetensors"))
    (snapshot / "config.json").write_text(json.dumps({
        "architecture": "jump_relu", "model_name": "gemma-v3-270m-pt", "affine_connection": True,
        "hf_hook_point_in": "model.layers.9.pre_feedforward_layernorm.output",
        "hf_hook_point_out": "model.layers.9.post_feedforward_layernorm.output",
    }))  # fmt: skip
    return params


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_gemma_scope_2_loads_offline_through_saelens_and_splices_as_its_formula(tmp_path, offline_cache):
    from mxd_lens.models import load_model

    folder = tmp_path / "gemma-3-270m"
    vocab = tiny_gemma3(folder)
    model = load_model(str(folder))
    params = gemma_scope_cache(offline_cache, model.cfg.d_model)
    sae = from_pretrained(f"{RELEASE}/{SAE_ID}")
    assert sae.cfg.architecture() == "jumprelu_skip_transcoder"
    assert sae.cfg.metadata.model_name == "google/gemma-3-270m"  # matches our folder's name, org aside
    assert (sae.cfg.metadata.hook_name, sae.cfg.metadata.hook_name_out) == (
        "blocks.9.hook_mlp_in",
        "blocks.9.hook_mlp_out",
    )
    torch.testing.assert_close(sae.W_skip, params["affine_skip_connection"].T)  # SAELens's transpose
    tokens = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))

    # by hand: the MLP's input (what pre_feedforward_layernorm outputs) through the JumpReLU transcoder,
    # written at hook_mlp_out (post_feedforward_layernorm's output, what it was trained to predict)
    seen = {}
    handle = model.blocks[9].mlp.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))

    def by_hand(value, hook):
        x = seen["x"]
        pre = x @ params["w_enc"] + params["b_enc"]
        codes = torch.relu(pre) * (pre > params["threshold"])
        return codes @ params["w_dec"] + params["b_dec"] + x @ params["affine_skip_connection"]

    try:
        with torch.no_grad():
            expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.9.hook_mlp_out", by_hand)])
    finally:
        handle.remove()
    with pytest.warns(UserWarning, match="a norm's output"), torch.no_grad():
        with mxd_lens.splice(model, sae):
            got = model(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (got - model(tokens)).abs().max() > 1e-3


def test_eval_compare_puts_a_published_layer_beside_ours(tmp_path, offline_cache, monkeypatch, capsys):
    import mxd_lens.models
    from mxd_lens.cli import main
    from mxd_lens.models import load_model

    folder = tmp_path / "gemma-3-270m"
    tiny_gemma3(folder)
    model = load_model(str(folder))
    gemma_scope_cache(offline_cache, model.cfg.d_model)
    ours = mxd_lens.TopKTranscoder.for_model(model, 9, d_sae=D_SAE, k=4)
    ours.save_model(tmp_path / "layers" / "ours")
    from conftest import WORDS

    corpus = tmp_path / "corpus.txt"
    rng = torch.Generator().manual_seed(0)
    corpus.write_text("\n\n".join(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (30,), generator=rng))
                                  for _ in range(40)))  # fmt: skip
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    args = ["eval", str(tmp_path / "layers" / "ours"), "--compare", f"{RELEASE}/{SAE_ID}", "--text", str(corpus),
            "--split", "all", "--eval-tokens", "96", "--context-size", "12", "--skip-positions", "2"]  # fmt: skip
    with pytest.warns(UserWarning):
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "ours" in out and SAE_ID.split("/")[-1] in out
    record = json.loads((tmp_path / "layers" / "ours" / "cfg.json").read_text())["metadata"]["evaluation"]
    assert record["skip_positions"] == 2  # ours is recorded; the published layer has no folder to write
    with pytest.raises(SystemExit, match="not a release SAELens lists"):
        main([*args[:2], "--compare", "gemma-scope-9/x", "--text", str(corpus)])
    with pytest.raises(SystemExit, match="give RELEASE/ID"):
        main([*args[:2], "--compare", "justarelease", "--text", str(corpus)])

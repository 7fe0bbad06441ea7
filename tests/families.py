"""Tiny random models of every MLP-bearing causal-LM class TransformerLens 3.9 converts (its weight dispatch,
``get_pretrained_state_dict``: tests/test_families.py checks that each has a row), and feature rows (Llama
with one setting changed: MQA, rope scaling, a decoupled head size, the bias flags, bfloat16), built the way
TL converts that family (tests/test_families.py checks each guarantee of the docs on them).

Preferred route (``route="folder"``): a tiny random *transformers* model of the family (hidden 32, 3
layers, 4 heads, the word tokenizer of tests/conftest.py), every parameter drawn from N(0, 0.2) (norms and
biases non-trivial), saved with ``save_pretrained`` and loaded with ``mxd_lens.models.load_model(folder)``:
exactly how a user's local folder is converted (TL's ``get_pretrained_model_config`` +
``get_pretrained_state_dict``). OLMo-2 (``route="tl_config"``): TL 3.9 builds it from an official name
only (load_model refuses a folder, naming the name, and the name's config comes from the hub), so its
``HookedTransformerConfig`` holds the fields TL's OLMo-2 branch sets (sizes from the folder's config) and
its weights come from TL's own ``convert_olmo2_weights`` on the transformers model. Mixtral, OLMoE, GPT-OSS
(``route="moe"``): built by TL's own config and weight conversion (what load_model would do), so the
refusals can be checked on the real MoE block. ``route="refused"``: a folder load_model refuses in one line
(OLMo-1, TL by name only; santacoder and Qwen-1, remote code, written as their config.json alone; settings
TL's converter cannot hold or ignores), the refusal being what is checked.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from conftest import WORDS, make_tokenizer

D_MODEL, N_LAYERS, N_HEADS, N_CTX = 32, 3, 4, 16
D_HEAD = D_MODEL // N_HEADS


@dataclass(frozen=True)
class Family:
    key: str  # test id
    title: str  # the table's row name
    config: str  # transformers config class
    arch: str  # transformers model class
    kwargs: dict[str, Any]  # config fields besides vocab_size (and the special-token ids)
    route: str = "folder"  # "folder": load_model(folder); "tl_config": see the module doc; "moe": refused;
    # "refused": load_model(folder) refuses it (ValueError containing ``refusal``), nothing else applies
    notes: str = ""  # what the row is, how it is built, what TL does with it
    tags: tuple[str, ...] = field(
        default=()
    )  # "softcap": final logit soft-cap (attribution linearises it at the prompt); "transcoders": a host
    # no MxD is built on (xIELU), every check with transcoders only
    dtype: str = "float32"  # load_model's dtype (the transformers reference runs in it too)
    raw: dict[str, Any] | None = None  # a config.json written as it is (remote code: no transformers class)
    refusal: str = ""  # route "refused": what load_model's one-line refusal must say
    cell: str = ""  # route "refused": the load cell's text


def _attn(**extra: Any) -> dict[str, Any]:
    """The Llama-style size fields."""
    return dict(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                max_position_embeddings=N_CTX, **extra)  # fmt: skip


FAMILIES: list[Family] = [
    Family("gpt2", "GPT-2", "GPT2Config", "GPT2LMHeadModel",
           dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=N_CTX),
           notes="LayerNorm, GELU (tanh), learned positions; TL takes d_mlp = 4 d_model"),
    Family("gpt_neo", "GPT-Neo", "GPTNeoConfig", "GPTNeoForCausalLM",
           dict(hidden_size=D_MODEL, num_layers=N_LAYERS, num_heads=N_HEADS, max_position_embeddings=N_CTX,
                attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4),
           notes="global and local (window 4) attention layers, no attention scaling"),
    Family("gptj", "GPT-J", "GPTJConfig", "GPTJForCausalLM",
           dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=N_CTX, rotary_dim=4),
           notes="attention and MLP in parallel, one LayerNorm; rotary on 4 of 8 head dims (adjacent pairs)"),
    Family("pythia", "GPT-NeoX / Pythia", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           _attn(intermediate_size=4 * D_MODEL),
           notes="attention and MLP in parallel (use_parallel_residual), exact GELU, rotary on 25% of d_head"),
    Family("opt", "OPT", "OPTConfig", "OPTForCausalLM",
           dict(_attn(), ffn_dim=4 * D_MODEL, word_embed_proj_dim=D_MODEL, do_layer_norm_before=True),
           notes="ReLU MLP, learned positions (offset 2)"),
    Family("bloom", "BLOOM", "BloomConfig", "BloomForCausalLM",
           dict(hidden_size=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS),
           notes="ALiBi, LayerNorm after the embedding, gelu_fast; TL takes d_mlp = 4 d_model"),
    Family("llama", "Llama", "LlamaConfig", "LlamaForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2),
           notes="RMSNorm, gated SiLU MLP, rotary, GQA (2 key/value heads)"),
    Family("mistral", "Mistral", "MistralConfig", "MistralForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD, sliding_window=4),
           notes="Llama block with a sliding window (4 here, inside the 12-token prompts)"),
    Family("qwen2", "Qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           _attn(intermediate_size=176, num_key_value_heads=2),
           notes="GQA (2 key/value heads of 4) with Q/K/V biases; d_mlp = 5.5 d_model, the real models' ratio "
                 "(Qwen2.5-0.5B: 5.43), so the default width is exercised on a gated MLP. transformers 5 loads any "
                 "tokenizer in a qwen2 folder as Qwen2Tokenizer, which splits the test's words, so the model is "
                 "given the word tokenizer with set_tokenizer"),
    Family("qwen3", "Qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD),
           notes="QK-norm (RMSNorm on queries and keys), GQA"),
    Family("gemma", "Gemma-1", "GemmaConfig", "GemmaForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD),
           notes="TL builds Gemma only by name: load_model's template google/gemma-2b, sizes from the folder"),
    Family("gemma2", "Gemma-2", "Gemma2Config", "Gemma2ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD, sliding_window=4),
           notes="post-norms (ln2_post: layers write the MLP module), attention and final logit soft-caps, "
                 "sliding window; template google/gemma-2-2b",
           tags=("softcap",)),
    Family("gemma3", "Gemma-3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD, sliding_window=4),
           notes="post-norms, QK-norm, local/global layers, no soft-caps; template google/gemma-3-270m"),
    Family("phi2", "Phi-2", "PhiConfig", "PhiForCausalLM",
           _attn(intermediate_size=4 * D_MODEL),
           notes="parallel attention and MLP, partial rotary (50%), LayerNorm with biases"),
    Family("phi3", "Phi-3", "Phi3Config", "Phi3ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, pad_token_id=None),
           notes="fused QKV and gate/up projections (split by TL's converter), GQA"),
    Family("olmo2", "OLMo-2", "Olmo2Config", "Olmo2ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, pad_token_id=None), route="tl_config",
           notes="post-norm block (ln2 after the MLP) and QK-norm; TL 3.9 builds OLMo-2 only by name "
                 "(load_model on a folder: NotImplementedError), so the model is TL's OLMo-2 config fields "
                 "in a HookedTransformerConfig + TL's convert_olmo2_weights, checked against transformers"),
    Family("stablelm", "StableLM-alpha", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           _attn(intermediate_size=4 * D_MODEL, rope_parameters={"rope_theta": 10000.0,
                 "partial_rotary_factor": 0.25, "rope_type": "default"}),
           notes="stablelm-base/tuned-alpha are GPTNeoXForCausalLM (rotary_pct 0.25): TL converts them with "
                 "its GPT-NeoX branch (rotary_dim = round(0.25 d_head)); the newer StableLmForCausalLM "
                 "(StableLM-2, 3B-4E1T) has no TL 3.9 converter and load_model refuses it by name"),
    Family("mixtral", "Mixtral", "MixtralConfig", "MixtralForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD, num_local_experts=4,
                 num_experts_per_tok=2), route="moe",
           notes="MoE MLP (TL's MoE, 4 experts, 2 active): refused by name wherever a layer would be built, "
                 "cached from or spliced in, and at load_model"),
]  # fmt: skip

_LLAMA = FAMILIES[[f.key for f in FAMILIES].index("llama")].kwargs
_REMOTE = "its code is the repository's own"
FAMILIES += [
    Family("olmo3", "OLMo-3", "Olmo3Config", "Olmo3ForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, sliding_window=4, pad_token_id=None),
           notes="post-norm block (ln2 after the MLP: layers write the MLP module), QK-norm, sliding-window and "
                 "full attention layers; a local folder loads (TL 3.9 reads its config.json)"),
    Family("apertus", "Apertus", "ApertusConfig", "ApertusForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, pad_token_id=None), tags=("transcoders",),
           notes="xIELU MLP (ungated), QK-norm: xIELU has trained parameters per MLP (alpha_p, alpha_n), which "
                 "no MxD holds, so MxD is refused by name and every check runs with the transcoders "
                 "(transcoder, skip_transcoder, batchtopk_transcoder)"),
    Family("olmo", "OLMo-1", "OlmoConfig", "OlmoForCausalLM", _attn(intermediate_size=2 * D_MODEL, pad_token_id=None),
           route="refused", refusal="load_model('allenai/OLMo-1B-hf')", cell="refused: TL builds it by name only",
           notes="TL 3.9 picks OLMo-1's config by official name only and never reads a folder's config.json: "
                 "load_model refuses the folder in one line, naming the TL name to load instead"),
    Family("santacoder", "santacoder", "", "GPT2LMHeadCustomModel", {}, route="refused",
           raw={"architectures": ["GPT2LMHeadCustomModel"], "model_type": "gpt2",
                "auto_map": {"AutoConfig": "configuration_gpt2_mq.GPT2CustomConfig",
                             "AutoModelForCausalLM": "modeling_gpt2_mq.GPT2LMHeadCustomModel"},
                "attention_head_type": "multiquery", "n_embd": D_MODEL, "n_head": N_HEADS, "n_layer": N_LAYERS,
                "n_positions": N_CTX, "vocab_size": 100},
           refusal=f"{_REMOTE} (config.json auto_map: modeling_gpt2_mq.GPT2LMHeadCustomModel)",
           cell="refused: remote code",
           notes="bigcode/santacoder's class is its repository's code (auto_map; model_type gpt2, which "
                 "transformers would otherwise read as GPT-2): refused in one line before transformers reads the "
                 "folder (no trust_remote_code prompt), naming TL's route, load_model('bigcode/santacoder'), "
                 "which fetches and runs that code (not run here: no hub)"),
    Family("qwen1", "Qwen-1", "", "QWenLMHeadModel", {}, route="refused",
           raw={"architectures": ["QWenLMHeadModel"], "model_type": "qwen",
                "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                             "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
                "hidden_size": D_MODEL, "num_attention_heads": N_HEADS, "num_hidden_layers": N_LAYERS,
                "seq_length": N_CTX, "vocab_size": 100},
           refusal=f"{_REMOTE} (config.json auto_map: modeling_qwen.QWenLMHeadModel)", cell="refused: remote code",
           notes="Qwen-1 (model_type qwen) exists only as its repository's code: refused in one line, naming TL's "
                 "route, load_model('Qwen/Qwen-1_8B') (runs that code; not run here: no hub)"),
    Family("olmoe", "OLMoE", "OlmoeConfig", "OlmoeForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                 pad_token_id=None), route="moe",
           notes="MoE MLP (TL's MoE, 4 experts, 2 active): refused as Mixtral is"),
    Family("gpt_oss", "GPT-OSS", "GptOssConfig", "GptOssForCausalLM",
           _attn(intermediate_size=2 * D_MODEL, num_key_value_heads=2, head_dim=D_HEAD, num_local_experts=4,
                 num_experts_per_tok=2, sliding_window=4, pad_token_id=None), route="moe",
           notes="MoE MLP (TL's MoE, 4 experts, 2 active), attention sinks: refused as Mixtral is"),
    # feature rows: Llama with one setting changed
    Family("llama_mqa", "Llama, MQA", "LlamaConfig", "LlamaForCausalLM", {**_LLAMA, "num_key_value_heads": 1},
           notes="multi-query attention: one key/value head for 4 query heads"),
    Family("llama_rope3", "Llama, rope scaling (llama3)", "LlamaConfig", "LlamaForCausalLM",
           {**_LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8}},
           notes="Llama-3.1's rope scaling (factor 8, original context 8), which TL implements "
                 "(NTK-by-parts)"),
    Family("llama_rope_linear", "Llama, rope scaling (linear)", "LlamaConfig", "LlamaForCausalLM",
           {**_LLAMA, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
           route="refused", refusal="log-probs differ by up to", cell="refused: the load check",
           notes="linear rope scaling, which TL 3.9's Llama branch ignores (log-probs 0.01 off on the 12-token "
                 "prompts): the load check refuses it, naming the difference and --no-load-check"),
    Family("llama_head_dim", "Llama, head_dim ≠ d_model / heads", "LlamaConfig", "LlamaForCausalLM",
           {**_LLAMA, "head_dim": 2 * D_HEAD},
           notes="a head size of 16 with d_model 32 and 4 heads (TL 3.9's Llama branch takes 8: load_model "
                 "reads head_dim)"),
    Family("llama_attention_bias", "Llama, attention_bias", "LlamaConfig", "LlamaForCausalLM",
           {**_LLAMA, "attention_bias": True},
           notes="Q/K/V/O biases, which TL 3.9's Llama converter zeroes: load_model copies them into TL's b_Q, "
                 "b_K, b_V, b_O"),
    Family("llama_mlp_bias", "Llama, mlp_bias", "LlamaConfig", "LlamaForCausalLM", {**_LLAMA, "mlp_bias": True},
           route="refused", refusal="sets mlp_bias=True", cell="refused: mlp_bias",
           notes="gate/up/down biases: TL's gated MLP has one bias, after the product, so gate_proj and up_proj "
                 "biases have no place (TL 3.9 zeroes them: log-probs 1.0 off); refused by name"),
    Family("llama_bf16", "Llama, bfloat16", "LlamaConfig", "LlamaForCausalLM", _LLAMA, dtype="bfloat16",
           notes="the Llama row loaded with dtype='bfloat16' (the transformers reference in bfloat16 too); "
                 "layers built on it are float32 (from_mlp: in the host's dtype)"),
]  # fmt: skip
BY_KEY = {f.key: f for f in FAMILIES}

TOKENIZER_TEXT = " ".join(WORDS)


def corpus(n_docs: int = 60, seed: int = 0) -> str:
    """Random sentences over the tokenizer's words, documents separated by blank lines (what
    conftest.make_text_model writes)."""
    rng = random.Random(seed)
    return "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) for _ in range(n_docs))


def hf_model(family: Family, seed: int = 0):
    """The tiny random transformers model of ``family`` and its word tokenizer."""
    import transformers

    tok = make_tokenizer([TOKENIZER_TEXT])
    ids = dict(bos_token_id=0, eos_token_id=1)
    config = getattr(transformers, family.config)(vocab_size=len(tok), **{**ids, **family.kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, family.arch)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # non-trivial norms and biases too
    return model, tok


def hf_folder(root: Path, family: Family, seed: int = 0) -> tuple[Path, Any]:
    """``family``'s tiny model saved as a Hugging Face folder ``root / family.key`` (with its tokenizer); a
    ``raw`` family's config.json alone (its class is no transformers class: no model)."""
    folder = Path(root) / family.key
    if family.raw is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(family.raw))
        return folder, None
    model, tok = hf_model(family, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model


def olmo2_from_tl_config(folder: Path, hf: Any):
    """OLMo-2 as TL 3.9 would build it by name: its OLMo-2 branch's fields (convert_hf_model_config,
    "allenai/OLMo-2-0425-1B") with the folder's sizes, through TL's get_pretrained_model_config, and the
    weights from TL's own converter (get_pretrained_state_dict -> convert_olmo2_weights)."""
    from transformer_lens import loading_from_pretrained as tl

    c = hf.config
    cfg_dict = {
        "d_model": c.hidden_size, "d_head": c.hidden_size // c.num_attention_heads, "n_heads": c.num_attention_heads,
        "d_mlp": c.intermediate_size, "n_layers": c.num_hidden_layers, "n_ctx": c.max_position_embeddings,
        "eps": c.rms_norm_eps, "d_vocab": c.vocab_size, "act_fn": "silu", "initializer_range": 0.02,
        "normalization_type": "RMS", "rotary_base": c.rope_parameters["rope_theta"],
        "attn_types": ["global"] * c.num_hidden_layers, "positional_embedding_type": "rotary",
        "gated_mlp": True, "original_architecture": "Olmo2ForCausalLM", "tokenizer_name": None,
    }  # fmt: skip
    name = "allenai/OLMo-2-0425-1B"
    original = tl.convert_hf_model_config
    tl.convert_hf_model_config = lambda *args, **kwargs: dict(cfg_dict)
    try:
        cfg = tl.get_pretrained_model_config(name, fold_ln=False, device="cpu", dtype=torch.float32)
    finally:
        tl.convert_hf_model_config = original
    state_dict = tl.get_pretrained_state_dict(name, cfg, hf, dtype=torch.float32)
    return _unprocessed(cfg, state_dict, folder, "olmo2")


def moe_from_tl(folder: Path, hf: Any):
    """Mixtral's TL model as TL converts a folder (its config branch and weight converter): what
    load_model would build if it did not refuse it."""
    from transformer_lens import loading_from_pretrained as tl

    from mxd_lens.models import _neutral_name

    with _neutral_name(folder) as name:
        cfg = tl.get_pretrained_model_config(
            name, hf_cfg=hf.config.to_dict(), device="cpu", dtype=torch.float32
        )
        state_dict = tl.get_pretrained_state_dict(name, cfg, hf, dtype=torch.float32)
    return _unprocessed(cfg, state_dict, folder, "mixtral")


def build(root: Path, family: Family) -> tuple[Any, Any, Path]:
    """(TL model, transformers model, folder) of ``family``: load_model(folder) for the folder route."""
    from mxd_lens.models import load_model

    folder, hf = hf_folder(root, family)
    if family.route == "folder":
        return load_model(str(folder), dtype=family.dtype), hf, folder
    if family.route == "tl_config":
        return olmo2_from_tl_config(folder, hf), hf, folder
    if family.route == "moe":
        return moe_from_tl(folder, hf), hf, folder
    raise ValueError(family.route)


def _unprocessed(cfg: Any, state_dict: dict, folder: Path, name: str):
    """A HookedTransformer of ``cfg`` holding ``state_dict`` as load_model loads weights (no folding,
    centering or value-bias folding), with the folder's tokenizer."""
    from transformer_lens import HookedTransformer
    from transformers import AutoTokenizer

    cfg.model_name = name
    model = HookedTransformer(cfg, AutoTokenizer.from_pretrained(folder), move_to_device=False)
    model.load_and_process_state_dict(state_dict, fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)  # fmt: skip
    return model.eval()

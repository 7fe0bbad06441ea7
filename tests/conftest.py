"""Tiny random TransformerLens models of the three block shapes we support, built offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread, here and in the processes the tests start (the CLI, torchrun's ranks, the notebook's
# kernel), unless the caller sets another count: on these tiny tensors a second thread only spin-waits,
# which multiplied the suite's CPU time (by about 3 on a busy 2-core machine) and slowed it down.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

import mxd_lens  # noqa: F401  (registers our architectures with SAELens)

D_VOCAB = 61

KINDS = {
    # GPT-2-like: LayerNorm, GELU (tanh approximation), sequential blocks.
    "gpt2": dict(normalization_type="LN", act_fn="gelu_new"),
    # Llama/SmolLM-like: RMSNorm, gated SiLU MLP, rotary.
    "gated": dict(
        normalization_type="RMS",
        act_fn="silu",
        gated_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=4,
    ),
    # Pythia-like: attention and MLP in parallel, exact GELU, rotary.
    "parallel": dict(
        normalization_type="LN",
        act_fn="gelu",
        parallel_attn_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=4,
    ),
}


def make_model(
    kind: str = "gpt2",
    fold_ln: bool = False,
    cls: type = HookedTransformer,
    seed: int = 0,
    dtype=torch.float32,
):
    """A 3-layer random model; LayerNorm weights are randomised so folding them is not a no-op."""
    torch.manual_seed(seed)
    cfg = HookedTransformerConfig(
        n_layers=3,
        d_model=16,
        n_ctx=12,
        d_head=4,
        n_heads=4,
        d_mlp=40,
        d_vocab=D_VOCAB,
        seed=seed,
        dtype=dtype,
        device="cpu",
        model_name=f"tiny-{kind}",
        **KINDS[kind],
    )
    model = cls(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln" in name or name.startswith("ln_final"):
                param.copy_(
                    1.0 + 0.5 * torch.randn_like(param)
                    if name.endswith(".w")
                    else 0.3 * torch.randn_like(param)
                )
            elif name.endswith("b_in") or name.endswith("b_out"):
                param.copy_(0.2 * torch.randn_like(param))
    if fold_ln:
        model.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    model.eval()
    return model


def randomise(layer, seed: int = 0, scale: float = 0.3):
    """Random values in every parameter, as after training (D, W_skip start at zero and would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return layer


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(
    params=[(k, f) for k in KINDS for f in (False, True)],
    ids=lambda p: f"{p[0]}-{'folded' if p[1] else 'unfolded'}",
)
def any_model(request):
    kind, folded = request.param
    return make_model(kind, fold_ln=folded)


def make_tokenizer(texts):
    """A word-level tokenizer over the words of ``texts`` (+ <bos>, <eos>, <unk>), built offline.

    Whitespace pre-tokenizer, so ids can be checked by hand: <bos>=0, <eos>=1, <unk>=2, then words in
    order of first appearance. To attach it to a HookedTransformer, save_pretrained it and load it back
    with AutoTokenizer.from_pretrained(folder): TransformerLens reloads the tokenizer by name_or_path,
    which a tokenizer built from an object does not have.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    for text in texts:
        for word in pre_tokenizers.Whitespace().pre_tokenize_str(text):
            vocab.setdefault(word[0], len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


WORDS = "the cat sat on a mat while dogs ran over green hills and birds sang songs of rain".split()


def make_text_model(folder, kind: str = "gated", n_docs: int = 400):
    """A tiny model with a word-level tokenizer attached, and ``folder/corpus.txt`` of random sentences
    over its vocabulary (documents separated by blank lines)."""
    import random

    from transformers import AutoTokenizer

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n_docs)]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(docs))
    make_tokenizer(docs).save_pretrained(folder / "tok")
    model = make_model(kind)
    model.set_tokenizer(AutoTokenizer.from_pretrained(folder / "tok"))
    return model, corpus


def dense_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """A layer's output written out from the method's equations, with dense [T, N] codes, torch.topk
    and plain autograd, sharing no code with the layers (the test oracle):

        codes = TopK_K(ReLU(x W_enc + b_enc))                 (the K largest pre-activations, ReLU'd;
                                                               not ReLU'd for MxD's gate="topk")
        TopK transcoder   codes W_dec + b_dec   (+ x W_skip for the skip transcoder)
        MxD               (z D) * (codes C) + b,  z = phi(x E + b_E) or psi(x E_g + b_g) * (x E + b_E)
    """
    import torch.nn.functional as F

    from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder

    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).to(layer.W_enc.dtype)
    pre = x @ layer.W_enc + layer.b_enc
    top = pre.topk(layer.cfg.k, dim=-1)
    signed = getattr(layer.cfg, "gate", "relu_topk") == "topk"  # MxD's plain TopK gate: no ReLU
    codes = torch.zeros_like(pre).scatter(-1, top.indices, top.values if signed else torch.relu(top.values))
    mixture = codes @ layer.W_dec
    if isinstance(layer, MxD):
        phi = {
            "relu": torch.relu,
            "gelu": F.gelu,
            "silu": F.silu,
            "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
            "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
        }[layer.cfg.activation]
        up = x @ layer.W_in + layer.b_in
        z = phi(x @ layer.W_in_gate + layer.b_in_gate) * up if layer.cfg.hidden_form == "glu" else phi(up)
        out = (z @ layer.W_out) * mixture + layer.b_dec
    elif isinstance(layer, TopKSkipTranscoder):
        out = mixture + layer.b_dec + x @ layer.W_skip
    elif isinstance(layer, TopKTranscoder):
        out = mixture + layer.b_dec
    else:
        raise TypeError(f"no reference for {type(layer).__name__}")
    return out.reshape(*lead, out.shape[-1])


def make_hf_folder(tmp_path, family):
    """A tiny random Hugging Face folder of ``family``, as save_pretrained writes it, with a tokenizer."""
    import transformers

    tok = make_tokenizer([" ".join(WORDS)])
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    configs = {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=len(tok), n_embd=64, n_layer=3, n_head=4, n_positions=64)),
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(common, num_key_value_heads=2)),
        "pythia": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(common)),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(common, num_key_value_heads=2, head_dim=16)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(common, num_key_value_heads=2, head_dim=16, sliding_window=4)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(common, num_key_value_heads=2, head_dim=16, sliding_window=4)),
    }  # fmt: skip
    config_name, model_name, kwargs = configs[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # non-trivial norms and biases too
    folder = tmp_path / family
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, len(tok)


def mlp_io_by_hand(model, block: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of the MLP module blocks[block].mlp on ``tokens``, by plain PyTorch hooks written
    here (the tests' reference for what mxd_lens.hooks captures)."""
    seen: dict[str, torch.Tensor] = {}
    mlp = model.blocks[block].mlp
    handles = [
        mlp.register_forward_pre_hook(lambda m, args: seen.update(x=args[0])),
        mlp.register_forward_hook(lambda m, args, out: seen.update(y=out)),
    ]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen["x"], seen["y"]

"""Hook resolution and splicing on GPT-2-like, gated and parallel blocks, LN folded and not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, randomise

import mxd_lens
from mxd_lens import BatchTopKTranscoder, MxD, TopKSkipTranscoder, TopKTranscoder, hooks


def _mlp_input_by_hand(model, layer, tokens):
    """The MLP input recomputed from the residual stream with the block's own norm module."""
    _, cache = model.run_with_cache(tokens)
    block = model.blocks[layer]
    resid = (
        cache[f"blocks.{layer}.hook_resid_pre"]
        if model.cfg.parallel_attn_mlp
        else cache[f"blocks.{layer}.hook_resid_mid"]
    )
    return block.ln2(resid), cache[f"blocks.{layer}.hook_mlp_out"]


def test_captured_mlp_input_is_the_exact_one(any_model, tokens):
    with mxd_lens.capture_mlp_io(any_model, [0, 2]) as io:
        any_model(tokens)
    for layer in (0, 2):
        x, out = _mlp_input_by_hand(any_model, layer, tokens)
        torch.testing.assert_close(io[layer]["in"], x, rtol=0, atol=0)
        torch.testing.assert_close(io[layer]["out"], out, rtol=0, atol=0)
        # and the MLP applied to it is hook_mlp_out
        torch.testing.assert_close(any_model.blocks[layer].mlp(x), out, rtol=1e-6, atol=1e-6)


def test_from_mlp_reproduces_the_host_mlp(any_model, tokens):
    for layer in range(any_model.cfg.n_layers):
        mxd = MxD.from_mlp(any_model, layer)
        assert mxd.cfg.hidden_form == ("glu" if any_model.cfg.gated_mlp else "mlp")
        with mxd_lens.capture_mlp_io(any_model, [layer]) as io:
            any_model(tokens)
        torch.testing.assert_close(mxd(io[layer]["in"]), io[layer]["out"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            mxd.decode(mxd.encode(io[layer]["in"])), io[layer]["out"], rtol=1e-5, atol=1e-5
        )


def test_spliced_from_mlp_keeps_the_logits(any_model, tokens):
    clean = any_model(tokens)
    layers = [MxD.from_mlp(any_model, layer, n_experts=8, k=2) for layer in range(any_model.cfg.n_layers)]
    with mxd_lens.splice(any_model, *layers):
        spliced = any_model(tokens)
    torch.testing.assert_close(spliced, clean, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_type", [MxD, TopKTranscoder, TopKSkipTranscoder, BatchTopKTranscoder])
def test_error_term_restores_clean_logits_and_exit_restores_model(any_model, tokens, layer_type):
    clean = any_model(tokens)
    layer = randomise(layer_type.for_model(any_model, 1, d_sae=24, k=4))
    with mxd_lens.splice(any_model, layer):
        spliced = any_model(tokens)
    assert (spliced - clean).abs().max() > 1e-3  # the replacement is not the MLP
    with mxd_lens.splice(any_model, layer, error_term=True):
        with_error = any_model(tokens)
    torch.testing.assert_close(with_error, clean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(any_model(tokens), clean, rtol=0, atol=0)
    assert not any(hp._forward_hooks for hp in any_model.hook_dict.values())
    assert not any(block.mlp._forward_pre_hooks for block in any_model.blocks)


def test_error_term_passes_gradients_and_code_edits_through(tokens):
    model = make_model("gpt2")
    layer = randomise(MxD.for_model(model, 0, d_sae=24, k=4))
    with mxd_lens.splice(model, layer, error_term=True):
        model(tokens).sum().backward()
    assert layer.W_enc.grad is not None and layer.W_enc.grad.abs().sum() > 0
    clean = model(tokens)
    layer.hook_sae_acts_post.add_hook(lambda acts, hook: acts * 0)  # ablate every code
    try:
        with mxd_lens.splice(model, layer, error_term=True):
            ablated = model(tokens)
    finally:
        layer.hook_sae_acts_post.remove_hooks()
    assert (ablated - clean).abs().max() > 1e-3


def test_model_is_restored_after_an_exception(tokens):
    model = make_model("gated")
    clean = model(tokens)
    layers = [randomise(TopKTranscoder.for_model(model, i, d_sae=20, k=3), seed=i) for i in (0, 2)]
    with pytest.raises(KeyError, match="boom"):
        with mxd_lens.splice(model, *layers):
            assert (model(tokens) - clean).abs().max() > 1e-3
            raise KeyError("boom")
    torch.testing.assert_close(model(tokens), clean, rtol=0, atol=0)


def test_several_layers_at_once_equal_sequential_manual_replacement(tokens):
    model = make_model("parallel")
    layers = {i: randomise(MxD.for_model(model, i, d_sae=16, k=3), seed=i) for i in (0, 2)}
    with mxd_lens.splice(model, *layers.values()):
        spliced = model(tokens)

    # Reference: replace hook_mlp_out by hand with TransformerLens hooks, reading ln2's output.
    def replace(i):
        def hook(out, hook):
            resid = model.blocks[i].hook_resid_pre.ctx["x"]
            return layers[i](model.blocks[i].ln2(resid))

        return hook

    def keep(i):
        def hook(resid, hook):
            hook.ctx["x"] = resid

        return hook

    fwd = [(f"blocks.{i}.hook_resid_pre", keep(i)) for i in layers] + [
        (f"blocks.{i}.hook_mlp_out", replace(i)) for i in layers
    ]
    manual = model.run_with_hooks(tokens, fwd_hooks=fwd)
    model.reset_hooks(including_permanent=True, clear_contexts=True)
    torch.testing.assert_close(spliced, manual, rtol=1e-6, atol=1e-6)


def test_bad_layers_and_models_are_refused(tokens):
    model = make_model("gpt2")
    with pytest.raises(ValueError, match="block 3 does not exist.*blocks 0..2"):
        MxD.from_mlp(model, 3)
    with pytest.raises(ValueError, match="block -1 does not exist"):
        TopKTranscoder.for_model(model, -1, d_sae=8, k=2)
    wide = TopKTranscoder.for_model(model, 0, d_sae=8, k=2)
    wide.cfg.d_in = wide.cfg.d_out = 32
    with pytest.raises(ValueError, match="maps 32 -> 32"):
        with mxd_lens.splice(model, wide):
            pass
    orphan = TopKTranscoder(mxd_lens.TopKTranscoderConfig(d_in=16, d_out=16, d_sae=8, k=2))
    with pytest.raises(ValueError, match="hook_name_out=None"):
        with mxd_lens.splice(model, orphan):
            pass
    a, b = (TopKTranscoder.for_model(model, 1, d_sae=8, k=2) for _ in range(2))
    with pytest.raises(ValueError, match="two layers target block 1"):
        with mxd_lens.splice(model, a, b):
            pass
    attn_only = make_model("gpt2")
    attn_only.cfg.attn_only = True
    with pytest.raises(ValueError, match="attention-only"):
        hooks.check_block(attn_only, 0)


def test_metadata_names_the_hooks():
    model = make_model("gpt2")
    meta = TopKTranscoder.for_model(model, 2, d_sae=8, k=2).cfg.metadata
    assert (meta.hook_name, meta.hook_name_out, meta.model_name) == (
        "blocks.2.mlp.hook_in",
        "blocks.2.hook_mlp_out",
        "tiny-gpt2",
    )


def test_a_model_under_another_name_fits_when_the_recorded_shape_matches():
    """A layer trained on a .gguf (model_name: the file stem) splices into the same model loaded from its
    Hugging Face folder (another name): the shape recorded at training decides; without one, or with
    another shape, the name mismatch is refused as before."""
    from mxd_lens.records import model_shape

    model = make_model("gpt2")
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=8, k=2), 0)
    layer.cfg.metadata.model_name = "SmolLM2-135M-Instruct.Q8_0"
    with pytest.raises(ValueError, match="records no model shape"):
        hooks.check_fits(model, layer, 1)
    layer.cfg.metadata.training = {"model": {"kind": "gguf", "shape": model_shape(model)}}
    hooks.check_fits(model, layer, 1)
    with mxd_lens.splice(model, layer):
        pass
    wider = make_model("gpt2")
    wider.cfg.n_layers += 1  # another architecture, same MLP widths
    with pytest.raises(ValueError, match="recorded shape .* differs"):
        hooks.check_fits(wider, layer, 1)


def _spliced_by_hand(model, tokens, block, layer, first):
    """Logits with blocks[block].mlp's output replaced by layer(its input) from row position ``first`` on
    (the MLP's own output before it), with a plain forward hook on the MLP module."""

    def hook(module, args, out):
        new = layer(args[0]).to(out.dtype).clone()
        new[:, :first] = out[:, :first]
        return new

    handle = model.blocks[block].mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(tokens)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
@pytest.mark.parametrize("layer_type", [MxD, TopKSkipTranscoder])
def test_a_layer_trained_without_position_0_leaves_the_mlp_there(kind, layer_type, tokens):
    """The trainer leaves out position 0 (BOS) and records seqpos_slice [1, None]; a splice then writes the
    layer's output from position 1 on and the MLP's own at position 0, as a plain hook does."""
    model = make_model(kind)
    layer = randomise(layer_type.for_model(model, 1, d_sae=24, k=4), scale=0.5)
    layer.cfg.metadata.seqpos_slice = [1, None]
    with torch.no_grad(), mxd_lens.splice(model, layer):
        got = model(tokens)
    torch.testing.assert_close(got, _spliced_by_hand(model, tokens, 1, layer, first=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 0], model(tokens)[:, 0], rtol=1e-5, atol=1e-5)  # position 0 is clean
    everywhere = _spliced_by_hand(model, tokens, 1, layer, first=0)
    assert (got - everywhere)[:, 1:].abs().max() > 1e-3  # position 0 reaches later ones through attention
    layer.cfg.metadata.seqpos_slice = [None]  # every position
    with torch.no_grad(), mxd_lens.splice(model, layer):
        torch.testing.assert_close(model(tokens), everywhere, rtol=1e-5, atol=1e-5)


def test_a_key_value_cache_splices_the_same_row_positions(tokens):
    """model.generate runs each new token alone after a cached prefix: position 0 of that forward is not
    the row's, so the splice must still write the layer's output there."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    model = make_model("gated")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), scale=0.5)
    layer.cfg.metadata.seqpos_slice = [1, None]
    full = _spliced_by_hand(model, tokens, 1, layer, first=1)
    with torch.no_grad(), mxd_lens.splice(model, layer):
        cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, tokens.shape[0])
        one = torch.ones_like(tokens[:, :1])  # the tiny model has no tokenizer to build the mask
        head = model(tokens[:, :1], past_kv_cache=cache, attention_mask=one)
        rest = [
            model(tokens[:, t : t + 1], past_kv_cache=cache, attention_mask=one)
            for t in range(1, tokens.shape[1])
        ]
    torch.testing.assert_close(torch.cat([head, *rest], dim=1), full, rtol=1e-4, atol=1e-4)


def test_first_position_reads_seqpos_slice_or_the_training_record():
    model = make_model("gpt2")
    layer = MxD.for_model(model, 1, d_sae=24, k=4)
    assert hooks.first_position(layer) == 0  # untrained, nothing recorded: every position
    layer.cfg.metadata.training = {"model": {"kind": "default", "prepend_bos": True}}
    assert hooks.first_position(layer) == 1  # saved before seqpos_slice: the trainer left out BOS then too
    layer.cfg.metadata.training = {"model": {"kind": "default", "prepend_bos": False}}
    assert hooks.first_position(layer) == 0
    for seqpos, first in (([None], 0), ([1, None], 1), ((3,), 3), ([2, None, 1], 2)):
        layer.cfg.metadata.seqpos_slice = seqpos
        assert hooks.first_position(layer) == first
    for bad in ([5, -5], [1, None, 2], [-1, None], "1:", [1.5]):
        layer.cfg.metadata.seqpos_slice = bad
        with pytest.raises(ValueError, match="seqpos_slice"):
            hooks.first_position(layer)

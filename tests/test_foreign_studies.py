"""Layers from elsewhere in the studies: SAELens's transcoders through probing's pooled codes, inspect's
top activations, steering and attribution, each against SAELens's formulas written out (``by_hand``)
on inputs read by hand (tests/test_foreign.py checks the splice itself)."""

from __future__ import annotations

import pytest
import torch
from conftest import D_VOCAB, WORDS, make_model, make_text_model
from test_foreign import ARCHS, by_hand, foreign

import mxd_lens
from mxd_lens import hooks
from mxd_lens.analysis.inspect import top_activations
from mxd_lens.analysis.probing import pooled_activations
from mxd_lens.analysis.steering import steer
from mxd_lens.attribution import attribute, contributions, edges, frozen_target, logit_target


def layer_inputs(model, tokens, block, reads):
    """What a layer reading ``reads`` at ``block`` is given, recorded by hand: the MLP module's input,
    or the residual before ln2 (``hook_resid_mid``, what ln2 normalises in a sequential block)."""
    seen = {}
    if reads == "mlp.hook_in":
        handle = model.blocks[block].mlp.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
        with torch.no_grad():
            model(tokens)
        handle.remove()
        return seen["x"]
    _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{block}.hook_resid_mid")
    return cache[f"blocks.{block}.hook_resid_mid"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny model with a word-level tokenizer (probing reads texts)."""
    return make_text_model(tmp_path_factory.mktemp("tm"), "gpt2", n_docs=20)[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("reads", ["mlp.hook_in", "hook_mlp_in"])
def test_pooled_codes_of_a_foreign_layer_are_the_mean_of_its_codes(text_model, arch, reads):
    model = text_model
    sae = foreign(model, arch, reads=reads)
    texts = [" ".join(WORDS[:3]), " ".join(WORDS[2:9]), " ".join(WORDS[5:7])]
    pooled = pooled_activations(model, {"x": sae}, texts, context_size=12, batch_size=2, progress=False)["x"]
    assert pooled.shape == (3, sae.cfg.d_sae)
    for i, text in enumerate(texts):
        tokens = model.to_tokens(text)
        x = layer_inputs(model, tokens, 1, reads)[0, 1:]  # BOS left out, as probing pools
        expected = by_hand(sae, x)[1].mean(0)
        torch.testing.assert_close(pooled[i], expected, rtol=1e-5, atol=1e-6)
    assert pooled.abs().sum() > 0


@pytest.mark.parametrize("arch", ["jumprelu_transcoder", "skip_transcoder"])
def test_top_activations_of_a_foreign_layer_match_a_brute_force_ranking(arch):
    model = make_model("gpt2")
    sae = foreign(model, arch, reads="hook_mlp_in")
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, D_VOCAB, (3, 10), generator=g) for _ in range(2)]
    table = top_activations(model, sae, batches, [0, 5], n=4, progress=False)
    codes = torch.cat([by_hand(sae, layer_inputs(model, b, 1, "hook_mlp_in"))[1][:, 1:] for b in batches])
    for feature in (0, 5):
        expected = codes[..., feature].flatten().sort(descending=True).values[:4]
        expected = expected[expected > 0]
        got = table[table.feature == feature].activation.to_numpy()
        torch.testing.assert_close(torch.tensor(got[: len(expected)]).float(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_contributions_of_a_foreign_layer_sum_to_its_output(arch):
    model = make_model("gpt2")
    sae = foreign(model, arch)
    x = torch.randn(6, 16)
    split = contributions(sae, x)
    out, codes = by_hand(sae, x)
    torch.testing.assert_close(split.total(), out, rtol=1e-5, atol=1e-5)
    for t in range(6):  # each unit's vector is its code times its decoder row
        for j in range(split.indices.shape[1]):
            n = int(split.indices[t, j])
            torch.testing.assert_close(split.vectors[t, j], codes[t, n] * sae.W_dec[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_attribution_through_foreign_layers_is_complete_and_linear(arch):
    model = make_model("gpt2")
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    up = foreign(model, arch, block=0, seed=1)
    down = foreign(model, arch, block=1, reads="hook_mlp_in", seed=2)  # one reads the residual
    target = logit_target(4, minus=6)
    with mxd_lens.splice(model, up, down):
        result = attribute(model, tokens, target)
        assert result.completeness < 1e-4
        # removing the largest unit's contribution from the frozen block-1 output moves the target by
        # exactly its attribution (the frozen model is linear in it)
        row = result.top(1).iloc[0]
        block, position, unit = int(row.block), int(row.position), int(row.unit)
        x = layer_inputs(model, tokens, block, "mlp.hook_in" if block == 0 else "hook_mlp_in")[0]
        layer = up if block == 0 else down
        vector = by_hand(layer, x)[1][position, unit] * layer.W_dec[unit]
        name = f"blocks.{block}.hook_mlp_out"
        edited = result.frozen[name].clone()
        edited[0, position] -= vector
        moved = result.target - frozen_target(model, tokens, target, result, {name: edited})
        assert moved == pytest.approx(row.attribution, rel=1e-3, abs=1e-5)
        table = edges(model, tokens, 0, 1, keep=1.0)
        # the downstream pre-activations it reports are the encoder's, on the residual the layer reads
        x1 = layer_inputs(model, tokens, 1, "hook_mlp_in")[0]
    assert len(table) > 0
    pre = x1 @ down.W_enc + down.b_enc
    for r in table.head(5).itertuples():
        assert r.down_pre == pytest.approx(float(pre[r.down_position, r.down_unit]), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("arch", ["skip_transcoder", "jumprelu_transcoder"])
def test_steering_a_foreign_layer_adds_to_its_code(arch):
    model = make_model("gpt2")
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    sae = foreign(model, arch, reads="hook_mlp_in")

    x = layer_inputs(model, tokens, 1, "hook_mlp_in")  # block 1's input does not depend on its output

    def by_hand_steered(value, hook):
        _, codes = by_hand(sae, x)
        codes = codes.clone()
        codes[..., 3] += 2.5
        out = codes @ sae.W_dec + sae.b_dec + (x @ sae.W_skip.T if hasattr(sae, "W_skip") else 0)
        return out

    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mlp_out", by_hand_steered)])
        with mxd_lens.splice(model, sae), steer(model, sae, 3, 2.5):
            got = model(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_studies_load_foreign_folders_and_name_them(tmp_path):
    from mxd_lens.layers.io import load_layers
    from mxd_lens.layers.registry import arch_label, architecture_key, layer_arch

    model = make_model("gpt2")
    foreign(model, "jumprelu_transcoder").save_model(tmp_path / "theirs")
    mxd_lens.TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "ours")
    with pytest.raises(ValueError, match="not one of mxd-lens's"):
        load_layers(tmp_path)
    layers = load_layers(tmp_path, foreign=True)
    assert sorted(layers) == ["ours", "theirs"]
    assert architecture_key(layers["theirs"]) == "sae_lens.jumprelu_transcoder"
    assert layer_arch(layers["theirs"]) == "sae_lens.jumprelu_transcoder"
    assert arch_label(layer_arch(layers["ours"])) != arch_label(layer_arch(layers["theirs"]))
    assert hooks.replacement(layers["theirs"]).k is None and hooks.replacement(layers["ours"]).k == 2

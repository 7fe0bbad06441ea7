"""Hosts whose blocks normalise the MLP output before hook_mlp_out (Gemma-2/3: ln2_post; OLMo-2/3: ln2
after the MLP): new layers replace the MLP module (metadata.hook_name_out = blocks.L.mlp.hook_out), the
host's norm running after them. Checked against hand-written forward hooks on blocks[L].mlp, hand-captured
MLP module outputs and the clean model's logits, never against mxd_lens's own capture."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_folder, make_model, mlp_io_by_hand, randomise
from transformer_lens import HookedTransformer, HookedTransformerConfig

import mxd_lens
from mxd_lens import MxD, TopKSkipTranscoder, TopKTranscoder, hooks
from mxd_lens.activations import ModelActivations
from mxd_lens.models import add_mlp_out_hooks

POST_NORM = ["gemma2", "gemma3", "olmo2"]


def olmo2_model(seed: int = 0) -> HookedTransformer:
    """A tiny OLMo-2-shaped TL model (post-norm: ln2 after the MLP). TL 3.9 builds OLMo-2 only by
    official name (a local folder raises NotImplementedError), so the block comes from its config."""
    torch.manual_seed(seed)
    cfg = HookedTransformerConfig(
        n_layers=3, d_model=16, n_ctx=12, d_head=4, n_heads=4, d_mlp=40, d_vocab=61, normalization_type="RMS",
        act_fn="silu", gated_mlp=True, positional_embedding_type="rotary", rotary_dim=4,
        original_architecture="Olmo2ForCausalLM", model_name="tiny-olmo2", device="cpu",
    )  # fmt: skip
    model = HookedTransformer(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln" in name or name.startswith("ln_final"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """family -> (model, d_vocab): tiny Gemma-2 / Gemma-3 Hugging Face folders loaded by load_model
    (as tests/test_models.py builds them), and the OLMo-2 block."""
    from mxd_lens.models import load_model

    folder = tmp_path_factory.mktemp("hosts")
    out = {}
    for family in ("gemma2", "gemma3"):
        path, _, vocab = make_hf_folder(folder, family)
        out[family] = (load_model(str(path)), vocab)
    out["olmo2"] = (olmo2_model(), 61)
    return out


def host(hosts, family):
    model, vocab = hosts[family]
    tokens = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, tokens


def replaced_by_hand(model, tokens, layers, error_term=False):
    """Logits with each block's MLP *module* output replaced by its layer's output on the module's
    input (plus the detached residual when error_term): forward hooks on blocks[L].mlp, so ln2_post
    (OLMo: ln2) still runs after it."""
    handles = []
    for block, layer in layers.items():

        def hook(module, args, out, layer=layer):
            y = layer(args[0])
            return y + (out - y).detach() if error_term else y

        handles.append(model.blocks[block].mlp.register_forward_hook(hook))
    try:
        return model(tokens)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
def test_pre_norm_hosts_keep_hook_mlp_out(kind):
    model = make_model(kind)
    assert hooks.default_writes(model) == "hook_mlp_out"
    assert MxD.for_model(model, 1, d_sae=8, k=2).cfg.metadata.hook_name_out == "blocks.1.hook_mlp_out"
    assert MxD.from_mlp(model, 1).cfg.metadata.hook_name_out == "blocks.1.hook_mlp_out"


@pytest.mark.parametrize("family", POST_NORM)
def test_new_layers_on_post_norm_hosts_replace_the_mlp_module(hosts, family):
    model, _ = host(hosts, family)
    assert hooks.normalises_mlp_output(model) and hooks.default_writes(model) == "mlp"
    for layer in (MxD.for_model(model, 2, d_sae=8, k=2), TopKTranscoder.for_model(model, 2, d_sae=8, k=2)):
        meta = layer.cfg.metadata
        assert (meta.hook_name, meta.hook_name_out) == ("blocks.2.mlp.hook_in", "blocks.2.mlp.hook_out")
        assert hooks.writes_of(layer) == "mlp" and hooks.block_of(layer) == 2
    explicit = MxD.for_model(model, 2, writes="hook_mlp_out", d_sae=8, k=2)
    assert explicit.cfg.metadata.hook_name_out == "blocks.2.hook_mlp_out"


@pytest.mark.parametrize("family", POST_NORM)
def test_from_mlp_reproduces_the_mlp_module_and_splicing_it_keeps_the_logits(hosts, family):
    model, tokens = host(hosts, family)
    with torch.no_grad():
        clean = model(tokens)
        layers = []
        for block in range(model.cfg.n_layers):
            mxd = MxD.from_mlp(model, block)
            x, y = mlp_io_by_hand(model, block, tokens)
            torch.testing.assert_close(mxd(x), y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mxd.forward_reference(x), y, rtol=1e-5, atol=1e-5)
            layers.append(MxD.from_mlp(model, block, n_experts=8, k=2))
        with mxd_lens.splice(model, *layers):
            spliced = model(tokens)
        torch.testing.assert_close(spliced, clean, rtol=1e-4, atol=1e-4)
        # the same MxD spliced at hook_mlp_out by hand would skip ln2_post: far from the clean logits
        x1 = mlp_io_by_hand(model, 1, tokens)[0]
        fwd = [("blocks.1.hook_mlp_out", lambda out, hook: layers[1](x1))]
        assert (model.run_with_hooks(tokens, fwd_hooks=fwd) - clean).abs().max() > 1e-2


@pytest.mark.parametrize("family", POST_NORM)
@pytest.mark.parametrize("layer_type", [MxD, TopKSkipTranscoder])
@pytest.mark.parametrize("error_term", [False, True])
def test_splice_equals_a_hand_written_forward_hook_on_the_mlp(hosts, family, layer_type, error_term):
    model, tokens = host(hosts, family)
    layer = randomise(layer_type.for_model(model, 1, d_sae=24, k=4), seed=3)
    with torch.no_grad():
        clean = model(tokens)
        expected = replaced_by_hand(model, tokens, {1: layer}, error_term)
        with mxd_lens.splice(model, layer, error_term=error_term):
            spliced = model(tokens)
        assert torch.equal(spliced, expected)
        if error_term:
            torch.testing.assert_close(spliced, clean, rtol=1e-4, atol=1e-4)
        else:
            assert (spliced - clean).abs().max() > 1e-3
        torch.testing.assert_close(model(tokens), clean, rtol=0, atol=0)  # hooks removed
    assert not any(block.mlp._forward_hooks or block.mlp._forward_pre_hooks for block in model.blocks)


@pytest.mark.parametrize("family", POST_NORM)
def test_the_training_stream_targets_the_mlp_modules_output(hosts, family):
    from mxd_lens.layers.learners import LearnerSpec, _admit, build_layer

    model, tokens = host(hosts, family)

    def rows():
        while True:
            yield from tokens

    source = ModelActivations(
        model, [0, 2], rows, context_size=12, rows_per_shard=2, drop_first_position=True
    )
    assert source.info.hook_names == {
        "0": ["blocks.0.mlp.hook_in", "blocks.0.mlp.hook_out"],
        "2": ["blocks.2.mlp.hook_in", "blocks.2.mlp.hook_out"],
    }
    shard = next(source.shards())
    d = model.cfg.d_model
    for block in (0, 2):
        x, y = mlp_io_by_hand(model, block, tokens)
        torch.testing.assert_close(shard[block][0], x[:, 1:].reshape(-1, d).float(), rtol=0, atol=0)
        torch.testing.assert_close(shard[block][1], y[:, 1:].reshape(-1, d).float(), rtol=0, atol=0)
    # layers built for the stream write where its targets were taken, and --init mlp copies the MLP
    layer = build_layer(LearnerSpec("mxd", 2, 2, 8), source.info, seed=0)
    assert layer.cfg.metadata.hook_name_out == "blocks.2.mlp.hook_out"
    _, warm = _admit(LearnerSpec("mxd", 2, 2, 8, init="mlp"), 0, source.info, 0, model, "cpu")
    torch.testing.assert_close(warm.W_in, model.blocks[2].mlp.W_in, rtol=0, atol=0)
    # a stream of hook_mlp_out (as written before) targets that, and its layers write there
    old = ModelActivations(model, [1], rows, context_size=12, rows_per_shard=2, writes="hook_mlp_out")
    assert old.info.hook_names == {"1": ["blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out"]}
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.hook_mlp_out")
    want = cache["blocks.1.hook_mlp_out"][:, 1:].reshape(-1, d).float()
    torch.testing.assert_close(next(old.shards())[1][1], want, rtol=0, atol=0)
    assert build_layer(LearnerSpec("mxd", 1, 2, 8), old.info, seed=0).cfg.metadata.hook_name_out == (
        "blocks.1.hook_mlp_out"
    )


def test_a_layer_saved_before_the_write_site_existed_loads_and_writes_hook_mlp_out(hosts, tmp_path):
    """Layers written by earlier versions record hook_name_out = blocks.L.hook_mlp_out (on every host):
    they load unchanged and splice there, after ln2_post, as they were trained."""
    model, tokens = host(hosts, "gemma3")
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=2)
    layer.save_model(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name_out"] == "blocks.1.mlp.hook_out"
    cfg["metadata"]["hook_name_out"] = "blocks.1.hook_mlp_out"  # what earlier versions wrote
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    old = mxd_lens.load_layer(tmp_path)
    assert hooks.writes_of(old) == "hook_mlp_out" and hooks.block_of(old) == 1
    x, _ = mlp_io_by_hand(model, 1, tokens)
    with torch.no_grad():
        by_hand = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.hook_mlp_out", lambda out, hook: old(x))]
        )
        with mxd_lens.splice(model, old):
            assert torch.equal(model(tokens), by_hand)
    # and on a pre-norm host a layer made today records the same metadata as before
    plain = make_model("gated")
    assert (
        TopKTranscoder.for_model(plain, 1, d_sae=8, k=2).cfg.metadata.hook_name_out == "blocks.1.hook_mlp_out"
    )


def test_inconsistent_input_is_refused_with_what_to_do(hosts):
    from mxd_lens.layers.learners import LearnerSpec, _check_given

    model, tokens = host(hosts, "gemma2")
    with pytest.raises(ValueError, match="writes='nope': choose 'hook_mlp_out' or 'mlp'"):
        MxD.for_model(model, 1, writes="nope", d_sae=8, k=2)
    with pytest.raises(
        ValueError, match=r"normalises the MLP output before hook_mlp_out.*blocks\.1\.mlp\.hook_out"
    ):
        MxD.from_mlp(model, 1, writes="hook_mlp_out")
    old = MxD.for_model(model, 1, writes="hook_mlp_out", d_sae=8, k=2)
    with pytest.raises(ValueError, match="cannot copy its MLP exactly"):
        old.copy_hidden_from_mlp(model, 1)
    stream = ModelActivations(model, [1], lambda: iter(tokens), context_size=12, rows_per_shard=1)
    with pytest.raises(ValueError, match=r"writes blocks\.1\.hook_mlp_out, but the stream's targets are "
                       r"blocks\.1\.mlp\.hook_out.*writes='mlp'"):  # fmt: skip
        _check_given(old, LearnerSpec.of(old), stream.info)
    with pytest.raises(ValueError, match="writes='nope'"):
        ModelActivations(model, [1], lambda: iter(tokens), context_size=12, writes="nope")
    bad = MxD.for_model(model, 1, d_sae=8, k=2)
    bad.cfg.metadata.hook_name_out = "blocks.1.mlp.hook_post"
    with pytest.raises(ValueError, match="not 'blocks.L.hook_mlp_out' or 'blocks.L.mlp.hook_out'"):
        with mxd_lens.splice(model, bad):
            pass


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_evaluate_measures_against_the_mlp_modules_output(hosts, family):
    from mxd_lens.evaluation import evaluate

    model, tokens = host(hosts, family)
    data = [tokens, tokens.flip(1)]
    exact = MxD.from_mlp(model, 1)
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=4)
    old = randomise(TopKTranscoder.for_model(model, 1, writes="hook_mlp_out", d_sae=24, k=4), seed=4)
    rows = evaluate(model, {"exact": exact, "new": layer, "old": old}, data, skip_first_position=False,
                    progress=False, jacobian_directions=None)  # fmt: skip
    rows = {r["name"]: r for r in rows}
    assert abs(rows["exact"]["delta_ce"]) < 1e-4 and rows["exact"]["kl"] < 1e-6
    assert rows["exact"]["fvu"] < 1e-8 and rows["exact"]["jacobian_cos"] == pytest.approx(1.0, abs=1e-5)
    # FVU, CE and the Jacobian target by hand: the module output (new), hook_mlp_out (old)
    for name, lay, module in (("new", layer, True), ("old", old, False)):
        ys, outs, ce = [], [], 0.0
        for t in data:
            x, y_module = mlp_io_by_hand(model, 1, t)
            with torch.no_grad():
                if module:
                    logits, y = replaced_by_hand(model, t, {1: lay}), y_module
                else:
                    _, cache = model.run_with_cache(t, names_filter="blocks.1.hook_mlp_out")
                    y = cache["blocks.1.hook_mlp_out"]
                    logits = model.run_with_hooks(
                        t, fwd_hooks=[("blocks.1.hook_mlp_out", lambda o, hook, lay=lay, x=x: lay(x))]
                    )
                outs.append(lay(x).reshape(-1, model.cfg.d_model))
            ys.append(y.reshape(-1, model.cfg.d_model))
            ce += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1)))
        y, out = torch.cat(ys).double(), torch.cat(outs).double()
        fvu = float((out - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        assert rows[name]["fvu"] == pytest.approx(fvu, rel=1e-4)
        assert rows[name]["ce_spliced"] == pytest.approx(ce / len(data), rel=1e-5)
    with torch.no_grad():  # the Jacobian of an old layer is compared with ln2_post(MLP(x)) (OLMo: ln2)
        v = torch.randn(5, model.cfg.d_model)
        after = model.blocks[1].ln2_post if family == "gemma3" else model.blocks[1].ln2
        mlp = model.blocks[1].mlp
        torch.testing.assert_close(hooks.host_map(model, 1, writes="hook_mlp_out")(v), after(mlp(v[None]))[0])
        torch.testing.assert_close(hooks.host_map(model, 1)(v), mlp(v[None])[0])


# not Gemma-2: its final logit soft cap (tanh) makes the target non-affine in the sources, whatever the
# layer writes (completeness ~1e-4 there for a hook_mlp_out layer too); Gemma-3 has none
@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
@pytest.mark.parametrize("error_term", [False, True])
def test_attribution_is_complete_and_linear_for_a_layer_replacing_the_mlp_module(hosts, family, error_term):
    from mxd_lens.attribution import attribute, contributions, frozen_target, logit_target

    model, tokens = host(hosts, family)
    tokens = tokens[:1, :8]
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), 5, scale=0.3)
    target = logit_target(token=7, minus=3)
    with mxd_lens.splice(model, layer, error_term=error_term):
        result = attribute(model, tokens, target)
        with torch.no_grad():
            real = float(target(model(tokens)))
        assert result.target == pytest.approx(real, rel=1e-4, abs=1e-5)
        assert result.completeness <= 1e-4, (result.total, result.target)
        name = "blocks.1.mlp.hook_out"  # the block's node: the MLP module's output, ln2_post after it
        assert name in result.frozen and "blocks.1.hook_mlp_out" not in result.frozen
        x, _ = mlp_io_by_hand(model, 1, tokens)
        split = contributions(layer, x[0])
        top = result.top(1).iloc[0]
        assert abs(top.attribution) > 1e-3
        t, unit = int(top.position), int(top.unit)
        j = int((split.indices[t] == unit).nonzero())
        edited = result.frozen[name].clone()
        edited[0, t] -= split.vectors[t, j]
        moved = frozen_target(model, tokens, target, result, edit={name: edited}) - result.target
        assert moved == pytest.approx(-top.attribution, rel=1e-3, abs=1e-5)
    assert not (result.units.attribution == 0).all()


def test_edges_from_a_layer_replacing_the_mlp_module_are_the_frozen_change(hosts):
    from mxd_lens.attribution import contributions, edges

    model, tokens = host(hosts, "gemma3")
    tokens = tokens[:1, :6]
    up = randomise(MxD.for_model(model, 0, d_sae=16, k=3), 1, scale=0.3)
    down = randomise(TopKTranscoder.for_model(model, 2, d_sae=16, k=3), 2, scale=0.3)
    with mxd_lens.splice(model, up, down):
        table = edges(model, tokens, 0, 2, keep=1.0)
        top = table.iloc[0]
        assert abs(top.weight) > 1e-3
        x0, y0 = mlp_io_by_hand(model, 0, tokens)  # y0: what the splice wrote (the layer's output)
        split = contributions(up, x0[0])
        t1, u = int(top.up_position), int(top.up_unit)
        edited = y0.clone()
        edited[0, t1] -= split.vectors[t1, int((split.indices[t1] == u).nonzero())]

        def frozen_pre(module_out):
            """Downstream pre-activations with patterns, norm scales and block 1's hook_mlp_out as on the
            prompt, block 0's MLP module output replaced (its ln2_post, scale frozen, runs after it)."""
            keep = lambda n: n.endswith(("hook_pattern", "hook_scale")) or n == "blocks.1.hook_mlp_out"  # noqa: E731
            seen = {}
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens, names_filter=keep)
                handles = [
                    model.blocks[0].mlp.register_forward_hook(lambda m, args, out: module_out),
                    model.blocks[2].mlp.register_forward_pre_hook(lambda m, args: seen.update(x=args[0])),
                ]
                try:
                    model.run_with_hooks(tokens, fwd_hooks=[(keep, lambda v, hook: cache[hook.name])])
                finally:
                    for handle in handles:
                        handle.remove()
            return seen["x"][0] @ down.W_enc + down.b_enc

        before, after = frozen_pre(y0), frozen_pre(edited)
        t2, m = int(top.down_position), int(top.down_unit)
        assert float(before[t2, m]) == pytest.approx(top.down_pre, rel=1e-5)
        assert float(after[t2, m] - before[t2, m]) == pytest.approx(-top.weight, rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("error_term", [False, True])
def test_add_sae_on_a_hooked_sae_transformer_equals_splice(hosts, tmp_path, error_term):
    """load_model(..., cls=HookedSAETransformer) gives each MLP a hook_out, so SAELens's add_sae attaches
    a layer writing blocks.L.mlp.hook_out; it then computes what splice does."""
    from sae_lens import HookedSAETransformer

    from mxd_lens.models import load_model

    path, _, _ = make_hf_folder(tmp_path, "gemma3")
    hsat = load_model(str(path), cls=HookedSAETransformer)
    model, tokens = host(hosts, "gemma3")
    assert "blocks.1.mlp.hook_out" in hsat.hook_dict
    with torch.no_grad():
        torch.testing.assert_close(hsat(tokens), model(tokens), rtol=0, atol=0)
        layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), seed=6)
        with mxd_lens.splice(model, layer, error_term=error_term):
            spliced = model(tokens)
        hsat.add_sae(layer, use_error_term=error_term)
        try:
            assert torch.equal(hsat(tokens), spliced)
            with pytest.raises(
                ValueError, match=r"blocks\.1\.mlp\.hook_out is not a plain HookPoint.*reset_saes"
            ):
                with mxd_lens.splice(hsat, layer):
                    pass
        finally:
            hsat.reset_saes()
        torch.testing.assert_close(hsat(tokens), model(tokens), rtol=0, atol=0)
        add_mlp_out_hooks(hsat)  # idempotent: nothing changes
        torch.testing.assert_close(hsat(tokens), model(tokens), rtol=0, atol=0)


def test_add_sae_without_the_hook_point_skips_the_layer_and_add_mlp_out_hooks_fixes_it(tokens):
    """A HookedSAETransformer built directly has no mlp.hook_out: SAELens's add_sae then skips such a
    layer (logging a warning), so steering refuses it; mxd_lens.models.add_mlp_out_hooks makes it attach."""
    from sae_lens import HookedSAETransformer

    hsat = make_model("gated", cls=HookedSAETransformer)
    model = make_model("gated")
    hsat.load_state_dict(model.state_dict())
    layer = randomise(TopKTranscoder.for_model(model, 1, writes="mlp", d_sae=24, k=4), seed=7)
    clean = hsat(tokens)
    hsat.add_sae(layer)
    assert not hsat.acts_to_saes and torch.equal(hsat(tokens), clean)
    add_mlp_out_hooks(hsat)
    hsat.add_sae(layer)
    with torch.no_grad(), mxd_lens.splice(model, layer):
        spliced = model(tokens)
    assert torch.equal(hsat(tokens), spliced)
    # on a pre-norm host the two sites are the same tensor: writing either gives the same logits
    same = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=7)
    with torch.no_grad(), mxd_lens.splice(model, same):
        assert torch.equal(model(tokens), spliced)


def test_a_foreign_transcoder_writing_the_mlp_module_splices_there(hosts):
    from test_foreign import by_hand, foreign

    model, tokens = host(hosts, "gemma2")
    sae = foreign(model, "transcoder", block=1, writes="blocks.1.mlp.hook_out")
    rep = hooks.replacement(sae)
    assert (rep.block, rep.writes) == (1, "mlp")
    with torch.no_grad():
        expected = replaced_by_hand(model, tokens, {1: lambda x: by_hand(sae, x)[0]})
        with mxd_lens.splice(model, sae):
            torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


def test_circuit_tracer_export_names_the_write_site(hosts, tmp_path):
    import yaml

    from mxd_lens.export import export_circuit_tracer

    model, _ = host(hosts, "gemma2")
    for block in range(model.cfg.n_layers):
        TopKTranscoder.for_model(model, block, d_sae=8, k=2).save_model(tmp_path / "new" / f"L{block}")
    out = export_circuit_tracer([tmp_path / "new"], tmp_path / "set")
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp.hook_in", "mlp.hook_out")
    TopKTranscoder.for_model(model, 0, writes="hook_mlp_out", d_sae=8, k=2).save_model(
        tmp_path / "mixed" / "a"
    )
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "mixed" / "b")
    with pytest.raises(ValueError, match="export them as two sets"):
        export_circuit_tracer([tmp_path / "mixed"], tmp_path / "set2")


def test_a_cache_of_hook_mlp_out_targets_is_not_extended_with_the_modules_output(hosts, tmp_path):
    from mxd_lens.activations import CachedActivations, write_cache

    model, tokens = host(hosts, "gemma3")

    def rows():
        while True:
            yield from tokens

    old = ModelActivations(model, [1], rows, context_size=12, rows_per_shard=2, writes="hook_mlp_out")
    write_cache(old, tmp_path, 1, progress=False)
    assert CachedActivations(tmp_path).info.writes(1) == "hook_mlp_out"
    new = ModelActivations(model, [1], rows, context_size=12, rows_per_shard=2)
    with pytest.raises(ValueError, match=r"another output of the MLP \(blocks\.1\.hook_mlp_out there, "
                       r"blocks\.1\.mlp\.hook_out asked"):  # fmt: skip
        write_cache(new, tmp_path, 1, progress=False)

"""Layers from elsewhere: SAELens's own transcoders spliced and evaluated, against hand-written
TransformerLens hooks and SAELens's formulas written out (mxd_lens.foreign)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import D_VOCAB, make_model, make_text_model
from sae_lens import SAE
from sae_lens.registry import SAE_CLASS_REGISTRY
from sae_lens.saes.sae import SAEMetadata

import mxd_lens
from mxd_lens import TopKTranscoder, hooks
from mxd_lens.evaluation import evaluate
from mxd_lens.jacobian import jacobian_cosine_dense

ARCHS = ["transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"]


def foreign(model, arch, block=1, reads="mlp.hook_in", d_sae=24, seed=0, writes=None, **cfg):
    """A SAELens layer of ``arch`` for ``model`` with random weights (JumpReLU thresholds positive, so
    they cut some codes), its metadata saying it reads ``blocks.{block}.{reads}``."""
    sae_cls, cfg_cls = SAE_CLASS_REGISTRY[arch]
    meta = SAEMetadata(
        model_name=model.cfg.model_name,
        hook_name=f"blocks.{block}.{reads}",
        hook_name_out=f"blocks.{block}.hook_mlp_out" if writes is None else writes,
        hook_layer=block,
    )
    d = model.cfg.d_model
    fields = dict(d_in=d, d_out=d, d_sae=d_sae, apply_b_dec_to_input=False, metadata=meta)
    sae = sae_cls(cfg_cls(**{**fields, **cfg}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            if name == "threshold":
                p.abs_()
    return sae


def by_hand(sae, x):
    """SAELens's transcoders written out (sae_lens/saes/transcoder.py): codes = ReLU(x W_enc + b_enc),
    JumpReLU keeps those whose pre-activation exceeds the threshold; output codes W_dec + b_dec, plus
    x W_skip^T for the skip transcoders."""
    pre = x @ sae.W_enc + sae.b_enc
    codes = torch.relu(pre)
    if hasattr(sae, "threshold"):
        codes = codes * (pre > sae.threshold)
    out = codes @ sae.W_dec + sae.b_dec
    if hasattr(sae, "W_skip"):
        out = out + x @ sae.W_skip.T
    return out, codes


def batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, D_VOCAB, (2, 12), generator=g) for _ in range(n)]


def hand_hooks(model, placed, fn=lambda sae, x, out: sae(x)):
    """(pre-hook handles, fwd_hooks) writing ``fn(sae, x, out)`` at each block's hook_mlp_out (``out``: the
    MLP's output there), x read where
    the layer's cfg says, by hand: the MLP module's input (mlp.hook_in), the hook's value
    (hook_mlp_in, with use_hook_mlp_in on; ln2.hook_normalized)."""
    handles, fwd_hooks = [], []
    for block, sae in placed.items():
        slot = {}
        site = sae.cfg.metadata.hook_name.split(".", 2)[2]
        if site == "mlp.hook_in":
            module = model.blocks[block].mlp
            handles.append(
                module.register_forward_pre_hook(lambda m, args, slot=slot: slot.update(x=args[0]))
            )
        else:
            fwd_hooks.append((f"blocks.{block}.{site}", lambda v, hook, slot=slot: slot.update(x=v)))
        fwd_hooks.append(
            (f"blocks.{block}.hook_mlp_out", lambda out, hook, slot=slot, sae=sae: fn(sae, slot["x"], out))
        )
    return handles, fwd_hooks


def run_by_hand(model, placed, tokens, fn=lambda sae, x, out: sae(x)):
    handles, fwd_hooks = hand_hooks(model, placed, fn)
    was = model.cfg.use_hook_mlp_in
    model.set_use_hook_mlp_in(True)
    try:
        return model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    finally:
        model.set_use_hook_mlp_in(was)
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_splice_equals_a_hand_written_replacement(tokens, kind, arch):
    model = make_model(kind)
    sae = foreign(model, arch)
    x = torch.randn(5, 16)
    assert torch.equal(hooks.replacement(sae).layer_output(x), sae(x))  # SAELens's forward, bit for bit
    torch.testing.assert_close(by_hand(sae, x)[0], sae(x), rtol=1e-6, atol=1e-6)
    clean = model(tokens)
    with mxd_lens.splice(model, sae):
        spliced = model(tokens)
    assert (spliced - clean).abs().max() > 1e-3
    assert torch.equal(spliced, run_by_hand(model, {1: sae}, tokens))
    formula = run_by_hand(model, {1: sae}, tokens, lambda s, x, out: by_hand(s, x)[0])
    torch.testing.assert_close(spliced, formula, rtol=1e-5, atol=1e-5)
    with mxd_lens.splice(model, sae, error_term=True):
        torch.testing.assert_close(model(tokens), clean, rtol=1e-5, atol=1e-5)
    assert torch.equal(model(tokens), clean)
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())


def test_a_foreign_layer_starting_later_keeps_the_mlp_before_its_first_position(tokens):
    """A SAELens layer whose metadata.seqpos_slice starts at 4 (Gemma Scope 2's transcoders skipped 4
    positions) splices from position 4 on, the MLP's own output before: a hand-written hook says so."""
    model = make_model("gated")
    sae = foreign(model, "skip_transcoder")
    sae.cfg.metadata.seqpos_slice = (4, None)
    assert hooks.replacement(sae).first == 4

    def from_4(s, x, out):
        new = s(x).clone()
        new[:, :4] = out[:, :4]
        return new

    with mxd_lens.splice(model, sae):
        spliced = model(tokens)
    assert torch.equal(spliced, run_by_hand(model, {1: sae}, tokens, from_4))
    assert (spliced - run_by_hand(model, {1: sae}, tokens)).abs().max() > 1e-3
    del sae.cfg.metadata.seqpos_slice  # none recorded (and no mxd-lens training record): every position
    assert hooks.replacement(sae).first == 0


@pytest.mark.parametrize("kind", ["gpt2", "parallel"])
def test_a_layer_reading_hook_mlp_in_is_given_the_residual_before_ln2(tokens, kind):
    model = make_model(kind)
    sae = foreign(model, "jumprelu_skip_transcoder", reads="hook_mlp_in")
    assert not model.cfg.use_hook_mlp_in  # splice reads ln2's input: the hook need not be on
    with mxd_lens.splice(model, sae):
        spliced = model(tokens)
    assert not model.cfg.use_hook_mlp_in
    assert torch.equal(spliced, run_by_hand(model, {1: sae}, tokens))
    same_weights_at_mlp_in = foreign(model, "jumprelu_skip_transcoder")
    with mxd_lens.splice(model, same_weights_at_mlp_in):
        assert (model(tokens) - spliced).abs().max() > 1e-3  # another input, another output
    # with code hooks the error term still restores the clean logits, and the code edit moves the output
    clean = model(tokens)
    sae.hook_sae_acts_post.add_hook(lambda acts, hook: acts * 0)
    try:
        with mxd_lens.splice(model, sae, error_term=True):
            ablated = model(tokens)
    finally:
        sae.reset_hooks()
    assert (ablated - clean).abs().max() > 1e-3
    with mxd_lens.splice(model, sae, error_term=True):
        torch.testing.assert_close(model(tokens), clean, rtol=1e-5, atol=1e-5)
    # SAELens's Gemma Scope 2 loader records the Hugging Face hook it came from: a norm's output is the
    # MLP's input there, what the layer was trained on, so it reads the MLP's input, and says so
    sae.cfg.metadata.hf_hook_name = "model.layers.1.pre_feedforward_layernorm.output"
    with pytest.warns(UserWarning, match=r"a norm's output.*reads the MLP's input \(blocks.1.mlp.hook_in\)"):
        with mxd_lens.splice(model, sae):
            assert torch.equal(model(tokens), run_by_hand(model, {1: same_weights_at_mlp_in}, tokens))


@pytest.mark.parametrize("kind", ["gpt2", "gated"])
def test_ln2_hook_normalized_is_the_mlp_input_only_with_ln_folded(tokens, kind):
    unfolded = make_model(kind)
    sae = foreign(unfolded, "skip_transcoder", reads="ln2.hook_normalized")
    with pytest.raises(ValueError, match=r"ln2.hook_normalized.*before ln2's weight.*fold_ln=True"):
        with mxd_lens.splice(unfolded, sae):
            pass
    with pytest.raises(ValueError, match="fold_ln=True"):
        evaluate(unfolded, [sae], batches(1), progress=False)
    model = make_model(kind, fold_ln=True)
    with mxd_lens.splice(model, sae):
        spliced = model(tokens)
    # the hook's own value, read by hand, is what the layer was given
    assert torch.equal(spliced, run_by_hand(model, {1: sae}, tokens))


def test_evaluate_rows_match_brute_force():
    model = make_model("gpt2")
    data = batches()
    tc = foreign(model, "jumprelu_transcoder", block=1)
    resid = foreign(model, "skip_transcoder", block=2, reads="hook_mlp_in", seed=1)
    rows = evaluate(
        model,
        {"tc": tc, "resid": resid},
        data,
        together=True,
        progress=False,
        jacobian_tokens=8,
        jacobian_directions=None,
    )
    rows = {r["name"]: r for r in rows}

    def mean_ce(logits_of):
        return sum(
            float(F.cross_entropy(logits_of(t)[:, :-1].reshape(-1, D_VOCAB), t[:, 1:].reshape(-1)))
            for t in data
        ) / len(data)

    with torch.no_grad():
        clean = mean_ce(model)
        for name, block, sae in (("tc", 1, tc), ("resid", 2, resid)):
            row = rows[name]
            spliced = mean_ce(lambda t, b=block, s=sae: run_by_hand(model, {b: s}, t))
            kl = sum(
                float(
                    F.kl_div(
                        F.log_softmax(run_by_hand(model, {block: sae}, t)[:, :-1], -1),
                        F.log_softmax(model(t)[:, :-1], -1),
                        log_target=True,
                        reduction="sum",
                    )
                )
                for t in data
            ) / (3 * 2 * 11)
            assert row["ce_clean"] == pytest.approx(clean, rel=1e-5)
            assert row["ce_spliced"] == pytest.approx(spliced, rel=1e-5)
            assert row["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
            assert (
                row["architecture"] == sae.cfg.architecture() and row["k"] is None and row["block"] == block
            )

            # the layer's input and the MLP's output of every token but BOS, read by hand
            xs, ys = [], []
            for t in data:
                got = {}
                run_by_hand(model, {block: sae}, t, lambda s, x, out, got=got: got.update(x=x, y=out) or out)
                xs.append(got["x"][:, 1:].reshape(-1, 16))
                ys.append(got["y"][:, 1:].reshape(-1, 16))
            x, y = torch.cat(xs), torch.cat(ys)
            out, codes = by_hand(sae, x)
            sst = (y - y.mean(0)).pow(2).sum()
            assert row["fvu"] == pytest.approx(float((out - y).pow(2).sum() / sst), rel=1e-4)
            active = codes != 0
            assert row["l0"] == pytest.approx(float(active.sum(-1).float().mean()), rel=1e-6)
            assert row["l0_positive"] == row["l0"]
            assert row["dead_fraction"] == pytest.approx(float((~active.any(0)).float().mean()))
            assert row["always_on"] == int((active.float().mean(0) > 0.5).sum())
            top = codes.argmax(-1, keepdim=True)
            top1 = codes.gather(-1, top) * sae.W_dec[top[:, 0]] + sae.b_dec
            if hasattr(sae, "W_skip"):
                top1 = top1 + x @ sae.W_skip.T
            assert row["top1_fvu"] == pytest.approx(float((top1 - y).pow(2).sum() / sst), rel=1e-4)
            # the Jacobian against what maps the same input to the MLP's output: ln2 then the MLP for
            # the layer reading the residual before ln2
            mlp, ln2 = model.blocks[block].mlp, model.blocks[block].ln2
            if block == 2:
                host = lambda v, mlp=mlp, ln2=ln2: mlp(ln2(v[None]))[0]  # noqa: E731
            else:
                host = lambda v, mlp=mlp: mlp(v[None])[0]  # noqa: E731
            with torch.enable_grad():
                cos = jacobian_cosine_dense(lambda v, s=sae: by_hand(s, v)[0], host, x[:8])
            assert row["jacobian_cos"] == pytest.approx(float(cos.mean()), rel=1e-4, abs=1e-6)
        both = mean_ce(lambda t: run_by_hand(model, {1: tc, 2: resid}, t))
    assert rows["together"]["ce_spliced"] == pytest.approx(both, rel=1e-5)


def test_a_class_with_another_forward_runs_through_it_and_top1_is_nan():
    from sae_lens.saes.transcoder import Transcoder

    class Doubled(Transcoder):
        def forward(self, x):
            return 2 * self.decode(self.encode(x))

    model = make_model("gpt2")
    base = foreign(model, "transcoder")
    doubled = Doubled(base.cfg)
    doubled.load_state_dict(base.state_dict())
    tokens = batches(1)[0]
    with mxd_lens.splice(model, doubled):
        spliced = model(tokens)
    assert torch.equal(spliced, run_by_hand(model, {1: doubled}, tokens))
    (row,) = evaluate(model, [doubled], batches(1), progress=False, jacobian_tokens=4)
    assert row["name"] == "L1.transcoder" and row["top1_fvu"] != row["top1_fvu"]  # NaN
    assert row["l0"] > 0 and row["fvu"] == row["fvu"]


def test_layers_that_do_not_replace_one_mlp_are_refused():
    from sae_lens import StandardSAE, StandardSAEConfig

    model = make_model("gpt2")
    residual = StandardSAE(
        StandardSAEConfig(d_in=16, d_sae=8, metadata=SAEMetadata(hook_name="blocks.1.hook_resid_pre"))
    )
    for call in (
        lambda layer: mxd_lens.splice(model, layer).__enter__(),
        lambda layer: evaluate(model, [layer], batches(1), progress=False),
        hooks.block_of,
    ):
        with pytest.raises(
            ValueError, match=r"reads 'blocks.1.hook_resid_pre' and records no metadata.hook_name_out"
        ):
            call(residual)
    cases = {
        "blocks.1.hook_resid_post": dict(writes="blocks.1.hook_resid_post"),
        "block 0.* but writes 'blocks.1.hook_mlp_out' \\(block 1\\)": dict(
            block=0, writes="blocks.1.hook_mlp_out"
        ),
        "reads 'blocks.1.hook_resid_mid'": dict(reads="hook_resid_mid"),
        "maps 16 -> 8": dict(d_out=8),
        "trained on 'other-model'": dict(metadata_name="other-model"),
    }
    for message, how in cases.items():
        name = how.pop("metadata_name", None)
        sae = foreign(model, "transcoder", **how)
        if name:
            sae.cfg.metadata.model_name = name
        with pytest.raises(ValueError, match=message):
            with mxd_lens.splice(model, sae):
                pass
    # the model name is compared without an organisation prefix
    sae = foreign(model, "transcoder")
    sae.cfg.metadata.model_name = "someorg/TINY-gpt2"
    with mxd_lens.splice(model, sae):
        pass
    with pytest.raises(ValueError, match="normalize_activations='layer_norm'"):
        hooks.block_of(foreign(model, "transcoder", normalize_activations="layer_norm"))
    with pytest.raises(TypeError, match="Linear is not a layer"):
        hooks.block_of(torch.nn.Linear(16, 16))
    a, b = foreign(model, "transcoder"), TopKTranscoder.for_model(model, 1, d_sae=8, k=2)
    with pytest.raises(ValueError, match="two layers target block 1"):
        with mxd_lens.splice(model, a, b):
            pass


def test_eval_verb_on_a_saved_foreign_folder(tmp_path, monkeypatch, capsys):
    import mxd_lens.models
    from mxd_lens.cli import main
    from mxd_lens.evaluation import held_out_batches

    model, corpus = make_text_model(tmp_path)
    asked = []
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: asked.append(name) or model)
    sae = foreign(model, "jumprelu_skip_transcoder", reads="hook_mlp_in")
    sae.cfg.metadata.dataset_path = "some/pile"
    folder = tmp_path / "layers" / "gemma-like"
    sae.save_model(folder)
    before = json.loads((folder / "cfg.json").read_text())
    args = ["eval", str(folder), "--text", str(corpus), "--split", "all", "--eval-tokens", "120"]
    with pytest.warns(
        UserWarning, match="gemma-like is a 'jumprelu_skip_transcoder' layer from elsewhere.*some/pile"
    ):
        assert main([*args, "--context-size", "12"]) == 0
    assert asked == ["tiny-gated"]  # no --model: the model its SAELens metadata names
    assert "gemma-like" in capsys.readouterr().out
    cfg = json.loads((folder / "cfg.json").read_text())
    record = cfg["metadata"].pop("evaluation")
    assert cfg["metadata"].pop("evaluations") == [record]
    assert cfg == before  # only the record was added
    loaded = SAE.load_from_disk(folder)  # and SAELens still loads the folder as it was
    assert type(loaded) is type(sae) and loaded.cfg.metadata.evaluation == record
    for name, p in sae.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    batches = held_out_batches(model, corpus, "all", 120, 12, 8, 0.02, 0)
    (row,) = evaluate(model, {"x": sae}, batches, progress=False)
    for key in ("delta_ce", "kl", "fvu", "l0", "dead_fraction", "top1_fvu", "jacobian_cos"):
        assert record["metrics"][key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), key

    # a residual-stream SAE in the folder is refused, naming the folder and the hook
    from sae_lens import StandardSAE, StandardSAEConfig

    meta = SAEMetadata(model_name="tiny-gated", hook_name="blocks.1.hook_resid_pre")
    StandardSAE(StandardSAEConfig(d_in=16, d_sae=8, metadata=meta)).save_model(tmp_path / "layers" / "resid")
    with pytest.raises(
        SystemExit, match=r"resid: StandardSAE \('standard'\) reads 'blocks.1.hook_resid_pre'"
    ):
        main(["eval", str(tmp_path / "layers"), "--model", "m", "--text", str(corpus), "--split", "all"])
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "cfg.json").write_text(json.dumps({**before, "architecture": "nope"}))
    (tmp_path / "unknown" / "sae_weights.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match="holds architecture 'nope', not one of the SAELens architectures"):
        main(["eval", str(tmp_path / "unknown"), "--model", "m"])

"""The training recipe: normalisation folded exactly into saved weights, AuxK against a dense reference,
one trainer step against a hand-written dense step, epochs over a cache with exact resume, the learning
rate schedule, and clear errors on bad settings."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_reference, make_model
from test_activations import random_rows
from test_training import assert_identical, crash_at, final_weights

import mxd_lens
from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
from mxd_lens.firing import FiringTracker
from mxd_lens.layers import ops
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.training import TrainConfig, Trainer

ARCHS = ("mxd", "transcoder", "skip_transcoder")


def live(kind="gated", rows_per_shard=16, seed=0):
    return ModelActivations(
        make_model(kind), [1], random_rows(seed), context_size=12, rows_per_shard=rows_per_shard
    )


def cfg(**overrides):
    base = dict(
        total_tokens=None if "epochs" in overrides else 64 * 12,
        batch_tokens=64,
        lr=3e-3,
        warmup_steps=3,
        checkpoint_every=4,
        log_every=2,
    )
    return TrainConfig(**{**base, **overrides})


@pytest.mark.parametrize("kind", ["gpt2", "gated"])
def test_normalisation_is_folded_exactly_into_the_saved_layer(tmp_path, kind):
    model = make_model(kind)
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=16)
    specs = [LearnerSpec(arch, 1, k=4) for arch in ARCHS]
    trainer = Trainer(specs, source, cfg(normalize="input_output"), tmp_path, progress=False)
    trainer.fit()
    s_in, s_out = trainer.scales[1]
    x, y = next(source.shards())[1]
    assert abs(s_in - 1) > 0.05 and abs(s_out - 1) > 0.05  # the tiny model's scales are not 1
    torch.testing.assert_close(((x * s_in).pow(2).sum(-1).mean()), torch.tensor(16.0), rtol=0.2, atol=0)
    tokens = torch.stack([r for _, r in zip(range(4), random_rows(9)(), strict=False)])
    for spec in specs:
        saved = mxd_lens.load_layer(tmp_path / "final" / spec.name)
        unfolded = trainer.learners[spec.name].layer
        with torch.no_grad():
            torch.testing.assert_close(saved(x), unfolded(x * s_in) / s_out, rtol=1e-5, atol=1e-5)
            with mxd_lens.splice(model, saved):
                spliced = model(tokens)

            captured: dict[str, torch.Tensor] = {}

            first = int(source.info.drop_first_position)  # trained without position 0: the MLP stays there

            def by_hand(out, hook, layer=unfolded, captured=captured, first=first):
                new = layer(captured["in"] * s_in) / s_out
                new[:, :first] = out[:, :first]
                return new

            handle = model.blocks[1].mlp.register_forward_pre_hook(
                lambda m, a, c=captured: c.update({"in": a[0]})
            )
            try:
                reference = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mlp_out", by_hand)])
            finally:
                handle.remove()
        torch.testing.assert_close(spliced, reference, rtol=1e-5, atol=1e-5)
        record = saved.cfg.metadata.training["normalization"]
        assert record == {"input_scale": s_in, "output_scale": s_out, "folded": True}
        if spec.normalizes_decoder:  # codes carry 1/s_out, so unit decoder rows stay unit
            torch.testing.assert_close(saved.W_dec.norm(dim=-1), torch.ones(saved.cfg.d_sae))


def _dense_aux_reference(layer, x, y, dead, k_aux, coef, loss_scale):
    """The same loss with dense [T, N] codes and plain autograd: an independent formula."""
    k = layer.cfg.k
    pre = x @ layer.W_enc + layer.b_enc
    top = pre.topk(k, dim=-1).indices
    codes = torch.zeros_like(pre).scatter(-1, top, torch.relu(pre.gather(-1, top)))
    chosen = torch.zeros_like(pre, dtype=torch.bool).scatter(-1, top, True)
    allowed = dead[None] & ~chosen
    masked = torch.where(allowed, pre, torch.full_like(pre, float("-inf")))
    aux_idx = masked.topk(k_aux, dim=-1).indices
    raw = pre.gather(-1, aux_idx)
    straight_through = raw + (torch.relu(raw) - raw).detach()  # ReLU'd value, gradient also below zero
    aux_codes = torch.zeros_like(pre).scatter(-1, aux_idx, straight_through)
    mixture, aux_mixture = codes @ layer.W_dec, aux_codes @ layer.W_dec
    if isinstance(layer, mxd_lens.MxD):
        zD = layer.hidden(x) @ layer.W_out
        out, e_hat = zD * mixture + layer.b_dec, zD.detach() * aux_mixture
    else:
        out = (
            mixture
            + layer.b_dec
            + (x @ layer.W_skip if isinstance(layer, mxd_lens.TopKSkipTranscoder) else 0)
        )
        e_hat = aux_mixture
    mse = (out - y).pow(2).sum(-1).mean() / loss_scale
    scale = min(int(dead.sum()) / k_aux, 1.0)
    auxk = scale * (e_hat - (y - out).detach()).pow(2).sum(-1).mean() / loss_scale
    return mse, auxk


@pytest.mark.parametrize("arch", ARCHS)
def test_auxk_matches_a_dense_reference_and_reaches_only_dead_units(arch):
    model = make_model("gated")
    torch.manual_seed(1)
    layer = {
        "mxd": mxd_lens.MxD,
        "transcoder": mxd_lens.TopKTranscoder,
        "skip_transcoder": mxd_lens.TopKSkipTranscoder,
    }[arch].for_model(model, 1, d_sae=48, k=4)
    with torch.no_grad():  # a layer mid-training: every part non-zero
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x, y = torch.randn(50, 16), torch.randn(50, 16)
    dead = torch.zeros(48, dtype=torch.bool)
    dead[torch.randperm(48)[:20]] = True
    with torch.no_grad():
        layer.b_enc[dead] -= 1.0  # dead units sit below zero, where AuxK must still reach them
        # A large decoder bias: the dead units reconstruct the residual without it (the reference decodes
        # without b_dec; sparsify and SAELens once counted it twice: sparsify #132/#134, SAELens 6.36.2).
        layer.b_dec.add_(torch.linspace(-20, 20, layer.b_dec.numel()))
    k_aux, coef, scale = 6, 0.5, 1.7

    def grads(loss):
        layer.zero_grad()
        loss.backward()
        return {
            name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for name, p in layer.named_parameters()
        }

    out = layer.training_forward_pass(
        x, y, loss_scale=scale, dead_mask=dead, k_aux=k_aux, aux_coefficient=coef
    )
    ours = grads(out.loss)
    mse, auxk = _dense_aux_reference(layer, x, y, dead, k_aux, coef, scale)
    torch.testing.assert_close(out.losses["mse"], mse)
    torch.testing.assert_close(out.losses["auxk"], auxk)
    with torch.no_grad():  # and counting the bias would be far off: the check above can tell
        biased = _dense_aux_reference(layer, x, y - layer.b_dec, dead, k_aux, coef, scale)[1]
    assert biased > 2 * auxk
    reference = grads(mse + coef * auxk)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    # The AuxK term alone moves only the dead units: their encoder columns, biases and decoder rows.
    aux_only = grads(_dense_aux_reference(layer, x, y, dead, k_aux, coef, scale)[1])
    assert aux_only["W_enc"][:, ~dead].abs().max() == 0 and aux_only["W_enc"][:, dead].abs().max() > 0
    assert aux_only["b_enc"][~dead].abs().max() == 0 and aux_only["W_dec"][~dead].abs().max() == 0
    for name in set(aux_only) - {"W_enc", "b_enc", "W_dec"}:
        assert aux_only[name].abs().max() == 0, name
    # No dead unit, or no coefficient: no AuxK term at all.
    assert (
        "auxk"
        not in layer.training_forward_pass(
            x, y, dead_mask=torch.zeros(48, dtype=torch.bool), k_aux=6, aux_coefficient=0.5
        ).losses
    )
    assert (
        "auxk" not in layer.training_forward_pass(x, y, dead_mask=dead, k_aux=6, aux_coefficient=0.0).losses
    )


def test_auxk_selection_comes_from_the_topk_matmul_and_avoids_the_topk_units():
    x, W, b = torch.randn(30, 8), torch.randn(8, 40), torch.randn(40)
    dead = torch.zeros(40, dtype=torch.bool)
    dead[::3] = True
    enc = ops.topk_encode(x, W, b, 5, dead, 4)
    pre = x @ W + b
    for t in range(30):
        allowed = [n for n in range(40) if dead[n] and n not in enc.indices[t].tolist()]
        best = sorted(allowed, key=lambda n: -pre[t, n])[:4]
        assert sorted(enc.aux_indices[t].tolist()) == sorted(best)
        torch.testing.assert_close(enc.aux_values[t], pre[t, enc.aux_indices[t]].clamp_min(0))
    assert (pre.gather(-1, enc.aux_indices) < 0).any()  # negative candidates are selected too...
    few = torch.zeros(40, dtype=torch.bool)
    few[:2] = True  # fewer candidates than k_aux: the rest are zeros with no gradient
    Wg = W.clone().requires_grad_()
    out = ops.topk_encode(x, Wg, b, 5, few, 4)
    assert (out.aux_values[:, 2:] == 0).all()
    out.aux_values.sum().backward()
    assert Wg.grad[:, 2:].abs().max() == 0 and Wg.grad[:, :2].abs().max() > 0
    negative = (x @ W + b)[:, :2] < 0  # ...and get a gradient there (straight through the ReLU)
    assert negative.any()
    chosen = torch.stack([(out.indices != c).all(-1) for c in (0, 1)], -1).float()  # a candidate in that row
    torch.testing.assert_close(Wg.grad[:, :2], x.t() @ chosen)  # d(sum)/d(value) = 1, sign regardless
    with pytest.raises(ValueError, match="aux_mask must be a bool tensor of shape \\(40,\\)"):
        ops.topk_encode(x, W, b, 5, torch.ones(39, dtype=torch.bool), 4)


def test_one_trainer_step_equals_a_hand_written_dense_step(tmp_path):
    """Two steps of the trainer (normalisation, nmse, parallel-gradient removal, Adam, renormalisation)
    against the same two steps written out with the dense reference forward and Adam's formula."""
    source = live("gated")
    spec = LearnerSpec("mxd", 1, k=4)
    config = cfg(
        total_tokens=128,
        batch_tokens=64,
        warmup_steps=2,
        lr=1e-2,
        aux_coefficient=0.0,
        lr_schedule="constant",
    )
    trainer = Trainer([spec], source, config, tmp_path / "run", progress=False)
    layer = trainer.learners[spec.name].layer
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    trainer.fit()

    batches = list(zip(range(2), mxd_lens.activations.shuffled_batches(source, 64, seed=0), strict=False))
    xs = torch.cat([b[1][0] for _, b in batches]).double()
    ys = torch.cat([b[1][1] for _, b in batches]).double()
    s_in = float((16 / xs.pow(2).sum(-1).mean()).sqrt())
    s_out = float((16 / ys.pow(2).sum(-1).mean()).sqrt())
    var = float(((ys - ys.mean(0)) * s_out).pow(2).sum(-1).mean())
    assert trainer.scales[1] == pytest.approx((s_in, s_out), rel=1e-12)
    reference = mxd_lens.MxD(layer.cfg)
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for step, (_, batch) in enumerate(batches):
        x, y = batch[1][0] * s_in, batch[1][1] * s_out
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(params[name])
        reference.zero_grad()
        loss = (dense_reference(reference, x) - y).pow(2).sum(-1).mean() / var
        loss.backward()
        lr = 1e-2 * min(1.0, (step + 1) / 2)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                g = p.grad.clone()
                if name == "W_dec":  # remove the component along each (unit) row
                    unit = params[name] / params[name].norm(dim=-1, keepdim=True)
                    g -= (g * unit).sum(-1, keepdim=True) * unit
                m[name] = 0.9 * m[name] + 0.1 * g
                v[name] = 0.999 * v[name] + 0.001 * g * g
                m_hat, v_hat = m[name] / (1 - 0.9 ** (step + 1)), v[name] / (1 - 0.999 ** (step + 1))
                params[name] = params[name] - lr * m_hat / (v_hat.sqrt() + 1e-8)
                if name == "W_dec":
                    params[name] = params[name] / params[name].norm(dim=-1, keepdim=True)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p, params[name].detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_epochs_over_a_cache_resume_mid_epoch_bit_identically(tmp_path, monkeypatch):
    write_cache(live("gpt2"), tmp_path / "cache", n_shards=3, progress=False)  # 3 x 176 = 528 tokens
    specs = [LearnerSpec("mxd", 1, k=4), LearnerSpec("transcoder", 1, k=4)]

    def run(out):
        cache = CachedActivations(tmp_path / "cache", buffer_tokens=128, chunk_tokens=32)
        return Trainer(specs, cache, cfg(epochs=2.5, dead_window_tokens=128), tmp_path / out, progress=False)

    whole = run("whole")
    assert whole.total_tokens == 1280 and whole.total_steps == 20  # 2.5 x 528 = 1320, in whole batches
    whole.fit()
    crash_at(run("broken"), 13, monkeypatch)  # in the middle of the second epoch, after the checkpoint at 12
    resumed = run("broken")
    resumed.fit(resume=True)
    assert resumed.tokens_seen == 1280
    assert_identical(final_weights(tmp_path / "whole"), final_weights(tmp_path / "broken"))
    saved = mxd_lens.load_layer(tmp_path / "whole" / "final" / specs[0].name)
    assert saved.cfg.metadata.training["epochs"] == pytest.approx(1280 / 528)


def test_auxk_revives_dead_units(tmp_path):
    """The same run with and without AuxK: AuxK leaves fewer units dead."""
    source = live("gated")
    spec = [LearnerSpec("transcoder", 1, k=2, width_multiplier=16)]
    dead = {}
    for coef in (0.0, 1.0):
        trainer = Trainer(
            spec,
            source,
            # unclipped: on this random model most steps' norms exceed 1, and clipping the joint
            # gradient would test the clip's share-out rather than AuxK
            cfg(total_tokens=64 * 60, aux_coefficient=coef, dead_window_tokens=256, k_aux=32, grad_clip=None),
            tmp_path / str(coef),
            progress=False,
        )
        trainer.fit()
        dead[coef] = trainer.learners[spec[0].name].firing.dead_fraction(256)
    assert dead[1.0] < dead[0.0]


def test_learning_rate_schedule():
    c = TrainConfig(
        total_tokens=100,
        batch_tokens=1,
        lr=1.0,
        warmup_steps=10,
        lr_schedule="linear",
        decay_fraction=0.2,
        lr_floor=0.1,
    )
    lrs = [c.lr_at(s, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[79] == 1.0
    assert lrs[80] == pytest.approx(1 - 0.9 / 20) and lrs[99] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    cos = TrainConfig(
        total_tokens=100, batch_tokens=1, lr=1.0, warmup_steps=0, lr_schedule="cosine", lr_floor=0.0
    )
    assert cos.lr_at(89, 100) == pytest.approx(0.5) and cos.lr_at(99, 100) == pytest.approx(0.0, abs=1e-12)
    assert (
        TrainConfig(total_tokens=1000, batch_tokens=1, lr_schedule="constant").lr_at(999, 1000)
        == TrainConfig.lr
    )
    assert TrainConfig(total_tokens=128 * 512, batch_tokens=512).warmup_for(128) == 6  # a fraction, not 5,000


def test_text_log_lines_without_a_progress_bar(tmp_path, capsys):
    Trainer([LearnerSpec("mxd", 1, k=4)], live(), cfg(log_every=4), tmp_path, progress=False).fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]  # the logger
    assert [line.split()[1] for line in lines] == ["4/12", "8/12", "12/12"]
    assert "L1.mxd.k4.m8: fvu" in lines[0] and "dead" in lines[0]


def test_firing_tracker_defines_dead_by_a_window():
    t = FiringTracker(4)
    t.update(torch.tensor([[1.0, 0.0]]), torch.tensor([[0, 1]]), n_tokens=10)  # unit 0 fires, 1 has value 0
    assert not t.dead_mask(20).any()  # fewer than one window of tokens: nothing is dead yet
    t.update(torch.tensor([[1.0]]), torch.tensor([[2]]), n_tokens=10)
    assert t.dead_mask(10).tolist() == [True, True, False, True]
    assert t.dead_mask().tolist() == [False, True, False, True]  # default window: every token seen


def test_bad_recipe_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="epochs need an activation cache"):
        Trainer([LearnerSpec("mxd", 1, k=4)], live(), TrainConfig(epochs=2), tmp_path)
    with pytest.raises(ValueError, match="aux_coefficient=-0.1 must be >= 0"):
        TrainConfig(total_tokens=2048, aux_coefficient=-0.1)
    with pytest.raises(ValueError, match="k_aux=0 must be positive"):
        TrainConfig(total_tokens=2048, k_aux=0)
    with pytest.raises(ValueError, match="k_aux=500 exceeds the"):
        Trainer([LearnerSpec("mxd", 1, k=4)], live(), cfg(k_aux=500), tmp_path)
    with pytest.raises(ValueError, match="give exactly one of total_tokens"):
        TrainConfig(total_tokens=2048, epochs=1.0)
    with pytest.raises(ValueError, match="normalize='batch'"):
        TrainConfig(total_tokens=2048, normalize="batch")
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        TrainConfig(total_tokens=2048, lr_schedule="step")
    with pytest.warns(UserWarning, match="read the cache 11.0 times"):
        write_cache(live("gpt2"), tmp_path / "c", n_shards=1, progress=False)
        Trainer(
            [LearnerSpec("mxd", 1, k=4)],
            CachedActivations(tmp_path / "c"),
            cfg(epochs=11, batch_tokens=16),
            tmp_path / "r",
        )


def test_a_layer_built_by_the_caller_trains_in_place_without_an_out_dir(tmp_path, monkeypatch):
    """MxD.from_mlp (the host MLP itself, at raw scale) handed to the trainer: moved into the scaled
    space exactly (its first-batch FVU is ~0), trained in place, back at raw scale from
    trained_layers(); with no out_dir nothing is written. A spec with d_sae gets exactly that many units."""
    monkeypatch.chdir(tmp_path)
    model = make_model("gated")
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=16)
    exact = mxd_lens.MxD.from_mlp(model, 1, n_experts=16, k=1)
    x, y = next(source.shards())[1]
    config = cfg(lr=1e-12, warmup_steps=1, total_tokens=2 * 64, log_every=1)
    trainer = Trainer([exact, LearnerSpec("transcoder", 1, k=4, d_sae=40)], source, config, progress=False)
    metrics = trainer.fit()
    assert list(trainer.learners) == ["L1.mxd.k1.n16.init-given", "L1.transcoder.k4.n40"]
    assert trainer.learners["L1.mxd.k1.n16.init-given"].layer is exact  # trained in place
    assert metrics["L1.mxd.k1.n16.init-given"]["fvu"] < 1e-6  # still the MLP, on scaled activations
    trained = trainer.trained_layers()
    assert trained["L1.transcoder.k4.n40"].cfg.d_sae == 40
    with torch.no_grad():
        torch.testing.assert_close(trained["L1.mxd.k1.n16.init-given"](x), y, rtol=1e-4, atol=1e-5)
    assert list(tmp_path.iterdir()) == []  # no out_dir: no checkpoints, no final folder
    with pytest.raises(ValueError, match="resume needs the out_dir"):
        trainer.fit(resume=True)
    with pytest.raises(ValueError, match="pass the layer itself"):
        Trainer([LearnerSpec("mxd", 1, k=4, init="given")], source, config)
    other = mxd_lens.MxD.from_mlp(make_model("gpt2"), 1, n_experts=16, k=1)
    with pytest.raises(ValueError, match="built for 'tiny-gpt2'"):
        Trainer([other], source, config)


def test_trainer_standardises_the_gate_and_saves_the_same_map(tmp_path):
    """MxD(gate_standardize=1): after each step the gate's pre-activations on that step's batch are
    standardised, so at the end each expert's pre-activation over the last batch has mean ~0 and std ~1
    (measured by hand on the saved, folded layer at the training scale); the saved layer is the map."""
    source = live()
    spec = LearnerSpec("mxd:gate=topk,gate_standardize=1", 1, k=4)
    trainer = Trainer([spec], source, cfg(), tmp_path, progress=False)
    trainer.fit()
    learner = trainer.learners[spec.name]
    assert "gate_mean_max" in learner.history[-1]
    x = next(source.shards())[1][0] * trainer.scales[1][0]
    pre = x @ learner.layer.W_enc.detach() + learner.layer.b_enc.detach()
    # measured: median |std - 1| 0.085 with it, 0.49 without (same seed, same steps)
    assert pre.std(0, unbiased=False).sub(1).abs().median() < 0.2
    saved = mxd_lens.load_layer(tmp_path / "final" / spec.name)
    assert saved.cfg.gate_standardize == 1 and saved.cfg.gate == "topk"
    raw = next(source.shards())[1][0]
    torch.testing.assert_close(saved(raw), dense_reference(saved, raw))

"""SPD core: sites, components swapped in by hooks, CI functions, losses, trainer.

Checks compare against computations written out here from TransformerLens's own parameters and caches
(dense weight copies of the model, hand-computed component terms), not against the hooks themselves.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import D_VOCAB, make_model
from transformer_lens import HookedTransformer, HookedTransformerConfig

from mxd_lens.loop import TrainingDiverged
from mxd_lens.spd import (
    Decomposition,
    SPDConfig,
    SPDTrainer,
    decomposable_weights,
    lower_leaky_hard_sigmoid,
    subset_routing,
    upper_leaky_hard_sigmoid,
)


def make_attn_only(
    seed: int = 0, n_ctx: int = 12, d_vocab: int = D_VOCAB, heads: int = 2, norm: str | None = "LN"
):
    """2 attention-only layers, Shortformer positions (added to Q and K inputs only)."""
    torch.manual_seed(seed)
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=16,
        n_ctx=n_ctx,
        d_head=16 // heads,
        n_heads=heads,
        d_vocab=d_vocab,
        attn_only=True,
        normalization_type=norm,
        positional_embedding_type="shortformer",
        seed=seed,
        device="cpu",
        model_name="tiny-shortformer",
    )
    model = HookedTransformer(cfg)
    with torch.no_grad():
        model.W_pos.mul_(5)  # make the position term matter
        for name, param in model.named_parameters():
            if name.endswith(("b_Q", "b_K", "b_V", "b_O")):
                param.copy_(0.3 * torch.randn_like(param))
    return model.eval()


def make_gqa():
    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=16, n_ctx=12, d_head=4, n_heads=4, n_key_value_heads=2, d_mlp=32,
        d_vocab=D_VOCAB, act_fn="silu", gated_mlp=True, normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=4, seed=0, device="cpu", model_name="tiny-gqa",
    )  # fmt: skip
    return HookedTransformer(cfg).eval()


MODELS = {
    "gpt2": lambda: make_model("gpt2"),
    "gated": lambda: make_model("gated"),
    "parallel": lambda: make_model("parallel"),
    "shortformer": make_attn_only,
    "gqa": make_gqa,
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is faster, and two spin-wait badly when another job holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))


def dense_W(model: HookedTransformer, name: str) -> torch.Tensor:
    """W ∈ R^{d_out×d_in} straight from the TransformerLens parameter."""
    _, layer, part, kind = name.split(".")
    module = getattr(model.blocks[int(layer)], part)
    if kind in ("W_K", "W_V") and model.cfg.n_key_value_heads:
        kind = "_" + kind
    W = getattr(module, kind).detach()
    if kind == "W_O":  # [heads, d_head, d_model]: out o, in (h, j)
        return W.reshape(-1, W.shape[-1]).T
    if W.ndim == 3:  # [heads, d_model, d_head]: out (h, j), in i
        return W.permute(0, 2, 1).reshape(-1, W.shape[1])
    return W.T  # MLP [d_in, d_out]


def set_dense_W(model: HookedTransformer, name: str, W: torch.Tensor) -> None:
    _, layer, part, kind = name.split(".")
    module = getattr(model.blocks[int(layer)], part)
    if kind in ("W_K", "W_V") and model.cfg.n_key_value_heads:
        kind = "_" + kind
    param = getattr(module, kind)
    with torch.no_grad():
        if kind == "W_O":
            param.copy_(W.T.reshape(param.shape))
        elif param.ndim == 3:
            heads, d_model, d_head = param.shape
            param.copy_(W.reshape(heads, d_head, d_model).permute(0, 2, 1))
        else:
            param.copy_(W.T)


# -- names and errors ------------------------------------------------------------------------------
def test_names_and_bad_names():
    gated, gpt2, attn_only = make_model("gated"), make_model("gpt2"), make_attn_only()
    assert decomposable_weights(gated)[:7] == [
        f"blocks.0.{n}"
        for n in ("attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O", "mlp.W_in", "mlp.W_gate", "mlp.W_out")
    ]
    assert "blocks.0.mlp.W_gate" not in decomposable_weights(gpt2)
    assert decomposable_weights(attn_only) == [f"blocks.{L}.attn.W_{k}" for L in (0, 1) for k in "QKVO"]
    for model, name, message in [
        (gpt2, "blocks.0.attn.W_X", "Valid names are blocks.L.{attn.W_Q"),
        (gpt2, "blocks.7.attn.W_Q", "no block 7"),
        (gpt2, "blocks.0.mlp.W_gate", "not gated"),
        (attn_only, "blocks.0.mlp.W_in", "attention-only"),
        (gpt2, "W_Q", "not a weight name"),
    ]:
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("{", r"\{")):
            Decomposition(model, [name], C=4)
    for C in (0, -3, 2.5):
        with pytest.raises(ValueError, match="positive int"):
            Decomposition(gpt2, ["blocks.0.attn.W_Q"], C=C)
        with pytest.raises(ValueError, match="positive int"):
            SPDConfig(C=C)
    with pytest.raises(ValueError, match="each once"):
        Decomposition(gpt2, ["blocks.0.attn.W_Q"] * 2, C=4)


def test_bad_masks_are_named(tokens):
    model = make_model("gpt2")
    names = ["blocks.0.attn.W_Q", "blocks.1.mlp.W_out"]
    decomp = Decomposition(model, names, C=4)
    good = torch.ones(3, 12, 4)
    with pytest.raises(ValueError, match=r"masks\['blocks.1.mlp.W_out'\] has shape \(3, 12, 5\), expected"):
        with decomp.patched({names[1]: torch.ones(3, 12, 5)}):
            pass
    with pytest.raises(
        ValueError, match=r"masks\['blocks.0.attn.W_Q'\] has shape \(2, 12, 4\), expected \(3, 12, 4\)"
    ):
        with decomp.patched({names[0]: torch.ones(2, 12, 4)}):
            model(tokens)
    with pytest.raises(
        ValueError, match=r"delta_masks\['blocks.0.attn.W_Q'\] has shape \(3, 11\), expected \(3, 12\)"
    ):
        with decomp.patched(delta_masks={names[0]: torch.ones(3, 11)}):
            model(tokens)
    with pytest.raises(ValueError, match="must be a bool tensor"):
        with decomp.patched(routing={names[0]: torch.ones(3, 12)}):
            pass
    with pytest.raises(ValueError, match="not patched here"):
        with decomp.patched({"blocks.2.attn.W_Q": good}):
            pass
    # a failed forward leaves no hooks behind
    torch.testing.assert_close(model(tokens), make_model("gpt2")(tokens))


def test_config_validation():
    with pytest.raises(ValueError, match="nothing to train"):
        SPDConfig(faithfulness=0, stochastic_recon=0, subset_recon=0, layerwise_recon=0, ci_masked_recon=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        SPDConfig(minimality=-1e-3)
    with pytest.raises(ValueError, match="must be >= 0"):
        SPDConfig(stochastic_recon=float("nan"))
    with pytest.raises(ValueError, match="mask_type"):
        SPDConfig(mask_type="gaussian")
    SPDConfig(faithfulness=0, stochastic_recon=0, subset_recon=0, ci_masked_recon=1)  # one term is enough


# -- components ------------------------------------------------------------------------------------
def test_svd_components_sum_to_W():
    model = make_model("gated")
    names = decomposable_weights(model)
    decomp = Decomposition(model, names, C=16).init_from_svd()  # 16 >= min(d_in, d_out) everywhere
    assert decomp.faithfulness_loss() < 1e-12
    for name in names:
        torch.testing.assert_close(decomp.weights(name), dense_W(model, name), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decomp.target_weight(name), dense_W(model, name))
    random = Decomposition(model, names, C=16)
    expected = sum(((dense_W(model, n) - random.weights(n)) ** 2).sum() for n in names) / sum(
        dense_W(model, n).numel() for n in names
    )
    torch.testing.assert_close(random.faithfulness_loss(), expected)


@pytest.mark.parametrize("kind", list(MODELS))
def test_decomposed_model_matches_dense_weights(kind):
    """Ones masks reproduce the model; constant masks m, m_Δ equal the model with each W replaced by
    (V diag(m) U)ᵀ + m_Δ ΔW (delta on) or (V diag(m) U)ᵀ (delta off), built by hand."""
    model = MODELS[kind]()
    names = decomposable_weights(model)
    tokens = torch.randint(
        0, model.cfg.d_vocab, (2, model.cfg.n_ctx), generator=torch.Generator().manual_seed(3)
    )
    clean = model(tokens)
    decomp = Decomposition(model, names, C=6, seed=1)
    b, p = tokens.shape
    with decomp.patched():
        torch.testing.assert_close(model(tokens), clean, atol=0, rtol=0)
    ones = {n: torch.ones(b, p, 6) for n in names}
    with decomp.patched(ones, {n: torch.ones(b, p) for n in names}):
        torch.testing.assert_close(model(tokens), clean, atol=1e-5, rtol=1e-5)

    g = torch.Generator().manual_seed(4)
    m = {n: torch.rand(6, generator=g) for n in names}
    m_delta = {n: float(torch.rand((), generator=g)) for n in names}
    masks = {n: m[n].expand(b, p, 6) for n in names}
    delta_masks = {n: torch.full((b, p), m_delta[n]) for n in names}
    for delta in (True, False):
        decomp.delta = delta
        reference = copy.deepcopy(model)
        for n in names:
            part = decomp.components[n.replace(".", "-")]
            components = (part.V.detach() * m[n]) @ part.U.detach()  # Σ_c m_c v_c u_c, [d_in, d_out]
            W = components.T + (m_delta[n] * (dense_W(model, n) - decomp.weights(n).detach()) if delta else 0)
            set_dense_W(reference, n, W)
        with decomp.patched(masks, delta_masks):
            torch.testing.assert_close(model(tokens), reference(tokens), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(model(tokens), clean, atol=0, rtol=0)  # hooks gone, weights untouched


@pytest.mark.parametrize(
    "name, input_of",
    [
        ("blocks.0.attn.W_Q", lambda m, c: m.blocks[0].ln1(c["blocks.0.hook_resid_pre"])),
        ("blocks.0.attn.W_V", lambda m, c: m.blocks[0].ln1(c["blocks.0.hook_resid_pre"])),
        ("blocks.0.attn.W_O", lambda m, c: c["blocks.0.attn.hook_z"].flatten(2)),
        ("blocks.0.mlp.W_in", lambda m, c: m.blocks[0].ln2(c["blocks.0.hook_resid_mid"])),
        ("blocks.0.mlp.W_gate", lambda m, c: m.blocks[0].ln2(c["blocks.0.hook_resid_mid"])),
        ("blocks.0.mlp.W_out", lambda m, c: c["blocks.0.mlp.hook_post"]),
    ],
)
def test_masking_one_component_removes_its_term(name, input_of, tokens):
    """m_c = 0 at one position changes the module's output there by exactly −(x v_c) u_c."""
    model = make_model("gated")
    decomp = Decomposition(model, [name], C=5, seed=2)
    writes = decomp.sites[name].writes
    _, cache = model.run_with_cache(tokens)
    x = input_of(model, cache)
    masks = torch.ones(3, 12, 5)
    masks[1, 4, 3] = 0.0
    seen = {}
    with (
        decomp.patched({name: masks}, {name: torch.ones(3, 12)}),
        model.hooks(fwd_hooks=[(writes, lambda value, hook: seen.update(out=value.clone()))]),
    ):
        model(tokens)
    part = decomp.components[name.replace(".", "-")]
    v, u = part.V[:, 3].detach(), part.U[3].detach()
    expected = cache[writes].flatten(2).clone()
    expected[1, 4] -= (x[1, 4] @ v) * u
    torch.testing.assert_close(seen["out"].flatten(2), expected, atol=1e-5, rtol=1e-5)


def test_hard_sigmoid_backward():
    z = torch.tensor([-0.5, -0.5, 0.0, 0.3, 0.3, 1.5, 1.5], requires_grad=True)
    G = torch.tensor([-1.0, 1.0, -2.0, 2.0, -2.0, -1.0, 1.0])  # dL/dg
    g = lower_leaky_hard_sigmoid(z)
    torch.testing.assert_close(g.detach(), torch.tensor([0, 0, 0, 0.3, 0.3, 1, 1]))
    (grad,) = torch.autograd.grad(g, z, G)
    torch.testing.assert_close(grad, torch.tensor([-0.01, 0.0, -0.02, 2.0, -2.0, 0.0, 0.0]))
    g_upper = upper_leaky_hard_sigmoid(z)
    torch.testing.assert_close(g_upper.detach(), torch.tensor([0, 0, 0, 0.3, 0.3, 1.005, 1.005]))
    (grad,) = torch.autograd.grad(g_upper, z, G)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -2.0, 2.0, -2.0, -0.01, 0.01]))


def test_subset_routing_replaces_exactly_the_drawn_modules():
    """Zero components without ΔW output just the bias where routed, the original elsewhere. In a
    parallel block Q, K, V and W_in all read the clean residual, so the original is the clean cache."""
    model = make_model("parallel")
    with torch.no_grad():
        for L in range(3):
            for bias in (model.blocks[L].attn.b_Q, model.blocks[L].attn.b_K, model.blocks[L].attn.b_V):
                bias.copy_(torch.randn_like(bias))
    names = ["blocks.0.attn.W_Q", "blocks.0.attn.W_K", "blocks.0.attn.W_V", "blocks.0.mlp.W_in"]
    decomp = Decomposition(model, names, C=4, delta=False)
    with torch.no_grad():
        for part in decomp.components.values():
            part.V.zero_()
    tokens = torch.randint(0, D_VOCAB, (4, 12), generator=torch.Generator().manual_seed(5))
    routing = subset_routing(names, (4, 12), torch.Generator().manual_seed(6))
    counts = torch.stack(list(routing.values())).sum(0)
    assert counts.min() >= 1 and counts.max() <= 4 and len(counts.unique()) >= 3
    _, clean = model.run_with_cache(tokens)
    seen = {}
    hooks = [
        (decomp.sites[n].writes, lambda v, hook, n=n: seen.update({n: v.flatten(2).clone()})) for n in names
    ]
    with decomp.patched(routing=routing), model.hooks(fwd_hooks=hooks):
        model(tokens)
    for n in names:
        bias = decomp.components[n.replace(".", "-")].bias
        original = clean[decomp.sites[n].writes].flatten(2)
        expected = torch.where(routing[n][..., None], bias.expand_as(original), original)
        torch.testing.assert_close(seen[n], expected)
        assert not torch.allclose(bias.expand_as(original), original)


# -- causal importance -----------------------------------------------------------------------------
def test_sequence_ci_is_causal_and_token_ci_is_local():
    model = make_attn_only()
    names = decomposable_weights(model)
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % D_VOCAB
    sequence = Decomposition(model, names, C=8, ci="sequence")
    before, after = sequence.causal_importance(model, tokens), sequence.causal_importance(model, changed)
    for n in names:
        for i in range(2):  # g and g_upper
            assert before[n][i].shape == (2, 12, 8)
            torch.testing.assert_close(before[n][i][:, :6], after[n][i][:, :6], atol=1e-6, rtol=0)
    assert any(not torch.allclose(before[n][0][:, 6:], after[n][0][:, 6:]) for n in names)

    # token CI: a position's g depends on its own input only (shuffle positions: g shuffles along);
    # sequence CI does not (it attends to the prefix).
    token = Decomposition(model, names, C=8, ci="token")
    _, inputs = token.run_clean(model, tokens)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(8))
    shuffled = {n: x[:, perm] for n, x in inputs.items()}
    for decomp, local in ((token, True), (sequence, False)):
        base, moved = decomp.ci_from_inputs(inputs), decomp.ci_from_inputs(shuffled)
        same = all(torch.allclose(base[n][0][:, perm], moved[n][0], atol=1e-6) for n in names)
        assert same == local


# -- training --------------------------------------------------------------------------------------
def _induction_like_model():
    model = make_attn_only(n_ctx=16, d_vocab=20, heads=1, norm=None)
    with torch.no_grad():
        model.W_U.mul_(4)  # sharper logits so that the KL terms carry signal
    return model


def _batches(step: int) -> torch.Tensor:
    return torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(1000 + step))


class Interrupted(Exception):
    pass


def interrupted(step: int) -> torch.Tensor:
    """The batches, until a kill at step 5."""
    if step == 5:
        raise Interrupted
    return _batches(step)


def _config(**changes) -> SPDConfig:
    base = dict(C=8, steps=8, batch_size=4, lr=1e-2, checkpoint_every=3, log_every=1, layerwise_recon=1.0,
                ci_masked_recon=1.0, faithfulness=10.0, minimality=1e-3)  # fmt: skip
    return SPDConfig(**{**base, **changes})


def test_training_reduces_loss_and_evaluates(tmp_path):
    model = _induction_like_model()
    names = decomposable_weights(model)
    trainer = SPDTrainer(
        model, names, _batches, _config(steps=30, checkpoint_every=0), tmp_path, progress=False
    )
    before = trainer.evaluate(_batches(999))
    final = trainer.fit()
    after = trainer.evaluate(_batches(999))
    losses = [h["loss"] for h in trainer.history]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert after["kl_stochastic"] < before["kl_stochastic"] and after["faithfulness"] < before["faithfulness"]
    assert final["loss"] == losses[-1] and set(after["ci_l0"]) == set(names)
    assert all(0 <= after["alive"][n] <= 8 for n in names) and after["kl_unmasked"] < 1e-6
    assert all(p.requires_grad for p in model.parameters())  # restored after fit
    assert json.loads((tmp_path / "metrics.json").read_text())[-1]["step"] == 30
    assert (tmp_path / "checkpoints" / "step_000000030" / "state.pt").is_file()


def test_resume_is_exact(tmp_path):
    model = _induction_like_model()
    names = ["blocks.0.attn.W_Q", "blocks.1.attn.W_V", "blocks.1.attn.W_O"]
    whole = SPDTrainer(model, names, _batches, _config(), tmp_path / "whole", progress=False)
    whole.fit()

    first = SPDTrainer(model, names, interrupted, _config(), tmp_path / "broken", progress=False)
    with pytest.raises(Interrupted):
        first.fit()
    second = SPDTrainer(model, names, iter([_batches(s) for s in range(8)]), _config(), tmp_path / "broken",
                        progress=False)  # fmt: skip
    second.fit(resume=True)
    assert second.step == 8
    for key, value in whole.decomposition.state_dict().items():
        assert torch.equal(value, second.decomposition.state_dict()[key]), key
    assert second.history == whole.history
    with pytest.raises(ValueError, match="other settings"):
        SPDTrainer(model, names, _batches, _config(C=4), tmp_path / "broken", progress=False).fit()


def test_nan_raises_and_keeps_last_checkpoint(tmp_path):
    model = _induction_like_model()
    names = ["blocks.0.attn.W_Q", "blocks.0.attn.W_K"]
    trainer = SPDTrainer(model, names, _batches, _config(checkpoint_every=2), tmp_path, progress=False)

    def poisoned(step):
        if step == 3:
            with torch.no_grad():
                trainer.decomposition.components["blocks-0-attn-W_Q"].V.fill_(float("nan"))
        return _batches(step)

    trainer.batches = poisoned
    with pytest.raises(TrainingDiverged, match="step_000000002"):
        trainer.fit()
    resumed = SPDTrainer(model, names, _batches, _config(checkpoint_every=2), tmp_path, progress=False)
    resumed.load_checkpoint()
    assert resumed.step == 2
    assert all(torch.isfinite(v).all() for v in resumed.decomposition.state_dict().values())

    # a finite loss whose update leaves NaN weights: the checkpoint after it is not written
    nan_grads = SPDTrainer(
        model, names, _batches, _config(checkpoint_every=1), tmp_path / "b", progress=False
    )
    nan_grads.decomposition.components["blocks-0-attn-W_K"].U.register_hook(lambda g: g * float("nan"))
    with pytest.raises(TrainingDiverged, match="not finite after step 1"):
        nan_grads.fit()
    assert nan_grads.latest_checkpoint() is None


def test_bad_batch_is_named(tmp_path):
    trainer = SPDTrainer(_induction_like_model(), ["blocks.0.attn.W_Q"], lambda s: torch.zeros(3, 16).long(),
                         _config(), tmp_path, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"shape \(3, 16\); expected integer tokens of shape \(batch_size=4"):
        trainer.fit()


def test_fused_runs_equal_separate_forwards():
    from mxd_lens.spd import reconstruction_losses

    model = make_model("gpt2")
    decomp = Decomposition(model, decomposable_weights(model)[:5], C=4)
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    target, inputs = decomp.run_clean(model, tokens)
    ci = decomp.ci_from_inputs(inputs)
    fused, separate = (
        reconstruction_losses(
            decomp, tokens, target, ci, generator=torch.Generator().manual_seed(0), fuse=fuse
        )
        for fuse in (True, False)
    )
    assert set(fused) == {"stochastic_recon", "layerwise_recon", "subset_recon", "ci_masked_recon"}
    for term in fused:
        assert fused[term] > 0
        torch.testing.assert_close(fused[term], separate[term], rtol=1e-4, atol=1e-7)


# -- normalisation, p schedule, faithfulness warmup (issue 16) --------------------------------------
def test_minimality_sum_is_the_per_sequence_sum_of_the_per_position_terms():
    from mxd_lens.spd.losses import importance_minimality_loss

    g = torch.rand(3, 5, 4, generator=torch.Generator().manual_seed(0))
    ci = {"a": (g, g), "b": (g * 0.5, g * 0.5)}
    by_hand = sum(((u + 1e-12) ** 0.7).sum(-1) for _, u in ci.values())  # [b, p]
    torch.testing.assert_close(importance_minimality_loss(ci, 0.7), by_hand.mean())
    torch.testing.assert_close(importance_minimality_loss(ci, 0.7, reduce="sum"), by_hand.sum(-1).mean())
    torch.testing.assert_close(importance_minimality_loss(ci, 0.7, reduce="sum"), 5 * by_hand.mean())
    with pytest.raises(ValueError, match="reduce='max'"):
        importance_minimality_loss(ci, 0.7, reduce="max")


def test_p_schedule_anneals_over_the_given_fraction_then_stays():
    config = SPDConfig(steps=101, p_start=2.0, p_end=0.1, p_anneal_fraction=0.2)
    assert config.p_at(0) == 2.0 and config.p_at(10) == pytest.approx(2.0 - 1.9 * 10 / 20)
    assert config.p_at(20) == pytest.approx(0.1) and config.p_at(100) == pytest.approx(0.1)
    linear = SPDConfig(steps=101, p_start=2.0, p_end=1.0)  # the default: over the whole run
    assert linear.p_at(50) == pytest.approx(1.5) and linear.p_at(100) == pytest.approx(1.0)
    assert SPDConfig(p_start=0.1, p_end=0.1).p_at(7) == 0.1  # the reference's constant p
    with pytest.raises(ValueError, match="p_anneal_fraction=0"):
        SPDConfig(p_anneal_fraction=0)
    with pytest.raises(ValueError, match="minimality_reduce='max'"):
        SPDConfig(minimality_reduce="max")


def test_faithfulness_warmup_fits_the_components_first_and_resume_stays_exact(tmp_path):
    model = _induction_like_model()
    names = ["blocks.0.attn.W_Q", "blocks.1.attn.W_V"]
    config = _config(faithfulness_warmup_steps=200, minimality_reduce="sum", positions="last")
    cold = SPDTrainer(model, names, _batches, _config(steps=1), tmp_path / "cold", progress=False)
    warm = SPDTrainer(model, names, _batches, config, tmp_path / "warm", progress=False)
    ci_before = {k: v.clone() for k, v in warm.decomposition.state_dict().items() if k.startswith("ci.")}
    record = warm.faithfulness_warmup()
    assert record["faithfulness_end"] < 0.05 * record["faithfulness_start"]
    assert record["faithfulness_start"] == pytest.approx(
        float(cold.decomposition.faithfulness_loss().detach())
    )
    for key, value in ci_before.items():  # the CI functions are not touched
        assert torch.equal(value, warm.decomposition.state_dict()[key]), key
    whole = SPDTrainer(model, names, _batches, config, tmp_path / "whole", progress=False)
    whole.fit()
    assert json.loads((tmp_path / "whole" / "faithfulness_warmup.json").read_text()) == record

    with pytest.raises(Interrupted):
        SPDTrainer(model, names, interrupted, config, tmp_path / "broken", progress=False).fit()
    again = SPDTrainer(model, names, _batches, config, tmp_path / "broken", progress=False)
    again.fit(resume=True)  # from step 3's checkpoint: no second warmup
    for key, value in whole.decomposition.state_dict().items():
        assert torch.equal(value, again.decomposition.state_dict()[key]), key


def test_a_checkpoint_from_another_device_type_is_refused_by_name(tmp_path):
    """A CUDA generator's state (16 bytes) cannot drive a CPU one (5,056): a run resumes on its device type."""
    model = _induction_like_model()
    names = ["blocks.0.attn.W_Q"]
    SPDTrainer(model, names, _batches, _config(steps=3), tmp_path, progress=False).fit()
    path = tmp_path / "checkpoints" / "step_000000003" / "state.pt"
    state = torch.load(path, weights_only=True)
    state["generator"] = torch.zeros(16, dtype=torch.uint8)  # the shape of a CUDA generator's state
    torch.save(state, path)
    with pytest.raises(ValueError, match="another kind of device than cpu"):
        SPDTrainer(model, names, _batches, _config(steps=6), tmp_path, progress=False).fit(resume=True)

"""MxD's gates and usage controller, the usage diagnostics and the Jacobian cosine, each against an
independent reference: dense autograd, a brute-force count, the full Jacobian."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import dense_reference, make_model, randomise

from mxd_lens import MxD, MxDConfig, TopKTranscoder, TopKTranscoderConfig
from mxd_lens.evaluation import evaluate
from mxd_lens.jacobian import jacobian_cosine, jacobian_cosine_dense
from mxd_lens.layers import arch_label, format_arch, ops, parse_arch

I, O, H, N, K = 6, 5, 7, 13, 3
SEED = 1  # x and the upstream gradient: a draw where some selected pre-activations are negative


def make_mxd(gate="topk", dtype="float32", **kw):
    cfg = MxDConfig(
        d_in=I, d_out=O, d_sae=N, k=K, d_hidden=H, activation="gelu_new", gate=gate, dtype=dtype, **kw
    )
    return randomise(MxD(cfg), scale=0.5)


def test_signed_gate_keeps_negative_codes_and_their_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, I, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(I, N, dtype=torch.float64, generator=g, requires_grad=True)
    b = (torch.randn(N, dtype=torch.float64, generator=g) - 3).requires_grad_(True)  # most negative
    values, indices = ops.topk_encode(x, W, b, K, relu=False)[:2]
    pre = x @ W + b
    torch.testing.assert_close(values, pre.topk(K, dim=-1).values)  # the K largest, signed
    assert (values < 0).any()
    assert torch.autograd.gradcheck(lambda x, W, b: ops.topk_encode(x, W, b, K, relu=False)[0], (x, W, b))
    dense = ops.topk_encode_dense(x, W, b, K, relu=False)
    assert ((dense != 0).sum(-1) == K).all()


@pytest.mark.parametrize("gate", ["relu_topk", "topk"])
@pytest.mark.parametrize("form", ["mlp", "glu"])
def test_each_gate_equals_the_dense_reference_forward_and_backward(gate, form):
    fast, ref = (
        randomise(
            MxD(
                MxDConfig(
                    d_in=I,
                    d_out=O,
                    d_sae=N,
                    k=K,
                    d_hidden=H,
                    hidden_form=form,
                    activation="silu",
                    gate=gate,
                    dtype="float64",
                )
            ),
            scale=0.5,
        )  # fmt: skip
        for _ in range(2)
    )
    with torch.no_grad():
        for layer in (fast, ref):
            layer.b_enc[::2] -= 3.0  # negative selected pre-activations: the gates differ there
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(11, I, dtype=torch.float64, generator=g)
    upstream = torch.randn(11, O, dtype=torch.float64, generator=g)
    grads, outs = [], []
    for layer, fn in ((fast, fast.forward), (ref, lambda t: dense_reference(ref, t))):
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        (out * upstream).sum().backward()
        outs.append(out.detach())
        grads.append({"x": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-10, atol=1e-12, msg=key)
    torch.testing.assert_close(fast.decode(fast.encode(x)), outs[0])
    # the training pass computes the same output, and with the signed gate every selected code counts
    step = fast.training_forward_pass(x, torch.randn(11, O, dtype=torch.float64, generator=g))
    torch.testing.assert_close(step.output, outs[0])
    selected = (x @ fast.W_enc + fast.b_enc).topk(K, dim=-1).values  # brute force: the K largest
    assert (selected <= 0).any()  # the case where the gates differ is exercised
    expected = K if gate == "topk" else float((selected > 0).sum(-1).double().mean())
    assert step.metrics["l0"] == pytest.approx(expected)


def test_signed_codes_round_trip_through_save_load_and_saelens(tmp_path):
    from sae_lens import SAE

    layer = make_mxd("topk", balance_rate=0.002, balance_target=0.5)
    layer.save_model(tmp_path / "mxd")
    cfg = json.loads((tmp_path / "mxd" / "cfg.json").read_text())
    assert (cfg["gate"], cfg["balance_rate"], cfg["balance_target"]) == ("topk", 0.002, 0.5)
    loaded = SAE.load_from_disk(tmp_path / "mxd")
    assert isinstance(loaded, MxD) and loaded.cfg.gate == "topk" and not loaded.relu_codes
    x = torch.randn(6, I)
    torch.testing.assert_close(loaded(x), layer(x))
    # a layer saved before the option existed loads as the paper's gate
    del cfg["gate"], cfg["balance_rate"], cfg["balance_target"]
    (tmp_path / "mxd" / "cfg.json").write_text(json.dumps(cfg))
    old = SAE.load_from_disk(tmp_path / "mxd")
    assert old.cfg.gate == "relu_topk" and old.relu_codes
    torch.testing.assert_close(old(x), dense_reference(old, x))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(gate="softmax"), "gate 'softmax' is unknown: choose 'relu_topk' or 'topk'"),
        (dict(balance_target=0.0), r"balance_target must be a fraction of tokens in \(0, 1\]"),
        (dict(balance_target=1.5), r"balance_target must be a fraction of tokens in \(0, 1\]"),
        (dict(balance_rate=-1e-3), "balance_rate must be a finite number >= 0"),
        (dict(k=N + 1), f"k must satisfy 0 < k <= d_sae={N}"),
    ],
)
def test_bad_gate_options_are_refused_by_name(fields, message):
    base = dict(d_in=I, d_out=O, d_sae=N, k=K, d_hidden=H)
    with pytest.raises(ValueError, match=message):
        MxDConfig(**{**base, **fields})


def test_usage_controller_moves_each_bias_toward_the_target():
    layer = make_mxd("relu_topk", balance_rate=0.01)
    values = torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.5, 0.0]])
    indices = torch.tensor([[0, 1, 2], [0, 3, 4]])
    before = layer.b_enc.detach().clone()
    metrics = layer.after_step(values, indices)
    # brute force: usage of each expert over the 2 tokens (a zero code is not active), target K / N
    usage = torch.zeros(N)
    for t in range(2):
        for v, n in zip(values[t], indices[t], strict=True):
            usage[n] += float(v != 0) / 2
    expected = before + 0.01 * torch.sign(K / N - usage)
    torch.testing.assert_close(layer.b_enc.detach(), expected)
    assert metrics["usage_max"] == 1.0
    off = make_mxd("relu_topk")  # rate 0: nothing moves
    b = off.b_enc.detach().clone()
    assert off.after_step(values, indices) == {} and torch.equal(off.b_enc, b)


def test_controller_revives_an_mxd_whose_gate_collapsed():
    """A gate whose experts all sit below zero but one: the paper's gate leaves L0 = 1; the controller
    raises the silent experts' biases until they fire, without any gradient."""
    layer = make_mxd("relu_topk", balance_rate=0.05)
    with torch.no_grad():
        layer.W_enc.mul_(0.1)
        layer.b_enc.fill_(-2.0)
        layer.b_enc[0] = 5.0
    x = torch.randn(256, I)
    assert layer.forward_sparse(x)[1].ne(0).sum(-1).float().mean() == 1
    for _ in range(200):
        values, indices = layer.encode_sparse(x)
        layer.after_step(values, indices)
    assert layer.forward_sparse(x)[1].ne(0).sum(-1).float().mean() == K


def test_arch_strings_parse_and_format():
    assert parse_arch("mxd") == ("mxd", {})
    assert parse_arch("mxd:gate=topk,balance_rate=1e-3,balance_target=none") == (
        "mxd", {"gate": "topk", "balance_rate": 0.001, "balance_target": None})  # fmt: skip
    assert format_arch("mxd", {"gate": "topk", "balance_rate": 0.001}) == "mxd:balance_rate=0.001,gate=topk"
    assert parse_arch(format_arch("mxd", {"d_hidden": 384})) == ("mxd", {"d_hidden": 384})
    assert arch_label("mxd:gate=topk") == "MxD (gate=topk)"
    with pytest.raises(ValueError, match="write KEY:field=value"):
        parse_arch("mxd:gate")


def test_learner_spec_options_reach_the_layer():
    from mxd_lens.activations import StreamInfo
    from mxd_lens.layers.learners import LearnerSpec, build_layer

    spec = LearnerSpec("mxd:gate=topk,d_hidden=4", block=0, k=2, width_multiplier=8)
    assert spec.arch == "mxd" and spec.options == {"gate": "topk", "d_hidden": 4}
    assert spec.name == "L0.mxd-d_hidden=4-gate=topk.k2.m8" and spec.method == "mxd:d_hidden=4,gate=topk"
    info = StreamInfo(model_name="m", blocks=[0], d_in=8, d_out=8, d_hidden=16, activation="silu", gated=True,
                      hook_names={"0": ["in", "out"]}, rows_per_shard=4, context_size=8,
                      drop_first_position=False)  # fmt: skip
    narrow, full = build_layer(spec, info, seed=0), build_layer(LearnerSpec("mxd", 0, 2, 8), info, seed=0)
    assert narrow.cfg.gate == "topk" and narrow.cfg.d_hidden == 4
    params = [sum(p.numel() for p in layer.parameters()) for layer in (narrow, full)]
    assert narrow.cfg.d_sae > full.cfg.d_sae and abs(params[0] - params[1]) / params[1] < 0.05  # matched
    with pytest.raises(ValueError, match="'bogus'.*cannot be set as options"):
        LearnerSpec("mxd:bogus=1", 0, 2)
    with pytest.raises(ValueError, match="cannot be set as options"):
        LearnerSpec("transcoder:gate=topk", 0, 2)


def brute_force_usage(values: torch.Tensor, indices: torch.Tensor, n_units: int) -> dict:
    """The diagnostics by Python loops over tokens and codes."""
    rows = values.reshape(-1, values.shape[-1]).tolist()
    idx = indices.reshape(-1, indices.shape[-1]).tolist()
    import math

    counts = [0] * n_units
    l0 = l0_pos = eff = 0.0
    for vs, ns in zip(rows, idx, strict=True):
        total = sum(abs(v) for v in vs)
        entropy = -sum(abs(v) / total * math.log(abs(v) / total) for v in vs if v != 0) if total else 0
        eff += math.exp(entropy) if total else 0
        for v, n in zip(vs, ns, strict=True):
            l0 += v != 0
            l0_pos += v > 0
            counts[n] += v != 0
    T = len(rows)
    return {"l0": l0 / T, "l0_positive": l0_pos / T, "effective_units": eff / T,
            "always_on": sum(c > T / 2 for c in counts), "dead_fraction": sum(c == 0 for c in counts) / n_units}  # fmt: skip


@pytest.mark.parametrize("gate", ["relu_topk", "topk"])
def test_usage_diagnostics_equal_a_brute_force_count(gate):
    from mxd_lens import hooks

    model = make_model("gated")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, gate=gate), scale=0.5)
    with torch.no_grad():
        layer.b_enc[:3] += 3.0  # three always-on experts
        layer.W_enc.mul_(0.2)
        layer.b_enc[3:] -= 2.0  # some selected codes negative: the two L0s differ for the signed gate
    batches = [torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    (row,) = evaluate(model, [layer], batches, progress=False, jacobian_tokens=0)
    xs, ys = [], []
    for tokens in batches:
        with torch.no_grad(), hooks.capture_mlp_io(model, [1]) as io:
            model(tokens)
        skip = int(model.cfg.default_prepend_bos)  # evaluate leaves position 0 out where BOS is prepended
        xs.append(io[1]["in"][:, skip:].reshape(-1, 16))
        ys.append(io[1]["out"][:, skip:].reshape(-1, 16))
    x, y = torch.cat(xs), torch.cat(ys)
    with torch.no_grad():
        values, indices = layer.encode_sparse(x)
        expected = brute_force_usage(values, indices, 24)
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-6), key  # dead_fraction is a float32 mean
        assert expected["always_on"] >= 2  # the count is not trivially 0
        # top-1 FVU: the dense codes with all but each token's largest |code| zeroed, decoded as the equations say
        codes = layer.encode(x)
        keep = codes.abs().argmax(-1, keepdim=True)
        top1 = torch.zeros_like(codes).scatter(-1, keep, codes.gather(-1, keep))
        out = layer.decode(top1, x=x)
        fvu = (out - y).double().pow(2).sum() / (y - y.mean(0)).double().pow(2).sum()
    assert row["top1_fvu"] == pytest.approx(float(fvu), rel=1e-5)
    if gate == "topk":
        assert row["l0"] == 4 and row["l0_positive"] < 4
    else:
        assert row["l0"] == row["l0_positive"] < 4


def test_jacobian_estimator_is_within_tolerance_of_the_exact_cosine():
    from mxd_lens import hooks

    model = make_model("gated")
    mlp = hooks.mlp_module(model, 1)
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), scale=0.3)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))

    def f(v):
        return layer(v)

    def g(v):
        return mlp(v[None])[0]

    exact = jacobian_cosine(f, g, x)
    reference = jacobian_cosine_dense(f, g, x[:5])
    torch.testing.assert_close(exact[:5], reference, rtol=1e-5, atol=1e-6)
    full = jacobian_cosine(f, g, x, directions=16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full, exact, rtol=1e-5, atol=1e-6)  # d_out orthonormal directions: exact
    estimate = jacobian_cosine(f, g, x, directions=8, generator=torch.Generator().manual_seed(0))
    # the stated tolerance (docs/evaluation): with half of d_out directions, per token within 0.15 and
    # the mean over tokens within 0.03 of the exact value on this model
    assert (estimate - exact).abs().max() < 0.15
    assert abs(float(estimate.mean() - exact.mean())) < 0.03
    # an exact copy of the MLP has cosine 1 everywhere
    copy = MxD.from_mlp(model, 1)
    torch.testing.assert_close(
        jacobian_cosine(copy, g, x), torch.ones(40, dtype=torch.float64), rtol=0, atol=1e-5
    )


def test_evaluate_reports_the_jacobian_cosine_of_an_exact_copy_as_one():
    model = make_model("gpt2")
    batches = [torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))]
    (row,) = evaluate(model, [MxD.from_mlp(model, 1)], batches, progress=False, jacobian_directions=None)
    assert row["jacobian_cos"] == pytest.approx(1.0, abs=1e-5)
    assert row["top1_fvu"] < 1e-10 and row["effective_units"] == 1 and row["always_on"] == 1
    transcoder = randomise(TopKTranscoder(TopKTranscoderConfig(d_in=16, d_out=16, d_sae=20, k=3)))
    transcoder.cfg.metadata = MxD.from_mlp(model, 1).cfg.metadata
    (row,) = evaluate(model, [transcoder], batches, progress=False)
    assert -1 <= row["jacobian_cos"] < 0.9


def test_signed_codes_splice_and_pool_as_written(tmp_path):
    """A topk-gate MxD spliced at hook_mlp_out gives the model a hand-written MLP replacement gives, and
    probing's pooled codes are the mean over tokens of its signed codes."""
    from conftest import WORDS, make_text_model

    import mxd_lens
    from mxd_lens import hooks
    from mxd_lens.analysis.probing import pooled_activations

    model, _ = make_text_model(tmp_path, kind="gated")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, gate="topk"), scale=0.5)
    with torch.no_grad():
        layer.b_enc.sub_(3.0)  # many selected codes negative
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with mxd_lens.splice(model, layer):
            spliced = model(tokens)
        handle = hooks.mlp_module(model, 1).register_forward_hook(lambda m, i, o: layer(i[0]).to(o.dtype))
        try:
            by_hand = model(tokens)
        finally:
            handle.remove()
    torch.testing.assert_close(spliced, by_hand, rtol=1e-5, atol=1e-5)
    texts = [" ".join(WORDS[:4]), " ".join(WORDS[4:7])]
    pooled = pooled_activations(model, {"mxd": layer}, texts, context_size=12, progress=False)["mxd"]
    from mxd_lens.analysis.probing import tokenize_texts

    for i, ids in enumerate(tokenize_texts(model, texts, 12)):
        with torch.no_grad(), hooks.capture_mlp_io(model, [1]) as io:
            model(torch.tensor([ids]))
            codes = layer.encode(io[1]["in"])[0, int(model.cfg.default_prepend_bos) :]
        assert (codes < 0).any()
        torch.testing.assert_close(pooled[i], codes.mean(0), rtol=1e-5, atol=1e-6)


def test_topk_encode_reports_the_pre_activation_moments_of_its_matmul():
    g = torch.Generator().manual_seed(3)
    x, W, b = torch.randn(40, I, generator=g), torch.randn(I, N, generator=g), torch.randn(N, generator=g)
    moments: list = []
    ops.topk_encode(x, W, b, K, relu=False, pre_moments=moments)
    pre = torch.stack([x[t] @ W + b for t in range(40)])  # brute force, token by token
    torch.testing.assert_close(moments[0][0], pre.mean(0))
    torch.testing.assert_close(moments[0][1], (pre**2).mean(0))


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_gate_standardisation_moves_each_expert_toward_zero_mean_unit_variance(rate):
    layer = make_mxd("topk", gate_standardize=rate)
    with torch.no_grad():
        layer.b_enc.add_(torch.linspace(-3, 3, N))
    x = torch.randn(500, I, dtype=torch.float64).float()
    y = torch.randn(500, O)
    pre = x @ layer.W_enc.detach() + layer.b_enc.detach()
    mean, std = pre.mean(0), pre.std(0, unbiased=False)
    out = layer.training_forward_pass(x, y)
    metrics = layer.after_step(out.values.detach(), out.indices)
    after = x @ layer.W_enc.detach() + layer.b_enc.detach()
    # (pre - r mean) / std^r: the mean becomes (1 - r) mean / std^r, the std becomes std^(1 - r)
    torch.testing.assert_close(after.mean(0), (1 - rate) * mean / std**rate, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after.std(0, unbiased=False), std ** (1 - rate), atol=1e-4, rtol=1e-4)
    assert metrics["gate_mean_max"] == pytest.approx(float(mean.abs().max()), rel=1e-4)
    with pytest.raises(RuntimeError, match="call training_forward_pass first"):
        layer.after_step(out.values.detach(), out.indices)  # the moments are used once


def test_gate_standardisation_breaks_an_always_on_expert():
    """Expert 0's bias puts it in every token's TopK; after standardisation it is selected only where its
    pre-activation is unusually high, like every other expert (brute-force usage count)."""
    layer = make_mxd("topk", gate_standardize=1.0)
    with torch.no_grad():
        layer.b_enc[0] = 20.0
    x, y = torch.randn(2000, I), torch.randn(2000, O)

    def usage_of_expert_0():
        indices = layer.encode_sparse(x)[1]
        return sum(int(0 in row.tolist()) for row in indices) / len(indices)

    assert usage_of_expert_0() == 1.0
    out = layer.training_forward_pass(x, y)
    layer.after_step(out.values.detach(), out.indices)
    assert usage_of_expert_0() < 0.5
    torch.testing.assert_close(layer(x), dense_reference(layer, x))  # still the topk gate's map


def test_gate_standardisation_is_refused_outside_zero_to_one():
    with pytest.raises(ValueError, match=r"gate_standardize must be a fraction in \[0, 1\]"):
        MxDConfig(d_in=I, d_out=O, d_sae=N, k=K, d_hidden=H, gate_standardize=1.5)

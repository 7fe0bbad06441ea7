"""Layers against independent references: explicit loops, brute-force TopK, dense autograd."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import dense_reference, randomise

from mxd_lens import (
    MxD,
    MxDConfig,
    TopKSkipTranscoder,
    TopKSkipTranscoderConfig,
    TopKTranscoder,
    TopKTranscoderConfig,
)
from mxd_lens.layers import ops

I, O, H_STAR, N, K = 6, 5, 7, 13, 3


def make_mxd(form="mlp", activation="gelu_new", dtype="float32", n=N, k=K):
    cfg = MxDConfig(
        d_in=I, d_out=O, d_sae=n, k=k, d_hidden=H_STAR, activation=activation, hidden_form=form, dtype=dtype
    )
    return randomise(MxD(cfg), scale=0.5)


def make_layers(dtype="float32"):
    return {
        "mxd": make_mxd(dtype=dtype),
        "mxd_glu": make_mxd("glu", "silu", dtype=dtype),
        "transcoder": randomise(
            TopKTranscoder(TopKTranscoderConfig(d_in=I, d_out=O, d_sae=N, k=K, dtype=dtype))
        ),
        "skip": randomise(
            TopKSkipTranscoder(TopKSkipTranscoderConfig(d_in=I, d_out=O, d_sae=N, k=K, dtype=dtype))
        ),
    }


def brute_force_topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """Per token: keep the k largest values if positive, by sorting a Python list."""
    out = torch.zeros_like(pre)
    for t in range(pre.shape[0]):
        ranked = sorted(range(pre.shape[1]), key=lambda n: -pre[t, n].item())[:k]
        for n in ranked:
            out[t, n] = max(pre[t, n].item(), 0.0)
    return out


def gelu_tanh(u):  # GPT-2's GELU, written out
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


@pytest.fixture
def x():
    return torch.randn(9, I, generator=torch.Generator().manual_seed(3))


def test_mxd_equals_mixture_of_experts_loop(x):
    mxd = make_mxd()
    with torch.no_grad():
        y = mxd(x)
        pre = x @ mxd.W_enc + mxd.b_enc
        a = brute_force_topk(pre, K)
        z = gelu_tanh(x @ mxd.W_in + mxd.b_in)
        for t in range(x.shape[0]):
            expected = mxd.b_dec.clone()
            for n in range(N):
                if a[t, n] != 0:
                    W_n = mxd.W_out @ torch.diag(mxd.W_dec[n])  # D diag(c_n), [H*, O]
                    expected += a[t, n] * (W_n.T @ z[t])
            torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5)


def test_glu_form_matches_its_equation(x):
    mxd = make_mxd("glu", "silu")
    with torch.no_grad():
        z = torch.nn.functional.silu(x @ mxd.W_in_gate + mxd.b_in_gate) * (x @ mxd.W_in + mxd.b_in)
        a = brute_force_topk(x @ mxd.W_enc + mxd.b_enc, K)
        expected = (z @ mxd.W_out) * (a @ mxd.W_dec) + mxd.b_dec
        torch.testing.assert_close(mxd(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "activation", ["relu", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "silu", "relu2", "solu"]
)
def test_each_activation_is_the_host_function(x, activation):
    from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

    mxd = make_mxd(activation=activation)
    with torch.no_grad():
        torch.testing.assert_close(
            mxd.hidden(x), SUPPORTED_ACTIVATIONS[activation](x @ mxd.W_in + mxd.b_in), rtol=0, atol=0
        )


def test_experts_are_full_rank_when_c_has_no_zeros():
    mxd = make_mxd(n=4, k=2)
    with torch.no_grad():
        for rank in (2, 5):
            # D of known rank (H* = 7 > O = 5, so full rank would be 5).
            mxd.W_out.copy_(torch.randn(H_STAR, rank) @ torch.randn(rank, O))
            assert torch.linalg.matrix_rank(mxd.W_out).item() == rank
            for n in range(4):
                assert mxd.W_dec[n].abs().min() > 0
                assert torch.linalg.matrix_rank(mxd.expert_weights(n)).item() == rank
        # A zero in c_n removes a column: the lemma's condition matters.
        mxd.W_dec[0, 0] = 0.0
        assert torch.linalg.matrix_rank(mxd.expert_weights(0)).item() == min(rank, O - 1)


@pytest.mark.parametrize("name", ["mxd", "mxd_glu", "transcoder", "skip"])
def test_topk_codes_are_the_k_largest_positive_gate_values(name, x):
    layer = make_layers()[name]
    with torch.no_grad():
        layer.b_enc[: N - 2] -= 100.0  # only two units can be positive: fewer than K fire
        codes = layer.encode(x)
        torch.testing.assert_close(codes, brute_force_topk(x @ layer.W_enc + layer.b_enc, K), rtol=0, atol=0)
        l0 = (codes != 0).sum(-1)
        assert l0.max() <= 2 and l0.max() < K
        # The fast path agrees when some selected gate values are clipped to zero.
        torch.testing.assert_close(layer(x), dense_reference(layer, x), rtol=1e-5, atol=1e-5)
        layer.b_enc.zero_()
        codes = layer.encode(x)
        torch.testing.assert_close(codes, brute_force_topk(x @ layer.W_enc, K), rtol=0, atol=0)
        assert (codes != 0).sum(-1).max() <= K


@pytest.mark.parametrize("name", ["mxd", "mxd_glu", "transcoder", "skip"])
def test_forward_is_decode_of_encode_bit_for_bit(name):
    layer = make_layers()[name]
    x3 = torch.randn(2, 4, I)
    codes = layer.encode(x3)
    assert codes.shape == (2, 4, N)
    out = layer.decode(codes)
    assert out.shape == (2, 4, O)
    assert torch.equal(layer(x3), out)
    torch.testing.assert_close(dense_reference(layer, x3), out, rtol=1e-5, atol=1e-5)


def test_skip_transcoder_decode_keeps_the_skip_term(x):
    layer = make_layers()["skip"]
    with torch.no_grad():
        expected = (
            brute_force_topk(x @ layer.W_enc + layer.b_enc, K) @ layer.W_dec + layer.b_dec + x @ layer.W_skip
        )
        torch.testing.assert_close(layer.decode(layer.encode(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mxd", "mxd_glu", "skip"])
def test_edited_codes_decode_as_the_dense_formula(name, x):
    layer = make_layers()[name]
    with torch.no_grad():
        codes = layer.encode(x)
        context = layer._stash.context
        for edit in ("add_feature", "in_place", "dense"):
            if edit == "add_feature":  # steering: one more active code everywhere
                edited = codes.clone()
                edited[:, 7] += 4.0
            elif edit == "in_place":
                edited = codes
                edited[:, 2] += 1.5
            else:  # every code non-zero: the dense fallback
                edited = codes + 0.1
            expected = layer.output(edited @ layer.W_dec, context)
            given = {} if edited is codes else {"x": x}  # a new tensor needs its input
            torch.testing.assert_close(layer.decode(edited, **given), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mxd", "mxd_glu", "skip"])
def test_stale_codes_are_never_decoded_with_another_input(name, x):
    layer = make_layers()[name]
    with torch.no_grad():
        first = layer.encode(x)
        layer.encode(x.flip(0) * 2)  # same shapes, other input: the stash now holds its hidden layer
        with pytest.raises(RuntimeError, match="pass decode\\(codes, x=x\\)"):
            layer.decode(first)
        torch.testing.assert_close(layer.decode(first, x=x), dense_reference(layer, x), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="batch shape"):
            layer.decode(first, x=x[:3])


@pytest.mark.parametrize("name", ["mxd", "skip"])
def test_decode_without_matching_encode_is_refused(name, x):
    layer = make_layers()[name]
    with pytest.raises(RuntimeError, match="encode"):
        layer.decode(torch.zeros(9, N))
    layer.encode(x)
    with pytest.raises(RuntimeError, match="needs the input these codes came from"):
        layer.decode(torch.zeros(4, N))
    with pytest.raises(ValueError, match="d_sae"):
        layer.decode(torch.zeros(9, N + 1))


def test_plain_transcoder_decodes_codes_alone():
    layer = make_layers()["transcoder"]
    codes = torch.zeros(2, N)
    codes[0, 3] = 2.0
    torch.testing.assert_close(layer.decode(codes), codes @ layer.W_dec + layer.b_dec)


def test_sparse_ops_gradcheck_float64():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, I, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(I, N, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(N, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, W, b: ops.topk_encode(x, W, b, K)[0], (x, W, b))
    values = torch.rand(7, K, dtype=torch.float64, generator=g, requires_grad=True)
    indices = torch.randint(0, N, (7, K), generator=g)
    C = torch.randn(N, O, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, C: ops.decode_rows(v, indices, C), (values, C))


@pytest.mark.parametrize("name", ["mxd", "mxd_glu", "transcoder", "skip"])
def test_sparse_gradients_equal_dense_reference_float64(name):
    ref, fast = make_layers("float64")[name], make_layers("float64")[name]
    with torch.no_grad():  # some selected gate values negative: the ReLU mask must cut their gradient
        for layer in (ref, fast):
            layer.b_enc[::2] -= 1.5
    x = torch.randn(11, I, dtype=torch.float64)
    upstream = torch.randn(11, O, dtype=torch.float64)
    grads = []
    for layer, fn in ((fast, fast.forward), (ref, lambda t: dense_reference(ref, t))):
        xi = x.clone().requires_grad_(True)
        (fn(xi) * upstream).sum().backward()
        grads.append({"x": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-10, atol=1e-12, msg=key)


def test_gate_gradient_touches_only_selected_experts():
    mxd = make_mxd()
    x = torch.randn(4, I)
    mxd(x).sum().backward()
    with torch.no_grad():
        selected = torch.zeros(N, dtype=torch.bool)
        selected[mxd.encode_sparse(x)[1].flatten()] = True
    assert mxd.W_enc.grad[:, ~selected].abs().max() == 0
    assert mxd.W_dec.grad[~selected].abs().max() == 0
    assert mxd.W_enc.grad[:, selected].abs().sum() > 0


def test_fresh_mxd_outputs_its_bias_and_only_d_and_b_learn():
    mxd = MxD(MxDConfig(d_in=I, d_out=O, d_sae=N, k=K, d_hidden=H_STAR))
    x = torch.randn(5, I)
    assert mxd.W_out.abs().max() == 0
    torch.testing.assert_close(mxd(x), mxd.b_dec.expand(5, O))
    torch.testing.assert_close(mxd.W_dec.norm(dim=-1), torch.ones(N))
    mxd(x).pow(2).sum().backward()
    assert {n for n, p in mxd.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0} <= {
        "W_out",
        "b_dec",
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(k=0), "k must satisfy"),
        (dict(k=N + 1), "k must satisfy"),
        (dict(d_out=0), "d_out must be a positive"),
        (dict(activation="swish"), "unknown activation 'swish'"),
        (dict(hidden_form="geglu"), "hidden_form"),
        (dict(d_hidden=0), "d_hidden"),
        (dict(apply_b_dec_to_input=True), "apply_b_dec_to_input"),
    ],
)
def test_bad_config_is_refused_with_the_value(fields, message):
    base = dict(d_in=I, d_out=O, d_sae=N, k=K, d_hidden=H_STAR)
    with pytest.raises(ValueError, match=message):
        MxDConfig(**{**base, **fields})


def test_wrong_input_width_is_refused():
    layer = make_layers()["transcoder"]
    with pytest.raises(ValueError, match=f"d_in={I}"):
        layer(torch.randn(3, I + 1))
    with pytest.raises(ValueError, match=f"d_in={I}"):
        layer.encode(torch.randn(3, I + 1))


def test_the_extension_points_are_public_and_overrides_are_marked():
    """What a new architecture overrides (docs/custom_layers.md) has no leading underscore, and every
    built-in layer marks its overrides with ``typing_extensions.override`` (issue 45)."""
    import inspect
    from pathlib import Path

    from mxd_lens.layers import BUILT_IN, MLPReplacement

    doc = (Path(__file__).resolve().parents[1] / "docs" / "custom_layers.md").read_text()
    for name in ("decode_context", "output", "aux_output", "fold_dense", "select_codes", "sparse_codes",
                 "training_encode", "model_defaults", "init_dictionary"):  # fmt: skip
        assert callable(getattr(MLPReplacement, name)) and f"{name}(" in doc, name
    for layer_cls in BUILT_IN.values():
        for cls in (layer_cls, layer_cls.config_class):
            for name, value in vars(cls).items():
                inherited = any(name in vars(base) for base in cls.__mro__[1:])
                function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                dunder = name.startswith("__") and name != "__post_init__"  # dataclass-made methods
                if not inherited or dunder or not inspect.isfunction(function):
                    continue
                marked = getattr(value, "__override__", False) or getattr(function, "__override__", False)
                assert marked, f"{cls.__name__}.{name} lacks @override"

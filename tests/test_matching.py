import pytest

from mxd_lens import MxD, MxDConfig, TopKTranscoder, TopKTranscoderConfig, match_experts


@pytest.mark.parametrize(
    ("d_model", "d_hidden", "expected"),
    [
        (768, 3072, 21_490),
        (1024, 4096, 28_658),
        (2048, 8192, 57_330),
    ],  # GPT-2 small, Pythia-410M, -1.4B (paper)
)
def test_paper_values_at_m32(d_model, d_hidden, expected):
    assert match_experts(32 * d_model, d_model, d_model, d_hidden) == expected


@pytest.mark.parametrize("glu", [False, True])
def test_matched_layers_have_equal_weight_counts(glu):
    # Count weight matrices and the gate bias, as the paper's rule does (not E's or the output biases).
    d, h_star, width = 24, 40, 8 * 24
    n = match_experts(width, d, d, h_star, glu=glu)
    mxd = MxD(MxDConfig(d_in=d, d_out=d, d_sae=n, k=4, d_hidden=h_star, hidden_form="glu" if glu else "mlp"))
    tc = TopKTranscoder(TopKTranscoderConfig(d_in=d, d_out=d, d_sae=width, k=4))
    mxd_count = sum(
        p.numel() for name, p in mxd.named_parameters() if name not in ("b_in", "b_in_gate", "b_dec")
    )
    tc_count = tc.W_enc.numel() + tc.W_dec.numel()
    assert abs(mxd_count - tc_count) <= (2 * d + 1) / 2  # rounding N to an integer


def test_too_small_width_is_refused():
    with pytest.raises(ValueError, match="width multiplier"):
        match_experts(100, 768, 768, 3072)
    with pytest.raises(ValueError, match="d_hidden must be positive"):
        match_experts(100, 768, 768, 0)

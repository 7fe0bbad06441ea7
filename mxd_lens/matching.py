"""Parameter matching: how many MxD experts cost as much as a transcoder of a given width."""

from __future__ import annotations


def match_experts(transcoder_width: int, d_in: int, d_out: int, d_hidden: int, glu: bool = False) -> int:
    """N such that an MxD with N experts has the parameters of a width-H transcoder.

    The paper's rule (Oldfield et al. 2025, App. "parameter matching"):
    ``N = round((H - H*) (I + O) / (I + O + 1))``, i.e. the transcoder's H (I + O) weights minus the
    MxD's dense hidden map (H* I for E, H* O for D), spread over experts that each cost I + O + 1
    (a gate column, its bias and a row of C). A GLU host has a second input matrix, so H* I is
    counted twice.

    >>> match_experts(32 * 768, 768, 768, 3072)  # GPT-2 small, m = 32
    21490
    """
    for name, value in (
        ("transcoder_width", transcoder_width),
        ("d_in", d_in),
        ("d_out", d_out),
        ("d_hidden", d_hidden),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    dense_cost = d_hidden * ((2 if glu else 1) * d_in + d_out)
    n = round((transcoder_width * (d_in + d_out) - dense_cost) / (d_in + d_out + 1))
    if n <= 0:
        raise ValueError(
            f"a transcoder of width {transcoder_width} has fewer parameters than the MxD's dense "
            f"hidden layer alone (d_hidden={d_hidden}); use a larger width multiplier"
        )
    return n


def default_width_multiplier(d_in: int, d_out: int, d_hidden: int, glu: bool = False, floor: int = 8) -> int:
    """The width multiplier m a run uses when none is given: the smallest m >= ``floor`` (8) at which a
    parameter-matched MxD gets at least ``d_in`` experts (``match_experts(m * d_in, ...) >= d_in``).

    m = 8 for hosts whose MLP is at most about 4.5 x d_model wide (GLU) or 6.5 x (plain): GPT-2,
    SmolLM2, Llama-3, Gemma-2/3. A wider MLP costs the MxD's dense hidden layer more than a width-8
    transcoder holds, so the multiplier grows until a useful number of experts remains: Qwen2.5-0.5B
    (d_mlp = 5.43 d_model, GLU) gets m = 10 and 1,663 experts.

    >>> default_width_multiplier(576, 576, 1536, glu=True)  # SmolLM2-135M
    8
    >>> default_width_multiplier(896, 896, 4864, glu=True)  # Qwen2.5-0.5B
    10
    """
    m = floor
    while True:
        try:
            if match_experts(m * d_in, d_in, d_out, d_hidden, glu=glu) >= d_in:
                return m
        except ValueError:  # the width-m transcoder is smaller than the dense layer alone
            pass
        m += 1

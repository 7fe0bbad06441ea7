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

"""Is a replacement faithful in *mechanism*, not only in output? The cosine between its input→output
Jacobian and the MLP's, per token.

A layer can match the MLP's outputs on the data with another mechanism (MxD's dense path fits the target
while its codes do little); the Jacobian says how the output moves when the input moves. Per token t,
with J_f(x_t) the [d_out, d_in] Jacobian of f at x_t and <A, B> = tr(A Bᵀ) the Frobenius product:

    cos_t = <J_f, J_g> / (‖J_f‖ ‖J_g‖)

(the metric MOLT implementations and Anthropic's faithfulness toy use). Both maps act token by token,
so one backward pass of Σ_t u_t · f(x_t) gives every token's u_tᵀ J_f(x_t) at once.

- **Exact** (``directions=None``): d_out backward passes, u = each basis vector.
- **Estimated** (``directions=m``): per token, m random orthonormal output directions Q_t [d_out, m]
  (QR of a Gaussian matrix): <J_f, J_g> ≈ (d_out / m) Σ_j (q_jᵀ J_f)·(q_jᵀ J_g), unbiased for each
  product; the three products share the directions, which keeps the ratio's error small. With m = d_out
  it is exact. tests/test_jacobian.py bounds the error against the exact value.

A TopK layer is piecewise smooth: the Jacobian is that of the selected units (the selection held fixed),
which is what autograd gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Map = Callable[[torch.Tensor], torch.Tensor]


def jacobian_cosine(
    f: Map,
    g: Map,
    x: torch.Tensor,
    directions: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """cos(J_f(x_t), J_g(x_t)) for every token of ``x`` [T, d_in] ([T], float64): exact with
    ``directions=None``, else estimated from that many random orthonormal output directions per token.
    ``f`` and ``g`` map [T, d_in] to [T, d_out] token by token."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, d_in], got shape {tuple(x.shape)}")
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        yf, yg = f(x), g(x)
        if yf.shape != yg.shape or yf.shape[0] != x.shape[0]:
            raise ValueError(
                f"f and g must map [T, d_in] to the same [T, d_out]; got {tuple(yf.shape)}, {tuple(yg.shape)}"
            )
        d_out = yf.shape[-1]
        if directions is None:
            probes = torch.eye(d_out, dtype=yf.dtype, device=yf.device).expand(x.shape[0], d_out, d_out)
        else:
            if not 0 < directions <= d_out:
                raise ValueError(f"directions={directions} must be in 1..d_out={d_out} (None: exact)")
            gauss = torch.randn(x.shape[0], d_out, directions, generator=generator, dtype=torch.float64)
            # [T, m, d_out]; the (d_out / m) factor of each product cancels in the ratio
            probes = torch.linalg.qr(gauss).Q.transpose(1, 2).to(yf.dtype).to(yf.device)
        dot = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        nf, ng = torch.zeros_like(dot), torch.zeros_like(dot)
        for j in range(probes.shape[1]):
            u = probes[:, j]
            (jf,) = torch.autograd.grad(yf, x, u, retain_graph=True)
            (jg,) = torch.autograd.grad(yg, x, u, retain_graph=True)
            jf, jg = jf.double(), jg.double()
            dot += (jf * jg).sum(-1)
            nf += jf.pow(2).sum(-1)
            ng += jg.pow(2).sum(-1)
    return dot / (nf.sqrt() * ng.sqrt()).clamp_min(1e-30)


def jacobian_cosine_dense(f: Map, g: Map, x: torch.Tensor) -> torch.Tensor:
    """Reference: the full Jacobians per token with ``torch.autograd.functional.jacobian`` (slow)."""
    out = []
    for row in x.detach():
        jf = torch.autograd.functional.jacobian(lambda v: f(v[None])[0], row).double()
        jg = torch.autograd.functional.jacobian(lambda v: g(v[None])[0], row).double()
        out.append((jf * jg).sum() / (jf.norm() * jg.norm()).clamp_min(1e-30))
    return torch.stack(out)

"""Causal-importance (CI) functions: from a module's inputs to g ∈ [0, 1]^C per position.

Every CI class here serves a *group* of M modules with the same input width at once, with stacked
parameters, so one step costs a few batched matmuls instead of a Python loop over modules and
components. ``forward(x: [M, b, p, d_in]) -> z: [M, b, p, C]`` gives pre-activations; the hard
sigmoids below turn z into g (masks) and g_upper (minimality loss).

A new CI type is a new class with that constructor and ``forward`` plus one line in ``CI_TYPES``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LEAK = 0.01
CI_VERSION = 1
"""The version of what the CI functions compute. Bump it when a change makes the same parameters give
other outputs (not for exact speed-ups): checkpoints record it, and one written by another version is
refused on resume, naming both."""


class LowerLeakyHardSigmoid(torch.autograd.Function):
    """g = clamp(z, 0, 1). Backward, with G = dL/dg:

        dL/dz = G        if 0 < z <= 1
              = 0.01 G   if z <= 0 and G < 0   (the loss wants g larger: let a closed gate reopen)
              = 0        if z <= 0 and G >= 0, or z > 1

    so a component whose z fell below zero can still be pulled back by the reconstruction losses.
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        return z.clamp(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors
        below = torch.where(grad < 0, LEAK * grad, torch.zeros_like(grad))
        return torch.where(z <= 0, below, torch.where(z <= 1, grad, torch.zeros_like(grad)))


class UpperLeakyHardSigmoid(torch.autograd.Function):
    """g_upper = clamp(z, 0, 1) for z <= 1 and 1 + 0.01 (z - 1) for z > 1 (the forward leaks too).
    Backward, with G = dL/dg_upper:

        dL/dz = G        if 0 <= z <= 1
              = 0.01 G   if z > 1   (the minimality loss keeps pushing z down towards 1)
              = 0        if z < 0
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        return torch.where(z > 1, 1 + LEAK * (z - 1), z.clamp(min=0))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors
        return torch.where(z > 1, LEAK * grad, torch.where(z >= 0, grad, torch.zeros_like(grad)))


def lower_leaky_hard_sigmoid(z: torch.Tensor) -> torch.Tensor:
    return LowerLeakyHardSigmoid.apply(z)


def upper_leaky_hard_sigmoid(z: torch.Tensor) -> torch.Tensor:
    return UpperLeakyHardSigmoid.apply(z)


def _normal(generator: torch.Generator, std: float, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape, generator=generator) * std)


class VectorMLPCI(nn.Module):
    """ "vector_mlp": C small MLPs on the whole input, z_c = w_c · GELU(W_c x + b_c) + β_c.

    Stored stacked: ``W_hidden`` [M, d_in, C·H] makes all C hidden layers of a module one matmul.
    Init as the reference code: He-normal hidden weights, N(0, 1/H) output weights, zero biases.
    """

    def __init__(
        self, n_modules: int, d_in: int, C: int, d_hidden: int, generator: torch.Generator, **_: Any
    ):
        super().__init__()
        self.C, self.d_hidden = C, d_hidden
        self.W_hidden = _normal(generator, math.sqrt(2 / d_in), n_modules, d_in, C * d_hidden)
        self.b_hidden = nn.Parameter(torch.zeros(n_modules, 1, C * d_hidden))
        self.w_out = _normal(generator, math.sqrt(1 / d_hidden), n_modules, 1, C, d_hidden)
        self.b_out = nn.Parameter(torch.zeros(n_modules, 1, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, *lead, d_in = x.shape
        hidden = F.gelu(torch.baddbmm(self.b_hidden, x.reshape(M, -1, d_in), self.W_hidden))
        hidden = hidden.view(M, hidden.shape[1], self.C, self.d_hidden)
        z = (hidden * self.w_out).sum(-1) + self.b_out
        return z.view(M, *lead, self.C)


class SequenceCI(nn.Module):
    """Sequence-aware CI (arXiv 2511.08854): one causal attention head over the module's inputs, its
    output concatenated with the position's own input, then the vector MLP:

        x̄_n = softmax((q_n Kᵀ + r_n) / √d_k) V  ⊕  x_n,     z_n = VectorMLP(x̄_n)

    with q, k, v = x W_q, x W_k, x W_v (width d_k = ``d_attn``) and r_n[m] = r[n − m] a learned scalar
    per relative offset 0..n_ctx−1. CAUSAL: position n attends to positions m <= n only, so g at n never
    depends on later tokens (the paper does not say; causal keeps SPD usable on prefixes).
    """

    def __init__(
        self,
        n_modules: int,
        d_in: int,
        C: int,
        d_hidden: int,
        generator: torch.Generator,
        n_ctx: int,
        d_attn: int | None = None,
    ):
        super().__init__()
        self.d_attn, self.n_ctx = d_attn or d_hidden, n_ctx
        self.W_qkv = _normal(generator, math.sqrt(1 / d_in), n_modules, d_in, 3 * self.d_attn)
        self.relative_bias = nn.Parameter(torch.zeros(n_modules, n_ctx))
        self.mlp = VectorMLPCI(n_modules, self.d_attn + d_in, C, d_hidden, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, b, p, d_in = x.shape
        if p > self.n_ctx:
            raise ValueError(f"sequence CI was built for at most n_ctx={self.n_ctx} positions, got {p}")
        qkv = torch.bmm(x.reshape(M, b * p, d_in), self.W_qkv).view(M, b, p, 3, self.d_attn)
        q, k, v = qkv.unbind(3)
        offset = torch.arange(p, device=x.device)
        offset = offset[:, None] - offset[None, :]  # n - m
        bias = self.relative_bias[:, offset.clamp(min=0)]  # [M, p, p]
        scores = (q @ k.transpose(-1, -2) + bias[:, None]) / math.sqrt(self.d_attn)
        scores = scores.masked_fill(offset < 0, float("-inf"))
        attended = scores.softmax(-1) @ v  # [M, b, p, d_attn]
        return self.mlp(torch.cat([attended, x], dim=-1))


CI_TYPES: dict[str, type[nn.Module]] = {"token": VectorMLPCI, "sequence": SequenceCI}

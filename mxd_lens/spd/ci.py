"""Causal-importance (CI) functions: from a module's inputs to g ∈ [0, 1]^C per position.

Every CI class here serves a *group* of M modules with the same input width at once, with stacked
parameters, so one step costs a few batched matmuls instead of a Python loop over modules and
components. ``forward(x: [M, b, p, d_in]) -> z: [M, b, p, C]`` gives pre-activations; the hard
sigmoids below turn z into g (masks) and g_upper (minimality loss).

A new CI type is a new class with that constructor and ``forward`` plus one line in ``CI_TYPES``; its
``options`` names the exact speed-ups (keyword flags of ``forward``) it implements, if any.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

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


CHUNK_ELEMENTS = 1 << 20
"""Hidden elements (rows x C·H) the chunked vector MLP computes at once: 4 MB of fp32, so that a chunk's
pre-activation, GELU and products stay in the CPU's cache instead of streaming through memory. (On one
core of an AMD EPYC with 1 MB L2 and 32 MB L3 per 2 cores, 2^18..2^20 were fastest, 2^22 ~1.7x slower
at C = 100, H = 128.)"""


class ChunkedVectorMLP(torch.autograd.Function):
    """z = w · GELU(x W + b) + β per component, over row chunks, without keeping the hidden layer.

    The plain autograd graph of ``VectorMLPCI`` writes and keeps [M, rows, C·H] tensors (the
    pre-activation, the GELU, the product with w) each step, hundreds of MB at C = 100, H = 128, so the
    step is bound by memory traffic, not arithmetic. Here each module's rows go through in chunks of
    about ``CHUNK_ELEMENTS`` hidden elements, with the bias folded into the matmul (x gets a column of
    ones, W a row b), and backward recomputes a chunk's hidden layer (one small matmul) rather than
    reading a stored one. The same arithmetic per row, in another order: equal to rounding.

    ``x`` [R, d_in] holds the rows of every module back to back, ``counts[m]`` of them for module m
    (so modules may have different numbers of rows: see ``VectorMLPCI``'s ``distinct``). Returns z [R, C].
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        W: torch.Tensor,
        b: torch.Tensor,
        w_out: torch.Tensor,
        b_out: torch.Tensor,
        counts: tuple[int, ...],
    ) -> torch.Tensor:
        C, H = w_out.shape[-2:]
        weights = torch.cat([W, b], dim=1)  # [M, d_in + 1, C·H]: the bias as the ones column's row
        ones = x.new_ones(x.shape[0], 1)
        rows = torch.cat([x, ones], dim=1)
        z = x.new_empty(x.shape[0], C)
        step = max(1, CHUNK_ELEMENTS // (C * H))
        start = 0
        for m, count in enumerate(counts):
            for lo in range(start, start + count, step):
                hi = min(lo + step, start + count)
                hidden = F.gelu(rows[lo:hi] @ weights[m])
                torch.sum(hidden.view(hi - lo, C, H).mul_(w_out[m, 0]), -1, out=z[lo:hi])
            z[start : start + count] += b_out[m]
            start += count
        ctx.save_for_backward(rows, weights, w_out)
        ctx.counts = counts
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_z: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weights, w_out = ctx.saved_tensors
        counts = ctx.counts
        C, H = w_out.shape[-2:]
        d_in = rows.shape[1] - 1
        grad_weights = torch.zeros_like(weights)
        grad_w_out = torch.zeros_like(w_out)
        grad_b_out = grad_z.new_empty(len(counts), 1, C)
        need_x = ctx.needs_input_grad[0]
        grad_x = grad_z.new_empty(rows.shape[0], d_in) if need_x else None
        grad_z = grad_z.contiguous()
        step = max(1, CHUNK_ELEMENTS // (C * H))
        start = 0
        for m, count in enumerate(counts):
            grad_b_out[m, 0] = grad_z[start : start + count].sum(0)
            for lo in range(start, start + count, step):
                hi = min(lo + step, start + count)
                pre = rows[lo:hi] @ weights[m]
                g = grad_z[lo:hi, :, None]
                hidden = F.gelu(pre).view(hi - lo, C, H)
                grad_w_out[m, 0] += hidden.mul_(g).sum(0)
                grad_pre = torch.ops.aten.gelu_backward((g * w_out[m, 0]).view(hi - lo, C * H), pre)
                grad_weights[m].addmm_(rows[lo:hi].T, grad_pre)
                if need_x:
                    torch.mm(grad_pre, weights[m, :d_in].T, out=grad_x[lo:hi])
            start += count
        return grad_x, grad_weights[:, :d_in], grad_weights[:, d_in:], grad_w_out, grad_b_out, None


def distinct_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, inverse) with ``rows[inverse]`` bit for bit ``x`` [N, d] and rows distinct, or None when
    every row of x is distinct. ``torch.unique(x, dim=0)`` does the same with a per-row loop (2–5 ms for
    1,024 rows of 16 on a CPU, 8 calls a step); here each row's bits are hashed to one int64 and the keys sorted, and the
    result is checked bit for bit, falling back to ``torch.unique`` on a hash collision."""
    bits = x.contiguous().view(_BITS[x.element_size()]).long()  # the rows' bit patterns
    multipliers = _hash_multipliers(x.shape[1], x.device)
    keys, inverse = torch.unique((bits * multipliers).sum(1), return_inverse=True)  # int64 wraps around
    if keys.shape[0] == x.shape[0]:
        return None
    first = torch.empty_like(keys).scatter_(0, inverse, torch.arange(x.shape[0], device=x.device))
    if not torch.equal(bits[first][inverse], bits):  # two rows with one key: do it the slow way
        rows, inverse = torch.unique(x, dim=0, return_inverse=True)
        return None if rows.shape[0] == x.shape[0] else (rows, inverse)
    return x[first], inverse


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _hash_multipliers(d: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(d)
    return (torch.randint(-(2**62), 2**62, (d,), generator=generator) * 2 + 1).to(device)


class VectorMLPCI(nn.Module):
    """ "vector_mlp": C small MLPs on the whole input, z_c = w_c · GELU(W_c x + b_c) + β_c.

    Stored stacked: ``W_hidden`` [M, d_in, C·H] makes all C hidden layers of a module one matmul.
    Init as the reference code: He-normal hidden weights, N(0, 1/H) output weights, zero biases.

    Two exact speed-ups, off unless asked (``SPDConfig`` asks): ``chunked`` computes z with
    ``ChunkedVectorMLP`` (cache-sized chunks, hidden layer recomputed in backward); ``distinct`` computes
    z once per distinct input row of a module and copies it to the row's repeats. Rows repeat where a
    module reads token embeddings (layer 0's Q, K, V inputs: at most d_vocab distinct rows in a batch),
    and z of a row depends on that row alone, so this is exact for the token CI. (Not for the sequence
    CI: there a position's z depends on the positions before it, which ``SequenceCI`` never asks for.)
    """

    options = ("chunked", "distinct")

    def __init__(
        self, n_modules: int, d_in: int, C: int, d_hidden: int, generator: torch.Generator, **_: Any
    ):
        super().__init__()
        self.C, self.d_hidden = C, d_hidden
        self.W_hidden = _normal(generator, math.sqrt(2 / d_in), n_modules, d_in, C * d_hidden)
        self.b_hidden = nn.Parameter(torch.zeros(n_modules, 1, C * d_hidden))
        self.w_out = _normal(generator, math.sqrt(1 / d_hidden), n_modules, 1, C, d_hidden)
        self.b_out = nn.Parameter(torch.zeros(n_modules, 1, C))

    def forward(self, x: torch.Tensor, chunked: bool = False, distinct: bool = False) -> torch.Tensor:
        M, *lead, d_in = x.shape
        flat = x.reshape(M, -1, d_in)
        if not (chunked or distinct):
            hidden = F.gelu(torch.baddbmm(self.b_hidden, flat, self.W_hidden))
            hidden = hidden.view(M, hidden.shape[1], self.C, self.d_hidden)
            z = (hidden * self.w_out).sum(-1) + self.b_out
            return z.view(M, *lead, self.C)
        n = flat.shape[1]
        parts, inverses = list(flat.unbind(0)), [None] * M
        if distinct:
            for m in range(M):
                found = distinct_rows(parts[m])
                if found is not None:
                    parts[m], inverses[m] = found
        counts = tuple(part.shape[0] for part in parts)
        if chunked:
            rows = flat.reshape(M * n, d_in) if counts == (n,) * M else torch.cat(parts)
            z = ChunkedVectorMLP.apply(rows, self.W_hidden, self.b_hidden, self.w_out, self.b_out, counts)
            if not distinct:
                return z.view(M, *lead, self.C)
            zs = z.split(counts)
        else:
            zs = [
                (F.gelu(torch.addmm(b, part, W)).view(-1, self.C, self.d_hidden) * w).sum(-1) + beta
                for part, W, b, w, beta in zip(
                    parts, self.W_hidden, self.b_hidden, self.w_out, self.b_out, strict=True
                )
            ]
        zs = [z if inverse is None else z[inverse] for z, inverse in zip(zs, inverses, strict=True)]
        return torch.stack(zs).view(M, *lead, self.C)


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

    options = ("chunked",)  # never "distinct": a position's z depends on the positions before it

    def forward(self, x: torch.Tensor, chunked: bool = False) -> torch.Tensor:
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
        return self.mlp(torch.cat([attended, x], dim=-1), chunked=chunked)


CI_TYPES: dict[str, type[nn.Module]] = {"token": VectorMLPCI, "sequence": SequenceCI}

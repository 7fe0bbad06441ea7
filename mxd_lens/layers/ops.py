"""The sparse hot path: a TopK encoder and a K-row decoder, each with a backward that touches only
the K selected entries per token.

Shapes: x [T, I], W [I, N], b [N]; a TopK code is (values [T, K], indices [T, K]).

The selection encoders (BatchTopK's batch-level top T*K, JumpReLU's threshold) give a variable
number of codes per token, laid out as [T, m] codes padded with zeros (``select_rows``), with the
same sparse backward.

Dense forms of the same maps (for tests and benchmarks) are ``topk_encode_dense``,
``batch_topk_dense``, ``threshold_dense`` and ``decode_dense``; they materialise the full [T, N]
code matrix.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


class EncoderOutput(NamedTuple):
    """What the TopK encoder returns (sparsify's pattern): the K selected codes and, when asked for, the
    ``k_aux`` largest pre-activations among the units an ``aux_mask`` allows (the dead ones, for AuxK),
    taken from the same ``x W + b`` so AuxK costs no second [T, N] matmul."""

    values: torch.Tensor  # [..., K] ReLU'd (signed with ``relu=False``), sorted descending
    indices: torch.Tensor  # [..., K]
    aux_values: torch.Tensor  # [..., k_aux] ReLU'd, straight-through gradient; [..., 0] without an aux_mask
    aux_indices: torch.Tensor  # [..., k_aux], disjoint from ``indices`` in every row


class _TopKEncode(torch.autograd.Function):
    """values, indices (and the AuxK selection) = TopK(ReLU(x W + b)), or with ``relu=False`` the plain
    TopK(x W + b): signed codes, every selected code passing its gradient (MxD's ``gate="topk"``).

    Forward is one dense matmul (x W is the irreducible cost of a gate over N units). Backward
    uses only the selected columns per token (K, plus k_aux with AuxK): dW = x^T S and db = colsum(S)
    with S the [T, N] gradient that is zero outside the selection, held as a sparse CSR matrix
    instead of a dense [I, T] x [T, N] product. The AuxK selection excludes each row's TopK units, so
    the two selections never share a column and S has no duplicate entries. The AuxK values are
    ReLU'd like the codes, but their gradient passes where the pre-activation is negative too (a
    straight-through ReLU): dead units sit below zero, where a plain ReLU gives them no gradient and
    AuxK revives nothing, while raw negative values turn decoder rows against the residual. Measured
    on SmolLM2 (docs/training.md): dead 0.76 -> 0.19 for the transcoder, and lower FVU.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        W: torch.Tensor,
        b: torch.Tensor,
        k: int,
        aux_mask,
        k_aux: int,
        relu: bool = True,
        pre_moments: list | None = None,
    ):
        pre = torch.addmm(b, x, W)
        if pre_moments is not None:  # each unit's mean and mean square over the tokens, from this same matmul
            pre_moments.append((pre.mean(0), pre.square().mean(0)))
        values, indices = pre.topk(k, dim=-1, sorted=True)
        if relu:
            values = values.clamp_min(0.0)
        if aux_mask is not None and k_aux > 0:
            candidates = pre.masked_fill(~aux_mask, float("-inf")).scatter_(-1, indices, float("-inf"))
            aux_values, aux_indices = candidates.topk(k_aux, dim=-1, sorted=True)
            # -inf (fewer candidates than k_aux) becomes 0 with no gradient
            aux_valid = torch.isfinite(aux_values)
            kept = aux_values.clamp_min(0.0) if relu else aux_values
            aux_values = torch.where(aux_valid, kept, torch.zeros_like(aux_values))
        else:
            aux_values = values.new_zeros(values.shape[0], 0)
            aux_indices = indices.new_zeros(indices.shape[0], 0)
            aux_valid = torch.zeros_like(aux_indices, dtype=torch.bool)
        # where the gradient passes: the ReLU gate for the TopK codes, every real candidate for AuxK
        # (straight through its ReLU)
        passes = torch.cat([values > 0 if relu else torch.ones_like(values, dtype=torch.bool), aux_valid], -1)
        ctx.save_for_backward(x, W, passes, torch.cat([indices, aux_indices], -1))
        ctx.mark_non_differentiable(indices, aux_indices)
        return values, indices, aux_values, aux_indices

    @staticmethod
    def backward(ctx, grad_values, _grad_indices, grad_aux_values, _grad_aux_indices):
        return (*_selected_grads(ctx, grad_values, grad_aux_values), None, None, None, None, None)


def _selected_grads(ctx, grad_values: torch.Tensor, grad_aux_values: torch.Tensor) -> tuple:
    """(dx, dW, db) of an encoder whose outputs are entries of ``x W + b`` gathered at ``indices``
    [T, k'] (the codes, then the AuxK entries), the gradient passing where ``passes`` [T, k'] is
    True; ``ctx`` holds (x, W, passes, indices) and ``needs_input_grad`` for (x, W, b). Shared by
    the TopK and the selection (BatchTopK, JumpReLU) encoders."""
    x, W, passes, indices = ctx.saved_tensors
    n_tokens, k = indices.shape
    grad = torch.cat([grad_values, grad_aux_values], -1)
    # ReLU gate: the derivative is zero where the selected pre-activation was <= 0 (and on padding).
    g = torch.where(passes, grad, torch.zeros_like(grad))
    flat_idx = indices.reshape(-1)
    grad_x = grad_W = grad_b = None
    if ctx.needs_input_grad[0]:
        # dx[t] = sum_k g[t, k] W[:, idx[t, k]]
        grad_x = torch.einsum("tk,tki->ti", g, W.t()[indices])
    if ctx.needs_input_grad[1]:
        # dW = x^T S with S the [T, N] gradient as a CSR matrix (columns sorted within each row,
        # as CSR wants). dense @ CSR writes W's own [I, N] layout directly, so autograd does not
        # copy a transposed gradient into place. A column listed twice in a row (only where one
        # of the two carries no gradient) is summed.
        order = indices.argsort(dim=-1)
        crow = torch.arange(0, n_tokens * k + 1, k, device=x.device)
        S = torch.sparse_csr_tensor(
            crow,
            indices.gather(-1, order).reshape(-1),
            g.gather(-1, order).reshape(-1),
            size=(n_tokens, W.shape[1]),
            check_invariants=False,
        )
        grad_W = torch.mm(x.t(), S)
    if ctx.needs_input_grad[2]:
        grad_b = torch.zeros(W.shape[1], dtype=g.dtype, device=g.device)
        grad_b.index_add_(0, flat_idx, g.reshape(-1))
    return grad_x, grad_W, grad_b


def topk_encode(
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor,
    k: int,
    aux_mask: torch.Tensor | None = None,
    k_aux: int = 0,
    relu: bool = True,
    pre_moments: list | None = None,
) -> EncoderOutput:
    """TopK_K(ReLU(x W + b)) as (values [..., K], indices [..., K]), values sorted descending, plus the
    AuxK selection when ``aux_mask`` ([N] bool, True = may be chosen) and ``k_aux`` are given: the
    ``min(k_aux, candidates)`` largest pre-activations among allowed units outside the row's TopK,
    ReLU'd with a straight-through gradient (it passes below zero); missing candidates are zeros
    with no gradient.

    Fewer than K positive pre-activations leave zeros among the values (their gradient is zero).
    ``relu=False``: the plain TopK of ``x W + b``, signed values, each with its gradient (AuxK's too).
    ``pre_moments``: a list to which the per-unit mean and mean square [N] of ``x W + b`` over the
    tokens are appended (no gradient), read from the same matmul (MxD's gate standardisation).
    """
    lead = x.shape[:-1]
    if aux_mask is not None:
        if aux_mask.shape != (W.shape[1],) or aux_mask.dtype != torch.bool:
            raise ValueError(f"aux_mask must be a bool tensor of shape ({W.shape[1]},), got {aux_mask.shape}")
        if k_aux < 0:
            raise ValueError(f"k_aux={k_aux} must be >= 0")
        k_aux = min(k_aux, W.shape[1] - k)
    out = _TopKEncode.apply(x.reshape(-1, x.shape[-1]), W, b, k, aux_mask, k_aux, relu, pre_moments)
    return EncoderOutput(*(t.reshape(*lead, t.shape[-1]) for t in out))


def topk_encode_dense(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, k: int, relu: bool = True
) -> torch.Tensor:
    """Reference form of :func:`topk_encode`: the dense [..., N] codes, autograd all the way."""
    pre = x @ W + b
    pre = F.relu(pre) if relu else pre
    values, indices = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, values)


def select_rows(
    pre: torch.Tensor, mask: torch.Tensor, avoid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of ``pre`` [T, N] that ``mask`` [T, N] (bool) selects, as codes of a fixed width:
    (values, indices) [T, m], m the largest number selected in a row (at least 1). Each row holds its
    selected units first, values ``ReLU(pre)`` sorted descending, then padding: value 0 at other,
    distinct units of the row (so ``decode_rows`` and a CSR gradient take the codes as they are).
    ``avoid`` [T, N] (bool) marks units the padding should not use where others are left (AuxK's).
    Differentiable in ``pre`` (the padding passes no gradient)."""
    if pre.shape[0] == 0:
        empty = pre.new_zeros(0, 1)
        return empty, empty.long()
    m = max(int(mask.sum(-1).max()), 1)
    fill = pre.masked_fill(~mask, torch.finfo(pre.dtype).min)
    if avoid is not None:
        fill = fill.masked_fill(avoid & ~mask, float("-inf"))
    values, indices = fill.topk(m, dim=-1, sorted=True)
    chosen = mask.gather(-1, indices)
    return torch.where(chosen, values.clamp_min(0.0), torch.zeros_like(values)), indices


def batch_topk_mask(pre: torch.Tensor, k: int, distributed: bool = False) -> torch.Tensor:
    """[T, N] bool: the T*k largest entries of ``ReLU(pre)`` over the whole batch (BatchTopK's
    selection; SAELens's ``BatchTopK``: ``topk`` of the flattened ReLU'd pre-activations). Where fewer
    than T*k are positive some zeros are among them (they decode to nothing).

    ``distributed``: the batch is this rank's equal share of a torch.distributed batch, and the
    selection is the T*k*world largest of the whole global batch (each rank's candidates are
    gathered), so data-parallel training selects what one process would on the global batch."""
    n_rows, n_units = pre.shape
    _check_batch_k(k, n_units)
    flat = pre.detach().clamp_min(0.0).reshape(-1)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    n = n_rows * k
    if distributed:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        n *= world
        local = min(n, flat.numel())  # this rank's candidates: only they can be among the global top n
        values, positions = flat.topk(local, sorted=False)
        gathered = [torch.empty_like(values) for _ in range(world)]
        dist.all_gather(gathered, values)
        top = torch.cat(gathered).topk(min(n, local * world), sorted=False).indices
        mask[positions[top[top // local == rank] - rank * local]] = True
    else:
        mask[flat.topk(n, sorted=False).indices] = True
    return mask.view(n_rows, n_units)


def _check_batch_k(k: int, n_units: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= n_units:
        raise ValueError(
            f"BatchTopK keeps k codes per token on average: it needs an int 0 < k <= d_sae={n_units}, got k={k!r}"
        )


class _SelectEncode(torch.autograd.Function):
    """The codes ``ReLU(x W + b)`` at the entries a rule ``select(pre) -> [T, N] bool`` picks (a
    variable number per token: BatchTopK's batch selection, JumpReLU's threshold) as ``select_rows``
    lays them out, plus AuxK's ``k_aux`` largest pre-activations among ``aux_mask``'s units outside the
    row's selection (ReLU'd, straight-through, as in ``_TopKEncode``). One dense matmul forward; the
    backward touches only the selected entries (``_selected_grads``)."""

    @staticmethod
    def forward(ctx, x, W, b, select, aux_mask, k_aux):
        pre = torch.addmm(b, x, W)
        mask = select(pre)
        if aux_mask is not None and k_aux > 0:
            candidates = pre.masked_fill(~aux_mask | mask, float("-inf"))
            aux_values, aux_indices = candidates.topk(min(k_aux, W.shape[1]), dim=-1, sorted=True)
            aux_valid = torch.isfinite(aux_values)
            aux_values = torch.where(aux_valid, aux_values.clamp_min(0.0), torch.zeros_like(aux_values))
            avoid = torch.zeros_like(mask).scatter_(-1, aux_indices, aux_valid)
        else:
            aux_values = pre.new_zeros(pre.shape[0], 0)
            aux_indices = torch.zeros_like(aux_values, dtype=torch.long)
            aux_valid = torch.zeros_like(aux_indices, dtype=torch.bool)
            avoid = None
        values, indices = select_rows(pre, mask, avoid)
        passes = torch.cat([values > 0, aux_valid], -1)
        ctx.save_for_backward(x, W, passes, torch.cat([indices, aux_indices], -1))
        ctx.mark_non_differentiable(indices, aux_indices)
        return values, indices, aux_values, aux_indices

    @staticmethod
    def backward(ctx, grad_values, _grad_indices, grad_aux_values, _grad_aux_indices):
        return (*_selected_grads(ctx, grad_values, grad_aux_values), None, None, None)


def _select_encode(x, W, b, select, aux_mask, k_aux) -> EncoderOutput:
    if aux_mask is not None:
        if aux_mask.shape != (W.shape[1],) or aux_mask.dtype != torch.bool:
            raise ValueError(f"aux_mask must be a bool tensor of shape ({W.shape[1]},), got {aux_mask.shape}")
        if k_aux < 0:
            raise ValueError(f"k_aux={k_aux} must be >= 0")
    return EncoderOutput(*_SelectEncode.apply(x, W, b, select, aux_mask, k_aux))


def batch_topk_encode(
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor,
    k: int,
    aux_mask: torch.Tensor | None = None,
    k_aux: int = 0,
    distributed: bool = False,
) -> EncoderOutput:
    """BatchTopK: of ``ReLU(x W + b)`` over the batch x [T, I], the T*k largest entries
    (``batch_topk_mask``; ``distributed``: of the global data-parallel batch). A token has any number
    of them: the codes are (values, indices) [T, m] as ``select_rows`` lays them out, m the most any
    token has, padding with value 0. AuxK as in ``topk_encode`` (outside each row's selection)."""
    if x.dim() != 2:
        raise ValueError(f"batch_topk_encode takes a batch of tokens [T, d_in], got shape {tuple(x.shape)}")
    _check_batch_k(k, W.shape[1])  # before the matmul
    return _select_encode(x, W, b, lambda pre: batch_topk_mask(pre, k, distributed), aux_mask, k_aux)


def threshold_encode(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, threshold: torch.Tensor
) -> EncoderOutput:
    """JumpReLU: ``ReLU(x W + b)`` where ``x W + b > threshold`` (per unit [N], or one value), for
    x [..., I], as (values, indices) [..., m] (``select_rows``'s layout; m the most units any token
    has over its threshold). A token's codes do not depend on the other tokens."""
    lead = x.shape[:-1]
    out = _select_encode(x.reshape(-1, x.shape[-1]), W, b, lambda pre: pre > threshold, None, 0)
    return EncoderOutput(*(t.reshape(*lead, t.shape[-1]) for t in out))


def batch_topk_dense(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Reference form of :func:`batch_topk_encode`: the dense [T, N] codes, autograd all the way."""
    pre = F.relu(x @ W + b)
    flat = pre.reshape(-1)
    top = flat.topk(pre.shape[0] * k)
    return torch.zeros_like(flat).scatter(0, top.indices, top.values).view_as(pre)


def threshold_dense(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """Reference form of :func:`threshold_encode`: the dense [..., N] codes ``ReLU(pre) * (pre > threshold)``."""
    pre = x @ W + b
    return F.relu(pre) * (pre > threshold)


def decode_rows(values: torch.Tensor, indices: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """sum_k values[..., k] * W[indices[..., k]]: a gather of K rows of W [N, O] per token.

    ``F.embedding_bag`` does the weighted sum without materialising [T, K, O]; its backward
    writes only the gathered rows of W and gives the per-value gradient.
    """
    lead = indices.shape[:-1]
    k = indices.shape[-1]
    out = F.embedding_bag(
        indices.reshape(-1, k),
        W,
        per_sample_weights=values.reshape(-1, k).to(W.dtype),
        mode="sum",
    )
    return out.reshape(*lead, W.shape[-1])


def decode_dense(codes: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Reference form of :func:`decode_rows`: the dense product codes [..., N] @ W [N, O]."""
    return codes @ W


def sparsify(codes: torch.Tensor, max_fraction: float = 0.125) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, indices) holding every non-zero of ``codes`` [..., N], or None when the codes are
    too dense for a gather to pay (more than ``max_fraction * N`` non-zeros in some row).

    Values are gathered from ``codes`` itself, so gradients flow back to it.
    """
    if codes.numel() == 0:
        return None
    n = codes.shape[-1]
    k = int((codes != 0).sum(-1).max().item())
    if k > max_fraction * n:
        return None
    k = max(k, 1)
    indices = codes.detach().abs().topk(k, dim=-1).indices
    return codes.gather(-1, indices), indices

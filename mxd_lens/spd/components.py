"""SPD's decomposition of a TransformerLens model's weights into rank-1 components, swapped in by hooks.

Each chosen weight W ∈ R^{d_out×d_in} gets V ∈ R^{d_in×C}, U ∈ R^{C×d_out} with (VU)ᵀ ≈ W. With
component activations h = x V, masks m ∈ [0,1]^C and a delta mask m_Δ per position, the module computes

    y = (h ⊙ m) U + m_Δ · x ΔWᵀ + b,        ΔW = W − (VU)ᵀ   (the delta component, on by default)

Inside ``Decomposition.patched(...)`` every forward of the host model computes y in place of x Wᵀ + b at
the hook points listed in ``sites.py``. The host keeps computing its own x Wᵀ + b (call it o) and the hook
uses it: x ΔWᵀ = (o − b) − h U, so y = (h ⊙ (m − m_Δ)) U + m_Δ (o − b) + b costs one matmul with V and
one with U. With m = 1 and m_Δ = 1, y = o: the decomposed model is the original one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mxd_lens.spd.ci import CI_TYPES, lower_leaky_hard_sigmoid, upper_leaky_hard_sigmoid
from mxd_lens.spd.sites import Site, input_reader, read_weight, resolve

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

Masks = dict[str, torch.Tensor]


class Components(nn.Module):
    """The C rank-1 components of one weight, and frozen copies of the weight (Wᵀ) and its bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, C: int, generator: torch.Generator):
        super().__init__()
        d_in, d_out = weight.shape
        options = dict(device=weight.device, dtype=weight.dtype)
        self.V = nn.Parameter((torch.randn(d_in, C, generator=generator) / math.sqrt(d_in)).to(**options))
        self.U = nn.Parameter((torch.randn(C, d_out, generator=generator) / math.sqrt(C)).to(**options))
        self.register_buffer("target", weight.detach().clone(), persistent=False)  # Wᵀ
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        original: torch.Tensor,
        mask: torch.Tensor | None,
        delta_mask: torch.Tensor | None,
        routing: torch.Tensor | None,
        delta: bool,
        routed_rows_only: bool = False,
    ) -> torch.Tensor:
        """y for input x [b, p, d_in], given the host's own output ``original`` = x Wᵀ + b (any trailing
        shape, e.g. [b, p, heads, d_head]); positions where ``routing`` is False keep ``original``.

        ``routed_rows_only``: compute y only on the batch rows that ``routing`` routes somewhere and copy
        it into ``original`` (exact: the other rows are ``original`` either way). In a fused forward of
        all reconstruction runs most rows belong to runs that leave this module alone (the layerwise
        runs of the other modules), so this skips most of the module's work."""
        o = original.reshape(*original.shape[:2], -1)
        m = None if mask is None else mask.to(o)  # masks may come from the CPU (reports)
        m_delta = None if delta_mask is None else delta_mask.to(o)
        if routing is not None:
            routing = routing.to(o.device)
            if routed_rows_only:
                rows = routing.any(-1).nonzero().squeeze(1)
                if rows.numel() < routing.shape[0]:
                    pick = (x, o, m, m_delta, routing)
                    x, o_rows, m, m_delta, routing = (
                        None if t is None else t.index_select(0, rows) for t in pick
                    )
                    y = self._replace(x, o_rows, m, m_delta, delta)
                    y = o.index_copy(0, rows, torch.where(routing[..., None], y, o_rows))
                    return y.reshape(original.shape).to(original.dtype)
        y = self._replace(x, o, m, m_delta, delta)
        if routing is not None:
            y = torch.where(routing[..., None], y, o)
        return y.reshape(original.shape).to(original.dtype)

    def _replace(
        self,
        x: torch.Tensor,
        o: torch.Tensor,
        m: torch.Tensor | None,
        m_delta: torch.Tensor | None,
        delta: bool,
    ) -> torch.Tensor:
        """y = (h ⊙ (m − m_Δ)) U + m_Δ (o − b) + b with h = x V (without ΔW: (h ⊙ m) U + b)."""
        b = 0.0 if self.bias is None else self.bias
        h = x.to(self.V.dtype) @ self.V
        if not delta:
            return (h if m is None else h * m) @ self.U + b
        if m is None and m_delta is None:
            return o
        m = 1.0 if m is None else m
        m_delta = 1.0 if m_delta is None else m_delta[..., None]
        return (h * (m - m_delta)) @ self.U + m_delta * (o - b) + b


class Decomposition(nn.Module):
    """Rank-1 components (V, U) and causal-importance functions for ``modules`` of ``model``.

    ``ci``: "sequence" (causal attention over the module's inputs, then a vector MLP; arXiv 2511.08854)
    or "token" (vector MLP on the position's own input). ``ci_hidden`` is the MLP width per component
    (and the attention width, unless ``ci_attn_dim``). The host model is referenced, never modified.

    ``ci_chunked``, ``ci_distinct_rows`` (token CI only) and ``routed_rows_only`` switch on exact
    speed-ups (``VectorMLPCI``, ``Components.forward``); they are attributes, free to change at any time.
    """

    def __init__(
        self,
        model: HookedTransformer,
        modules: Sequence[str],
        C: int,
        ci: str = "sequence",
        ci_hidden: int = 16,
        seed: int = 0,
        *,
        ci_attn_dim: int | None = None,
        delta: bool = True,
        ci_chunked: bool = False,
        ci_distinct_rows: bool = False,
        routed_rows_only: bool = False,
    ):
        super().__init__()
        if isinstance(C, bool) or not isinstance(C, int) or C <= 0:
            raise ValueError(f"C={C!r}: the number of components per module must be a positive int")
        if ci not in CI_TYPES:
            raise ValueError(f"ci={ci!r} unknown; choose one of {sorted(CI_TYPES)}")
        if ci_hidden <= 0 or (ci_attn_dim is not None and ci_attn_dim <= 0):
            raise ValueError(f"ci_hidden={ci_hidden}, ci_attn_dim={ci_attn_dim} must be positive")
        modules = [modules] if isinstance(modules, str) else list(modules)
        if not modules or len(set(modules)) != len(modules):
            raise ValueError(f"modules={modules}: give at least one weight name, each once")
        self.__dict__["model"] = model  # a reference: not a submodule, not in state_dict, never moved
        self.names = modules
        self.C, self.ci_type, self.seed, self.delta = C, ci, seed, delta
        self.ci_hidden, self.ci_attn_dim = ci_hidden, ci_attn_dim
        # Exact speed-ups (they change rounding, never the maths), so not in config(); see SPDConfig.
        self.ci_chunked, self.ci_distinct_rows = ci_chunked, ci_distinct_rows
        self.routed_rows_only = routed_rows_only
        self.sites: dict[str, Site] = {name: resolve(model, name) for name in modules}

        generator = torch.Generator().manual_seed(seed)
        self.components = nn.ModuleDict(
            {_key(name): Components(*read_weight(model, name), C, generator) for name in modules}
        )
        # One CI module per input width, holding all modules of that width stacked.
        self.ci_groups: dict[str, list[str]] = {}
        for name in modules:
            self.ci_groups.setdefault(f"d_in_{self.sites[name].d_in}", []).append(name)
        first = next(iter(self.components.values())).V
        self.ci = nn.ModuleDict(
            {
                group: CI_TYPES[ci](
                    n_modules=len(names),
                    d_in=self.sites[names[0]].d_in,
                    C=C,
                    d_hidden=ci_hidden,
                    generator=generator,
                    n_ctx=model.cfg.n_ctx,
                    d_attn=ci_attn_dim,
                ).to(device=first.device, dtype=first.dtype)
                for group, names in self.ci_groups.items()
            }
        )

    def config(self) -> dict[str, Any]:
        """The constructor arguments (besides the model) that rebuild this decomposition's shapes."""
        return dict(
            modules=self.names,
            C=self.C,
            ci=self.ci_type,
            ci_hidden=self.ci_hidden,
            seed=self.seed,
            ci_attn_dim=self.ci_attn_dim,
            delta=self.delta,
        )

    # -- weights ------------------------------------------------------------------------------------
    def weights(self, name: str) -> torch.Tensor:
        """(V U)ᵀ ∈ R^{d_out×d_in}: the sum of the module's components, in W's layout."""
        part = self._components(name)
        return (part.V @ part.U).T

    def target_weight(self, name: str) -> torch.Tensor:
        """The frozen copy of W ∈ R^{d_out×d_in} the components decompose."""
        return self._components(name).target.T

    def faithfulness_loss(self) -> torch.Tensor:
        """Σ_l ‖W_l − (V_l U_l)ᵀ‖²_F / Σ_l numel(W_l)."""
        parts = list(self.components.values())
        total = sum(((part.target - part.V @ part.U) ** 2).sum() for part in parts)
        return total / sum(part.target.numel() for part in parts)

    @torch.no_grad()
    def init_from_svd(self) -> Decomposition:
        """Set V, U from W's SVD, Wᵀ = A S Bᵀ: component c < rank gets v_c = a_c √s_c, u_c = √s_c b_c,
        the rest are zero (and stay dead). Exact (VU = Wᵀ) when C >= min(d_in, d_out)."""
        for part in self.components.values():
            A, S, Bh = torch.linalg.svd(part.target.float(), full_matrices=False)
            k = min(self.C, S.numel())
            root = S[:k].sqrt()
            part.V.zero_()[:, :k] = (A[:, :k] * root).to(part.V.dtype)
            part.U.zero_()[:k] = (root[:, None] * Bh[:k]).to(part.U.dtype)
        return self

    # -- causal importance ------------------------------------------------------------------------
    @torch.no_grad()
    def run_clean(self, model: HookedTransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, Masks]:
        """One forward of the unmodified model: (logits, each module's input [b, p, d_in])."""
        inputs: Masks = {}
        entries = [(self.sites[name], _storer(inputs, name), None) for name in self.names]
        with _io_hooks(model, entries):
            logits = model(tokens)
        return logits, inputs

    def ci_from_inputs(self, inputs: Masks) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{name: (g, g_upper)}, each [b, p, C]: g = lower-leaky hard sigmoid (for masks), g_upper =
        upper-leaky one (for the minimality loss), from the same pre-activations z."""
        out = {}
        for group, names in self.ci_groups.items():
            ci = self.ci[group]
            dtype = next(ci.parameters()).dtype
            asked = {"chunked": self.ci_chunked, "distinct": self.ci_distinct_rows}
            options = {k: True for k, on in asked.items() if on and k in getattr(ci, "options", ())}
            z = ci(torch.stack([inputs[name] for name in names]).to(dtype), **options)
            g, g_upper = lower_leaky_hard_sigmoid(z), upper_leaky_hard_sigmoid(z)
            out.update({name: (g[i], g_upper[i]) for i, name in enumerate(names)})
        return {name: out[name] for name in self.names}

    def causal_importance(
        self, model: HookedTransformer, tokens: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Run the clean model once on ``tokens``, then the CI functions: {name: (g, g_upper)}."""
        return self.ci_from_inputs(self.run_clean(model, tokens)[1])

    # -- the swap -----------------------------------------------------------------------------------
    @contextmanager
    def patched(
        self,
        masks: Masks | None = None,
        delta_masks: Masks | None = None,
        routing: Masks | None = None,
        modules: Sequence[str] | None = None,
    ) -> Iterator[HookedTransformer]:
        """Run the host model with ``modules`` (default: all) computed by their masked components.

        ``masks[name]`` [b, p, C] (missing or None: all ones), ``delta_masks[name]`` [b, p] (missing or
        None: 1), ``routing[name]`` [b, p] bool (missing or None: all True; False keeps the original
        output at that position). With ``self.delta`` False the ΔW term is left out."""
        names = self.names if modules is None else list(modules)
        for name in names:
            self._components(name)
        _check_masks(masks, "masks", names, 3, self.C)
        _check_masks(delta_masks, "delta_masks", names, 2)
        _check_masks(routing, "routing", names, 2, boolean=True)
        entries = []
        for name in names:
            slot: dict[str, torch.Tensor] = {}
            args = [(d or {}).get(name) for d in (masks, delta_masks, routing)]
            entries.append((self.sites[name], _storer(slot, "x"), self._replacer(name, slot, *args)))
        with _io_hooks(self.model, entries):
            yield self.model

    def _replacer(self, name: str, slot: dict, mask: Any, delta_mask: Any, routing: Any):
        part = self._components(name)

        def hook(original: torch.Tensor, hook: Any) -> torch.Tensor:
            x = slot.pop("x")
            b, p = x.shape[:2]
            for label, tensor, shape in (
                ("masks", mask, (b, p, self.C)),
                ("delta_masks", delta_mask, (b, p)),
                ("routing", routing, (b, p)),
            ):
                if tensor is not None and tuple(tensor.shape) != shape:
                    raise ValueError(
                        f"{label}[{name!r}] has shape {tuple(tensor.shape)}, expected {shape} "
                        f"(batch, positions{', C' if label == 'masks' else ''}) for this forward"
                    )
            return part(x, original, mask, delta_mask, routing, self.delta, self.routed_rows_only)

        return hook

    def _components(self, name: str) -> Components:
        key = _key(name)
        if key not in self.components:
            raise ValueError(f"{name!r} is not decomposed here; the modules are {self.names}")
        return self.components[key]


def _key(name: str) -> str:
    return name.replace(".", "-")  # ModuleDict keys cannot hold dots


def _storer(slot: dict, key: str):
    def store(x: torch.Tensor) -> None:
        slot[key] = x

    return store


def _check_masks(
    masks: Masks | None, label: str, names: list[str], ndim: int, C: int | None = None, boolean: bool = False
) -> None:
    if masks is None:
        return
    unknown = set(masks) - set(names)
    if unknown:
        raise ValueError(f"{label} has entries for {sorted(unknown)}, which are not patched here ({names})")
    for name, tensor in masks.items():
        if tensor is None:
            continue
        if tensor.ndim != ndim or (C is not None and tensor.shape[-1] != C):
            want = f"[batch, positions, C={C}]" if C is not None else "[batch, positions]"
            raise ValueError(f"{label}[{name!r}] has shape {tuple(tensor.shape)}, expected {want}")
        if boolean and tensor.dtype != torch.bool:
            raise ValueError(f"{label}[{name!r}] must be a bool tensor, got {tensor.dtype}")


@contextmanager
def _io_hooks(model: HookedTransformer, entries: list) -> Iterator[None]:
    """For each (site, store, replace): call store(x [b, p, d_in]) with the site's input and, when
    ``replace`` is given, put replace(output, hook) in place of the site's output."""
    handles, fwd_hooks = [], []
    try:
        for site, store, replace in entries:
            module, reader, hook_name = input_reader(model, site, store)
            if module is not None:
                handles.append(module.register_forward_pre_hook(reader, with_kwargs=True))
            else:
                fwd_hooks.append((hook_name, reader))
            if replace is not None:
                fwd_hooks.append((site.writes, replace))
        with model.hooks(fwd_hooks=fwd_hooks):
            yield
    finally:
        for handle in handles:
            handle.remove()

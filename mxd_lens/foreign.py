"""Layers from elsewhere: any SAELens ``SAE`` that replaces an MLP, as ``splice`` and ``evaluate`` use it.

Researchers hold transcoders trained with other code and loaded by SAELens (``SAE.from_pretrained``,
``SAE.load_from_disk``): SAELens's ``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder`` and
``jumprelu_skip_transcoder`` (``sae_lens/saes/transcoder.py``). Such a layer says where it reads and
writes in its cfg: ``metadata.hook_name`` and ``metadata.hook_name_out``. It replaces block L's MLP
when it writes ``blocks.L.hook_mlp_out`` (or ``blocks.L.mlp.hook_out``, the MLP module's own output:
``mxd_lens.hooks`` says how the two differ) and reads, in the same block, one of

- ``blocks.L.mlp.hook_in``: the MLP's input (what our layers record); read as the MLP module's exact
  input, as for ours;
- ``blocks.L.ln2.hook_normalized``: TransformerLens's normalised residual *before* ln2's weight (and
  bias). It is the MLP's input only when the model's LayerNorm is folded (ln2 a ``LayerNormPre`` /
  ``RMSNormPre``, ``fold_ln=True``): then read as the MLP module's input; otherwise refused, with why;
- ``blocks.L.hook_mlp_in``: the residual stream before ln2: the layer is given that pre-norm residual,
  as it was trained (the host's ln2 normalises only the MLP's input, not the layer's). Read as ln2's
  input, so the model's ``use_hook_mlp_in`` need not be on. SAELens 6.54's Gemma Scope 2 loader
  (``get_gemma_3_config_from_hf``) gives its transcoders this hook while recording
  ``hf_hook_name = model.layers.L.pre_feedforward_layernorm.output``, which in Hugging Face's Gemma 3 is
  the norm's output, the MLP's input, and what they were trained on: a layer whose ``hf_hook_name`` is a
  norm's output therefore reads the MLP's input, with a warning that says so.

Anything else (a residual-stream SAE, ``hook_name_out`` missing, reading one block and writing another)
is a ValueError naming the hook found and what is supported.

Its output is what SAELens's ``forward`` computes. For ``Transcoder.forward`` (``transcoder``,
``jumprelu_transcoder``) that is ``decode(encode(x))``, and for ``SkipTranscoder.forward``
(``skip_transcoder``, ``jumprelu_skip_transcoder``) ``decode(encode(x)) + x @ W_skip.T`` (``W_skip`` is
[d_out, d_in]): so one ``encode`` gives both the output and the codes the metrics need, and the output of
any chosen codes (``evaluate``'s top-1 FVU) is ``decode(codes)`` plus the same skip. A class whose
``forward`` is another is run through its own ``forward`` (its codes from ``encode``), and what needs the
output of chosen codes is NaN. The input is cast to the layer's dtype first, as ``encode`` does (SAELens's
skip product would fail on another dtype).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sae_lens import SAE
from sae_lens.saes.transcoder import SkipTranscoder, Transcoder
from transformer_lens.hook_points import HookPoint

SUPPORTED_READS = ("blocks.L.mlp.hook_in", "blocks.L.ln2.hook_normalized", "blocks.L.hook_mlp_in")
_SUPPORTED = (
    f"mxd-lens splices layers that replace an MLP: they read its input ({', '.join(SUPPORTED_READS)}) "
    "and write 'blocks.L.hook_mlp_out' (or 'blocks.L.mlp.hook_out') of the same block (transcoders)"
)


class ForeignLayer:
    """A SAELens ``SAE`` from elsewhere as ``mxd_lens.hooks.splice`` and ``evaluate`` use it (the
    interface of ``mxd_lens.hooks.replacement``). Raises a ValueError naming the hooks when its cfg
    does not say it replaces one MLP (see the module docstring)."""

    first: int = 0
    """The first position a splice replaces: ``mxd_lens.hooks.replacement`` sets it from the layer's
    ``metadata.seqpos_slice`` (``mxd_lens.records.first_position``; 0 when it records none). This module
    imports nothing of the project, so the lowest ones can use it."""

    def __init__(self, sae: Any, reads_at: tuple[int, str] | None, writes_at: tuple[int, str] | None):
        """``reads_at``, ``writes_at``: where its ``cfg.metadata.hook_name`` and ``hook_name_out`` say it
        reads and writes, as ``mxd_lens.hook_names.parse_in_hook`` / ``parse_out_hook`` give them (None:
        not an MLP's site); ``mxd_lens.hooks.replacement`` passes them, so hook names are parsed in one
        place."""
        if not isinstance(sae, SAE):
            raise TypeError(
                f"{type(sae).__name__} is not a layer: give an mxd-lens layer or a SAELens SAE "
                "(SAE.from_pretrained / SAE.load_from_disk)"
            )
        cfg, name = sae.cfg, type(sae).__name__
        hook_in, hook_out = cfg.metadata.hook_name, cfg.metadata.hook_name_out
        what = f"{name} ({cfg.architecture()!r})"
        if hook_out is None:
            raise ValueError(
                f"{what} reads {hook_in!r} and records no metadata.hook_name_out: it reconstructs one "
                f"activation (a sparse autoencoder), it does not replace an MLP; {_SUPPORTED}"
            )
        if writes_at is None:
            raise ValueError(f"{what} writes {hook_out!r} (metadata.hook_name_out); {_SUPPORTED}")
        if reads_at is None:
            raise ValueError(f"{what} reads {hook_in!r} (metadata.hook_name); {_SUPPORTED}")
        if reads_at[0] != writes_at[0]:
            raise ValueError(
                f"{what} reads {hook_in!r} (block {reads_at[0]}) but writes {hook_out!r} (block "
                f"{writes_at[0]}): it does not replace one block's MLP; {_SUPPORTED}"
            )
        if cfg.normalize_activations != "none":
            raise ValueError(
                f"{what} has normalize_activations={cfg.normalize_activations!r}: SAELens's transcoders "
                "do not undo it at the output (and do not apply 'expected_average_only_in' at all), so "
                "the layer would not see what it was trained on; fold it into the weights first "
                "(sae.fold_activation_norm_scaling_factor(factor)) or use a layer with 'none'"
            )
        forward = type(sae).forward
        formulas = {SkipTranscoder.forward: "skip", Transcoder.forward: "plain"}
        self._formula = formulas.get(forward)  # None: another forward, run as it is
        if self._formula is None and sae.use_error_term:
            raise ValueError(
                f"{what} has use_error_term=True, which its forward would add to its output: set it "
                "False and use mxd_lens.splice(model, layer, error_term=True)"
            )
        self.layer = sae
        self.block, self.writes = writes_at
        self.hook_name = str(hook_in)
        self.site = reads_at[1]  # mlp.hook_in | ln2.hook_normalized | hook_mlp_in
        self.reads = "resid" if self.site == "hook_mlp_in" else "mlp"
        k = getattr(cfg, "k", None)
        self.k = k if isinstance(k, int) and not isinstance(k, bool) else None
        source = str(getattr(cfg.metadata, "hf_hook_name", None) or "")
        if self.reads == "resid" and re.search(r"(norm|ln)[^.]*\.output$", source):
            # What the layer was trained on decides: SAELens's Gemma Scope 2 loader names hook_mlp_in (the
            # residual before ln2) for transcoders trained on the pre-feedforward norm's output
            self.reads = "mlp"
            warnings.warn(
                f"{what} names {hook_in!r} (the residual before ln2) but its metadata.hf_hook_name is "
                f"{source!r}, a norm's output: the MLP's input, which is what it was trained on, so it reads "
                f"the MLP's input ({hook_in.replace(self.site, 'mlp.hook_in')}); to give it the residual before ln2 "
                "instead, set layer.cfg.metadata.hf_hook_name = None",
                stacklevel=3,
            )

    @property
    def default_name(self) -> str:
        return f"L{self.block}.{self.layer.cfg.architecture()}" + (f".k{self.k}" if self.k else "")

    def check_fits(self, model: Any, block: int) -> None:
        """Raise unless this layer fits block ``block`` of ``model`` (which exists, with an MLP): widths,
        and a read site this model has (the model name it records: ``mxd_lens.hooks.check_model_name``,
        which every caller runs first)."""
        from transformer_lens.components import LayerNormPre, RMSNormPre
        from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

        cfg, name = self.layer.cfg, type(self.layer).__name__
        here = model.cfg.model_name
        d_model = model.cfg.d_model
        if cfg.d_in != d_model or getattr(cfg, "d_out", None) != d_model:
            raise ValueError(
                f"{name} maps {cfg.d_in} -> {getattr(cfg, 'd_out', None)} but {here}'s MLPs map "
                f"{d_model} -> {d_model}: it was built for another model"
            )
        if self.site == "ln2.hook_normalized":
            norm = model.blocks[block].ln2
            if model.cfg.original_architecture in POST_NORM_ARCHITECTURES:
                why = f"in {here} ({model.cfg.original_architecture}) ln2 normalises the MLP's output, not its input"
            elif not isinstance(norm, (LayerNormPre, RMSNormPre)):
                why = (
                    f"in {here} ln2 is a {type(norm).__name__}, whose hook_normalized is the normalised "
                    "residual before ln2's weight (and bias), not what the MLP reads: it equals the MLP's "
                    "input only when the LayerNorm weights are folded into the MLP. Load the model with "
                    "fold_ln=True (HookedTransformer.from_pretrained folds by default; "
                    "mxd_lens.models.load_model(name, fold_ln=True); model.process_weights_(fold_ln=True))"
                )
            else:
                return
            raise ValueError(f"{name} reads {self.hook_name!r}, but {why}")

    # -- the layer's output and codes ------------------------------------------------------------------
    def layer_output(self, x: torch.Tensor) -> torch.Tensor:
        """What SAELens's forward gives on ``x`` (code hooks run)."""
        x = x.to(self.layer.dtype)
        if self._formula is None:
            return self.layer(x)
        return self._decoded(x, self.layer.encode(x))

    def unhooked(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output with the layer's hook points off (SAELens's ``use_error_term`` does the same),
        None when none has a hook."""
        if not any(hp._forward_hooks or hp._forward_pre_hooks for hp in self.layer.hook_dict.values()):
            return None
        with _hooks_off(self.layer):
            return self.layer_output(x)

    def forward_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, code values, code indices): each token's m largest |codes|, m the most non-zero
        codes of any token here (at least 1), so the zeros beyond a token's own are padding."""
        x = x.to(self.layer.dtype)
        codes = self.layer.encode(x)
        out = self.layer(x) if self._formula is None else self._decoded(x, codes)
        values, indices = sparse_codes(codes)
        return out, values, indices

    def output_from_codes(
        self, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor | None:
        """``decode`` of these codes (the rest zero) plus the skip: None for a class whose forward is
        not SAELens's transcoder forward (how its output follows from codes is not known here)."""
        if self._formula is None:
            return None
        x = x.to(self.layer.dtype)
        codes = torch.zeros(
            *values.shape[:-1], self.layer.cfg.d_sae, dtype=values.dtype, device=values.device
        )
        return self._decoded(x, codes.scatter(-1, indices, values))

    # -- what the studies read (probing, inspect, attribution) -----------------------------------------
    @property
    def d_sae(self) -> int:
        return self.layer.cfg.d_sae

    def encode_sparse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(code values, code indices) [..., m] from SAELens's ``encode`` (its hooks run): each token's m
        largest |codes|, m the most non-zero codes of any token here, zeros beyond a token's own."""
        return sparse_codes(self.layer.encode(x.to(self.layer.dtype)))

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's pre-activations ``process_sae_in(x) W_enc + b_enc`` [..., d_sae], as SAELens's
        transcoders' ``encode`` computes them (before ReLU / the JumpReLU threshold)."""
        self._need_formula("its encoder's pre-activations")
        return self.layer.process_sae_in(x.to(self.layer.dtype)) @ self.layer.W_enc + self.layer.b_enc

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact per-unit split of the output on inputs x [T, d_in] (as ``OurLayer.split``): unit n's
        vector a_n W_dec[n]; the rest b_dec, plus x W_skip^T for a skip transcoder."""
        self._need_formula("its output split by latent")
        x = x.to(self.layer.dtype).reshape(-1, self.layer.cfg.d_in)
        values, indices = self.encode_sparse(x)
        vectors = self.layer.W_dec[indices] * values[..., None]
        rest = self._decoded(x, torch.zeros(x.shape[0], self.layer.cfg.d_sae, dtype=x.dtype, device=x.device))
        return indices, values, vectors, rest

    def _need_formula(self, what: str) -> None:
        if self._formula is None:
            raise ValueError(
                f"{type(self.layer).__name__} has its own forward, so {what} is not known here; mxd-lens reads "
                "SAELens's transcoder formulas (Transcoder, SkipTranscoder and their JumpReLU classes)"
            )

    def _decoded(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        out = self.layer.decode(codes)
        if self._formula == "skip":  # as SkipTranscoder.forward writes it
            out = out + x @ self.layer.W_skip.T.to(x.device)
        return out


def sparse_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense codes [..., d_sae] as (values, indices) [..., m]: each token's m largest |codes| (sorted),
    m the most non-zero codes of any token (at least 1)."""
    m = max(int((codes != 0).sum(-1).max()), 1) if codes.numel() else 1
    indices = codes.abs().topk(m, dim=-1, sorted=True).indices
    return codes.gather(-1, indices), indices


@contextmanager
def _hooks_off(sae: Any) -> Iterator[None]:
    """Each of the layer's hook points swapped for a bare one while inside (as SAELens's own
    ``_disable_hooks``), put back on exit."""
    saved = dict(sae.hook_dict)
    try:
        for name in saved:
            setattr(sae, name, HookPoint())
        yield
    finally:
        for name, hook in saved.items():
            setattr(sae, name, hook)


def from_pretrained(name: str, device: str = "cpu") -> Any:
    """A published SAELens layer named ``RELEASE/ID`` (the release as SAELens's pretrained_saes.yaml names
    it, then the layer's id, which may hold slashes: ``gemma-scope-2-270m-pt-transcoders/
    transcoder/layer_9_width_16k_l0_small_affine``), loaded by ``SAE.from_pretrained`` through SAELens's
    own converter. Works offline from a local Hugging Face cache (``HF_HUB_OFFLINE=1``): SAELens 6.54's
    Gemma Scope 2 converter reads the weights' shapes with an HTTP range request even when the file is
    cached, so when that request cannot be made the shapes are read from the cached file's header instead.
    A clear error for a name without a slash or a release SAELens does not list."""
    from sae_lens.loading import pretrained_sae_loaders as loaders
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    release, _, sae_id = str(name).partition("/")
    if not release or not sae_id:
        raise ValueError(
            f"{name!r}: give RELEASE/ID, e.g. gemma-scope-2-270m-pt-transcoders/transcoder/layer_9_width_16k_l0_small_affine"
        )
    directory = get_pretrained_saes_directory()
    if release not in directory:
        near = sorted(r for r in directory if release.split("-")[0] in r)[:8]
        raise ValueError(
            f"{release!r} is not a release SAELens lists (sae_lens/pretrained_saes.yaml)"
            + (f"; releases like it: {near}" if near else "")
        )
    online = loaders.get_safetensors_tensor_shapes

    def shapes(repo_id: str, filename: str) -> dict[str, list[int]]:
        from huggingface_hub import constants, hf_hub_download

        if not constants.HF_HUB_OFFLINE:
            try:
                return online(repo_id, filename)
            except OSError:  # no network (requests' ConnectionError is an OSError): the cache may hold it
                pass
        from safetensors import safe_open

        path = hf_hub_download(repo_id, filename)  # the cached copy offline; a clear hub error if absent
        with safe_open(path, framework="pt") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118

    loaders.get_safetensors_tensor_shapes = shapes
    try:
        return SAE.from_pretrained(release, sae_id, device=device)
    finally:
        loaders.get_safetensors_tensor_shapes = online

"""How much does a replacement hurt the model? CE/KL splicing with ablation baselines, FVU, L0, dead units.

Every spliced number replaces ``hook_mlp_out`` (never the input hook: SAELens's ``run_evals`` and the
reference code splice transcoders at the input, which is wrong whenever input and output differ). A
pass over the held-out batches does, per batch: one clean forward (keeping the residual stream before
each replaced block), then per variant a forward *from its block on* (``start_at_layer``): each layer
spliced alone (its output computed once, on the clean MLP input, which is exactly what it sees when
spliced alone), zero-ablation of each block's MLP output, and optionally all layers at once. The mean
for mean-ablation is the MLP output's mean over the same held-out tokens, so the mean-ablated forwards
run after the pass, from the residual streams it kept.

Definitions (all per predicted token, averaged over the held-out tokens):
- CE: next-token cross-entropy in nats; ΔCE = CE(spliced) − CE(clean).
- CE recovered = (CE(ablated) − CE(spliced)) / (CE(ablated) − CE(clean)), for zero- and mean-ablation.
- KL = KL(clean ‖ spliced) of the next-token distributions.
- FVU = Σ‖ŷ − y‖² / Σ‖y − ȳ‖² against the true MLP output y on the clean input, where the layer
  writes (``hook_mlp_out``, or the MLP module's own output for a layer writing ``blocks.L.mlp.hook_out``,
  whose splice the block's post-MLP norm follows: ``mxd_lens.hooks``); explained variance = 1 − FVU.
  The ablation baselines replace ``hook_mlp_out`` whatever the layer's write site.

How the units are used (a unit is *active* on a token where its code is non-zero; MxD's ``topk`` gate
gives signed codes):
- ``l0``: active codes per token (≠ 0); ``l0_positive``: codes > 0 (equal for ReLU'd codes).
- ``always_on``: units active on more than half of the tokens.
- ``effective_units``: per token exp(entropy of |a| / Σ|a|) (1 when one code carries all the weight,
  L0 when all weigh the same), averaged over tokens.
- ``top1_fvu``: the FVU left when each token keeps only its largest |code| (the rest zeroed, the dense
  parts kept): near 1 when no single code carries the output.
- ``dead_fraction``: units *silent* on these held-out tokens (never active; ``mxd_lens.firing`` with the
  window = every token evaluated, so it depends on how many were); ``train_dead_fraction``: the
  trainer's dead fraction (its own window) as the layer's training record states it.
- ``jacobian_cos``: the mean over ``jacobian_tokens`` tokens of the cosine between the layer's
  input→output Jacobian and the MLP's (``mxd_lens.jacobian``: exact, or from ``jacobian_directions``
  random directions per token).
  (When the model prepends BOS, position 0 is left out of all of these, as in training.)

Each layer replaces the MLP from its first trained position on (``mxd_lens.hooks.first_position``: 1
for a layer trained without position 0, the BOS), as every splice does; before it the MLP's own output
stays, in the splice and in the zero- and mean-ablation baselines of its block alike, so CE recovered
compares like with like. Each row records it as ``spliced_from``.

``skip_positions = N`` leaves the first N positions of every row out of everything: CE and KL count the
predictions made at positions N and later (of tokens N + 1 on), FVU and the usage counts the activations
at positions N and later (and at least position 0 with BOS). For layers not trained there, e.g. Gemma
Scope 2's instruction-tuned transcoders, which skipped the first 4 positions; the layer still replaces
the MLP at those positions, so later positions see its output there through attention (unless its
``metadata.seqpos_slice`` says it starts later: then its splice does too).

Layers from elsewhere (SAELens transcoders, ``mxd_lens.foreign``) are measured the same way: their codes
are ``encode(x)``, their output SAELens's forward. One that reads ``blocks.L.hook_mlp_in`` (the residual
before ln2) is given that residual, and its Jacobian is compared with ln2 then the MLP, the map from the
same residual to the MLP's output. ``k`` is None for a layer without one; ``top1_fvu`` is NaN for a class
whose output cannot be rebuilt from chosen codes (its forward is not SAELens's transcoder forward).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from mxd_lens import hook_names, hooks
from mxd_lens.firing import FiringTracker
from mxd_lens.jacobian import jacobian_cosine
from mxd_lens.layers.base import MLPReplacement
from mxd_lens.layers.io import check_finite
from mxd_lens.records import TextRecord, TrainingRecord

if TYPE_CHECKING:
    from sae_lens import SAE


def evaluate(
    model: Any,
    layers: Mapping[str, MLPReplacement | SAE] | Sequence[MLPReplacement | SAE],
    batches: Iterable[torch.Tensor],
    *,
    together: bool = False,
    baselines: bool = True,
    skip_first_position: bool | None = None,
    skip_positions: int = 0,
    progress: bool = True,
    jacobian_tokens: int = 256,
    jacobian_directions: int | None = 16,
) -> list[dict[str, Any]]:
    """One row of metrics per layer (and one for all layers spliced together when ``together``).

    ``batches`` are [batch, context] token tensors from *held-out* text. ``baselines=False`` skips
    the zero- and mean-ablation runs (no ``ce_*_ablation`` / ``ce_recovered_*`` columns). Turn the
    result into a table with ``pandas.DataFrame(rows)``. ``jacobian_tokens`` (0: skip) and
    ``jacobian_directions`` (None: the exact Jacobian) set the Jacobian cosine; ``skip_positions`` leaves
    each row's first positions out of every metric (see the module doc; recorded in each row).

    Cost per batch: one clean forward that keeps the residual stream at each replaced block; per
    layer, the layer on the clean MLP input it saw there (once: the output serves the splice and FVU,
    L0 and dead units alike) and a forward from its own block on; per block, the zero-ablated forward
    from that block; after the pass, the mean-ablated forward from the kept residuals (the mean is
    known only then).

    A layer may also be any SAELens ``SAE`` that replaces an MLP (a transcoder loaded with
    ``SAE.from_pretrained`` / ``SAE.load_from_disk``; ``mxd_lens.foreign``): see the module docstring.
    """
    reps = _replacements(model, layers, together)
    plan = _Plan.of(model, reps, skip_first_position, skip_positions)
    spliced = _Spliced(model, plan.blocks, plan.first, plan.keep)
    moments = _OutputMoments(plan.targets, plan.skip)
    parts = _layer_parts(model, reps, jacobian_tokens, jacobian_directions)
    for tokens in tqdm(batches, desc="evaluating", unit="batch", disable=not progress):
        with torch.inference_mode():
            batch = _clean_pass(model, tokens, plan, spliced.scorer)
            spliced.clean(batch)
            moments.update(batch.io)
            for name, rep in reps.items():
                run = _LayerRun.of(rep, batch.io, plan.skip)  # computed once, read by every part
                spliced.splice(name, run, batch)
                for part in parts[name]:
                    part.update(run)
            if baselines:
                spliced.zero_ablation(batch)
            if together:
                spliced.together([rep.layer for rep in reps.values()], batch)
    if spliced.n_pred == 0:
        raise ValueError("evaluate got no token batches")
    if baselines:  # from the kept residuals, now that the mean is known
        spliced.mean_ablation({block: moments.mean(block) for block in plan.blocks})
    rows = [_layer_row(name, rep, spliced, moments, parts[name], baselines) for name, rep in reps.items()]
    if together:
        row = _identity("together", None, ",".join(map(str, plan.blocks)), None, list(reps))
        rows.append(
            {
                **row,
                **spliced.columns("together", plan.blocks, baselines),
                **spliced.standard_errors("*together"),
            }
        )
    for row in rows:
        row["skip_positions"] = plan.first
    for row, rep in zip(rows, reps.values(), strict=False):
        row["spliced_from"] = rep.first
    if together:
        rows[-1]["spliced_from"] = max(plan.keep.values())
    return rows


def _replacements(model: Any, layers: Any, together: bool) -> dict[str, Any]:
    """The layers to evaluate by name (``hooks.replacement`` of each: its default name unless ``layers``
    names it), each checked against ``model``."""
    if isinstance(layers, Mapping):
        reps = {name: hooks.replacement(layer) for name, layer in layers.items()}
    else:
        reps = {(rep := hooks.replacement(layer)).default_name: rep for layer in layers}
    if not reps:
        raise ValueError("evaluate needs at least one layer")
    for name, rep in reps.items():
        where = getattr(rep.layer, "mxd_lens_folder", None) or name  # its folder, when loaded from one
        check_finite(rep.layer, where)  # NaN weights would give NaN or absurd metrics
        _warn_if_untrained(rep.layer, where)
        hooks.check_block(model, rep.block)
        hooks.check_model_name(model, rep)
        rep.check_fits(model, rep.block)
    if together and len({rep.block for rep in reps.values()}) != len(reps):
        raise ValueError("together=True splices all layers at once, so each must replace a different block")
    return reps


def _layer_parts(model: Any, reps: Mapping[str, Any], jacobian_tokens: int, directions: int | None):
    """Each layer's parts, fed its runs (:class:`_LayerRun`): (reconstruction, usage, Jacobian cosine).
    One generator draws the Jacobian's random directions for all layers in turn."""
    generator = torch.Generator().manual_seed(0)
    return {
        name: (
            _Reconstruction(),
            _Usage(rep.layer.cfg.d_sae),
            _JacobianCos(model, jacobian_tokens, directions, generator),
        )
        for name, rep in reps.items()
    }


@dataclass(frozen=True)
class _Plan:
    """What the clean forward records: the replaced ``blocks``, those whose layer reads the residual
    before ln2 (``resid``) or writes the MLP module's output (``module_out``), and the FVU ``targets``,
    (block, capture key) of what each layer replaces plus every block's ``hook_mlp_out`` ("out": also
    mean-ablation's mean); CE and KL count the predictions at positions ``first``.., FVU and the usage
    the activations at positions ``skip``.. (``first``, at least 1 where the model prepends BOS, and at
    least where every layer starts replacing); ``keep``: per block, the positions where the MLP's own
    output stays in its ablations (the latest first position of its layers: ``hooks.first_position``)."""

    blocks: list[int]
    resid: list[int]
    module_out: list[int]
    targets: list[tuple[int, str]]
    first: int
    skip: int
    keep: dict[int, int]

    @classmethod
    def of(cls, model: Any, reps: Mapping[str, Any], skip_first_position: bool | None, first: int) -> _Plan:
        blocks = sorted({rep.block for rep in reps.values()})
        targets = {(b, "out") for b in blocks} | {
            (r.block, hooks.output_key(r.writes)) for r in reps.values()
        }
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"skip_positions={first!r}: give a number of positions, 0 or more")
        bos = model.cfg.default_prepend_bos if skip_first_position is None else skip_first_position
        keep = {b: max(r.first for r in reps.values() if r.block == b) for b in blocks}
        return cls(
            blocks=blocks,
            resid=hooks.resid_blocks(list(reps.values())),
            module_out=sorted({rep.block for rep in reps.values() if rep.writes == "mlp"}),
            targets=sorted(targets),
            first=first,
            skip=max(int(bos), first, *keep.values()),
            keep=keep,
        )


@dataclass
class _Batch:
    """One held-out batch after its clean forward: ``io``, ``hooks.capture_mlp_io``'s record of each
    replaced block; ``resid``, the residual stream entering each; ``target``, the tokens predicted at
    positions ``first``..; ``clean``, the clean logits there and their log-normaliser (what KL needs)."""

    io: dict[int, dict[str, torch.Tensor]]
    resid: dict[int, torch.Tensor]
    target: torch.Tensor
    clean: tuple[torch.Tensor, torch.Tensor]


def _clean_pass(model: Any, tokens: torch.Tensor, plan: _Plan, scorer: _VocabScorer) -> _Batch:
    """The clean forward of one batch, recording what every part reads (:class:`_Batch`)."""
    first = plan.first
    if tokens.shape[1] - 1 <= first:
        raise ValueError(
            f"skip_positions={first} leaves no prediction in rows of {tokens.shape[1]} tokens: "
            "skip fewer positions or evaluate longer rows"
        )
    names = {hook_names.resid_pre_hook(b): b for b in plan.blocks}
    with hooks.capture_mlp_io(model, plan.blocks, resid=plan.resid, module_out=plan.module_out) as io:
        logits, cache = model.run_with_cache(tokens, names_filter=list(names))
    clean = logits[:, first:-1]
    return _Batch(
        io=io,
        resid={b: cache[name] for name, b in names.items()},
        target=tokens[:, first + 1 :].to(logits.device),
        clean=(clean, scorer.log_normaliser(clean)),
    )


@dataclass
class _LayerRun:
    """One layer (``rep``: ``hooks.replacement``) on one batch's clean input: ``x``, what it reads; ``y``,
    what it replaces; ``out`` (in ``y``'s dtype), ``values`` and ``indices``, its output and codes. All
    [batch, positions, ...]; :meth:`kept` gives them at the positions counted (``skip``..)."""

    rep: Any
    x: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    skip: int

    @classmethod
    def of(cls, rep: Any, io: dict[int, dict[str, torch.Tensor]], skip: int) -> _LayerRun:
        x = hooks.layer_input(io, rep)
        y = io[rep.block][hooks.output_key(rep.writes)]
        out, values, indices = rep.forward_sparse(x)
        return cls(rep, x, y, out.to(y.dtype), values, indices, skip)

    @property
    def block(self) -> int:
        return self.rep.block

    def kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, out, values, indices) at positions ``skip``.."""
        s = self.skip
        return self.x[:, s:], self.y[:, s:], self.out[:, s:], self.values[:, s:], self.indices[:, s:]


class _Spliced:
    """The next-token CE of the clean model and of each variant run from its block on (a layer spliced
    alone, a block's ``hook_mlp_out`` zero- or mean-ablated, all layers together), KL(clean ‖ variant),
    and each layer's per-batch ΔCE and KL (their standard errors), over the predictions at positions
    ``first``.. Variants are labelled "splice:NAME", "zero:BLOCK", "mean:BLOCK", "together". A layer's
    splice keeps the MLP's output before its first position; an ablation, before ``keep[block]``."""

    def __init__(self, model: Any, blocks: Sequence[int], first: int, keep: Mapping[int, int]):
        self.model, self.blocks, self.first, self.keep = model, list(blocks), first, dict(keep)
        self.scorer = _VocabScorer()
        self.ce: dict[str, float] = {}  # Σ CE per label ("clean" too)
        self.kl: dict[str, float] = {}  # Σ KL(clean ‖ variant) per label
        self.per_batch: dict[str, list[tuple[float, float]]] = {}  # layer name -> (ΔCE, KL) per batch
        self.kept: list[tuple[dict[int, torch.Tensor], torch.Tensor]] = []  # for the mean-ablation pass
        self.n_pred = 0
        self._clean_sum = 0.0  # this batch's clean CE

    def clean(self, batch: _Batch) -> None:
        self.n_pred += batch.target.numel()
        self._clean_sum = self.scorer.ce(batch.clean[0], batch.target, batch.clean[1])
        _add(self.ce, "clean", self._clean_sum)

    def score(
        self,
        label: str,
        logits: torch.Tensor,
        target: torch.Tensor,
        clean: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[float, float]:
        """Add a variant's CE (and, given the clean (logits, log-normaliser), its KL) over the predictions
        at positions ``first``..; return this batch's (CE sum, KL sum)."""
        ce, kl = self.scorer.ce_kl(logits[:, self.first : -1], target, clean)
        _add(self.ce, label, ce)
        if clean is not None:
            _add(self.kl, label, kl)
        return ce, kl

    def splice(self, name: str, run: _LayerRun, batch: _Batch) -> None:
        logits = _run_from(
            self.model, batch.resid, run.block, {run.block: run.out}, run.rep.writes, run.rep.first
        )
        ce, kl = self.score(f"splice:{name}", logits, batch.target, batch.clean)
        n = batch.target.numel()
        self.per_batch.setdefault(name, []).append(((ce - self._clean_sum) / n, kl / n))

    def zero_ablation(self, batch: _Batch) -> None:
        """Each block's ``hook_mlp_out`` zeroed; keeps the batch's residuals for :meth:`mean_ablation`."""
        self.kept.append(({b: r.cpu() for b, r in batch.resid.items()}, batch.target.cpu()))
        for block in self.blocks:
            zero = torch.zeros_like(batch.io[block]["out"])
            logits = _run_from(self.model, batch.resid, block, {block: zero}, keep=self.keep[block])
            self.score(f"zero:{block}", logits, batch.target)

    def together(self, layers: Sequence[Any], batch: _Batch) -> None:
        start = self.blocks[0]
        with hooks.splice(self.model, *layers):
            logits = self.model(batch.resid[start], start_at_layer=start)
        ce, kl = self.score("together", logits, batch.target, batch.clean)
        n = batch.target.numel()
        self.per_batch.setdefault("*together", []).append(((ce - self._clean_sum) / n, kl / n))

    def mean_ablation(self, means: Mapping[int, torch.Tensor]) -> None:
        """Each block's ``hook_mlp_out`` set to its mean over the held-out tokens, from the kept residuals."""
        with torch.inference_mode():
            for resid, target in self.kept:
                for block in self.blocks:
                    r = resid[block].to(self.model.cfg.device)
                    mean = means[block].to(r.dtype).expand_as(r)
                    logits = _run_from(self.model, {block: r}, block, {block: mean}, keep=self.keep[block])
                    logits = logits[:, self.first : -1]
                    _add(self.ce, f"mean:{block}", self.scorer.ce(logits, target.to(logits.device)))

    def columns(self, label: str, blocks: Sequence[int], baselines: bool) -> dict[str, Any]:
        """A variant's CE columns; for a variant of one block with ``baselines``, its ablations' too."""
        ce_clean, ce = self.ce["clean"] / self.n_pred, self.ce[label] / self.n_pred
        row = {"ce_clean": ce_clean, "ce_spliced": ce, "delta_ce": ce - ce_clean,
               "kl": self.kl[label] / self.n_pred, "tokens": self.n_pred}  # fmt: skip
        if len(blocks) == 1 and baselines:
            for kind in ("zero", "mean"):
                ablated = self.ce[f"{kind}:{blocks[0]}"] / self.n_pred
                row[f"ce_{kind}_ablation"] = ablated
                row[f"ce_recovered_{kind}"] = (
                    (ablated - ce) / (ablated - ce_clean) if ablated != ce_clean else float("nan")
                )
        return row

    def standard_errors(self, name: str) -> dict[str, float]:
        return _standard_errors(self.per_batch[name])


class _OutputMoments:
    """Σ y and Σ‖y‖² (float64) over the counted tokens of each target (block, capture key): FVU's
    total sum of squares Σ‖y − ȳ‖², and the mean of ``hook_mlp_out`` ("out") for mean-ablation."""

    def __init__(self, targets: Sequence[tuple[int, str]], skip: int):
        self.targets, self.skip = list(targets), skip
        self.sum: dict[tuple[int, str], torch.Tensor] = {}
        self.sq: dict[tuple[int, str], float] = {}
        self.n = 0  # tokens counted per target

    def update(self, io: dict[int, dict[str, torch.Tensor]]) -> None:
        for at in self.targets:
            block, key = at
            y = io[block][key][:, self.skip :].double()
            self.sum[at] = self.sum.get(at, 0) + y.sum((0, 1))
            self.sq[at] = self.sq.get(at, 0.0) + float(y.pow(2).sum())
        self.n += y.shape[:2].numel()

    def mean(self, block: int) -> torch.Tensor:
        return (self.sum[block, "out"] / self.n).float()

    def sst(self, at: tuple[int, str]) -> float:
        """Σ‖y − ȳ‖² of target ``at``."""
        return self.sq[at] - self.n * float(self.sum[at].pow(2).sum()) / self.n**2


class _Reconstruction:
    """A layer's squared error against what it replaces, Σ‖ŷ − y‖², of its output and of the output
    rebuilt from each token's largest |code| alone (top-1; NaN for a layer that cannot rebuild it)."""

    def __init__(self) -> None:
        self.sse = 0.0
        self.sse_top1: float | None = None

    def update(self, run: _LayerRun) -> None:
        x, y, out, values, indices = run.kept()
        self.sse += float((out - y).double().pow(2).sum())
        top = values.abs().argmax(-1, keepdim=True)
        top1 = run.rep.output_from_codes(x, values.gather(-1, top), indices.gather(-1, top))
        if top1 is not None:  # None: a layer from elsewhere whose output is not decode + skip
            sse = float((top1.to(y.dtype) - y).double().pow(2).sum())
            self.sse_top1 = (0.0 if self.sse_top1 is None else self.sse_top1) + sse

    def result(self, sst: float) -> dict[str, float]:
        """FVU, top-1 FVU and explained variance given the target's Σ‖y − ȳ‖²."""
        fvu = self.sse / max(sst, 1e-12)
        top1 = float("nan") if self.sse_top1 is None else self.sse_top1
        return {"fvu": fvu, "top1_fvu": top1 / max(sst, 1e-12), "explained_variance": 1 - fvu}


class _Usage:
    """How a layer's units are used on the counted tokens (see the module docstring): ``l0`` and
    ``l0_positive`` per token, ``effective_units``, ``always_on`` (active on more than half the tokens),
    ``dead_fraction`` (never active: ``mxd_lens.firing``)."""

    def __init__(self, d_sae: int):
        self.l0 = self.l0_positive = self.effective = self.tokens = 0.0
        self.active = torch.zeros(d_sae, dtype=torch.long)  # tokens each unit is active on
        self.firing = FiringTracker(d_sae)

    def update(self, run: _LayerRun) -> None:
        values, indices = run.kept()[3:]
        active = values != 0
        self.l0 += float(active.sum())
        self.l0_positive += float((values > 0).sum())
        self.tokens += float(values.shape[0] * values.shape[1])
        self.effective += float(_effective_units(values).sum())
        self.active += torch.bincount(indices[active].reshape(-1).cpu(), minlength=self.active.numel())
        self.firing.update(values.cpu(), indices.cpu())

    def result(self) -> dict[str, Any]:
        n = self.tokens
        return {
            "l0": self.l0 / n,
            "l0_positive": self.l0_positive / n,
            "always_on": int((self.active > 0.5 * n).sum()),
            "effective_units": self.effective / n,
            "dead_fraction": self.firing.dead_fraction(),  # silent on these tokens (mxd_lens.firing)
        }


class _JacobianCos:
    """The mean cosine of a layer's input→output Jacobian with its block's (:func:`_jacobian`) over the
    first ``tokens`` counted tokens; ``directions`` random ones per token from ``generator`` (None: exact)."""

    def __init__(self, model: Any, tokens: int, directions: int | None, generator: torch.Generator):
        self.model, self.tokens, self.directions, self.generator = model, tokens, directions, generator
        self.cos: list[torch.Tensor] = []

    def update(self, run: _LayerRun) -> None:
        done = sum(t.numel() for t in self.cos)
        if done < self.tokens:
            x = run.kept()[0]
            xs = x.reshape(-1, x.shape[-1])[: self.tokens - done]
            self.cos.append(_jacobian(self.model, run.rep, run.block, xs, self.directions, self.generator))

    def result(self) -> dict[str, float | None]:
        return {"jacobian_cos": float(torch.cat(self.cos).mean()) if self.cos else None}


_COLUMNS = ("name", "architecture", "block", "k", "d_sae", "params", "ce_clean", "ce_spliced", "delta_ce", "kl",
            "tokens", "ce_zero_ablation", "ce_recovered_zero", "ce_mean_ablation", "ce_recovered_mean", "fvu",
            "l0", "l0_positive", "always_on", "effective_units", "top1_fvu", "dead_fraction",
            "train_dead_fraction", "jacobian_cos", "delta_ce_se", "kl_se", "explained_variance")  # fmt: skip
"""A layer's row, in order (``skip_positions`` follows)."""


def _layer_row(name: str, rep: Any, spliced: _Spliced, moments: _OutputMoments, parts, baselines: bool):
    """A layer's row: what it is, then every part's columns (in the order of :data:`_COLUMNS`)."""
    reconstruction, usage, jacobian = parts
    sst = moments.sst((rep.block, hooks.output_key(rep.writes)))
    train_metrics = TrainingRecord.of(rep.layer).metrics or {}
    columns = {
        **_identity(name, rep.layer, rep.block, rep.k),
        **spliced.columns(f"splice:{name}", [rep.block], baselines),
        **reconstruction.result(sst),
        **usage.result(),
        "train_dead_fraction": train_metrics.get("dead_fraction"),
        **jacobian.result(),
        **spliced.standard_errors(name),
    }
    return {key: columns[key] for key in _COLUMNS if key in columns}


def _identity(name: str, layer: Any, block: Any, k: int | None, names: Sequence[str] = ()) -> dict[str, Any]:
    """A row's first columns: its name, the layer's architecture (for all layers together: their names
    joined by '+'), block, k, width and parameter count (None together)."""
    return {
        "name": name,
        "architecture": layer.cfg.architecture() if layer is not None else "+".join(names),
        "block": block,
        "k": k,
        "d_sae": layer.cfg.d_sae if layer is not None else None,
        "params": sum(p.numel() for p in layer.parameters()) if layer is not None else None,
    }


def _warn_if_untrained(layer: Any, where: Any) -> None:
    """Warn, naming ``where``, when ``layer`` is a BatchTopK transcoder whose threshold is still 0 (as
    built, before any training step): at inference every positive pre-activation fires."""
    from mxd_lens.layers.batchtopk import BatchTopKTranscoder

    if isinstance(layer, BatchTopKTranscoder) and not bool((layer.threshold > 0).any()):
        warnings.warn(
            f"{where}: its BatchTopK threshold is 0, as before any training step, so every positive "
            "pre-activation fires (a plain ReLU, L0 far above K): it is evaluated as an untrained layer",
            stacklevel=4,
        )


_CHUNK_ELEMENTS = 1 << 22
"""Most elements in one block of the vocabulary-sized work (16 MiB in float32: 16 tokens of a 262,144-token
vocabulary). With Gemma 3's vocabulary a batch's log-probabilities are a gigabyte per [batch, context,
vocab] tensor, and glibc hands each freed one back to the kernel, so computing them whole spent half the
evaluation in page faults; blocks this size stay in the scratch buffers allocated once per evaluation."""


def _token_chunks(
    n_batch: int, n_pos: int, vocab: int, budget: int | None = None
) -> list[tuple[slice, slice]]:
    """(rows, positions) index pairs covering a [n_batch, n_pos] grid of tokens, each block at most
    ``budget`` (default ``_CHUNK_ELEMENTS``) tokens × ``vocab`` elements but at least one token: whole rows
    together when a row fits, else pieces of one row (the last one ragged). Blocks are views of
    ``logits[:, first:-1]`` without copying it, whatever ``first``."""
    per = max(1, (_CHUNK_ELEMENTS if budget is None else budget) // max(1, vocab))  # tokens per block
    if per >= n_pos:
        rows = per // n_pos
        return [(slice(b, min(b + rows, n_batch)), slice(0, n_pos)) for b in range(0, n_batch, rows)]
    return [
        (slice(b, b + 1), slice(p, min(p + per, n_pos))) for b in range(n_batch) for p in range(0, n_pos, per)
    ]


class _VocabScorer:
    """Next-token CE and KL(clean ‖ variant) of [batch, positions, vocab] logits, computed in blocks of
    tokens (``_token_chunks``) through two scratch buffers kept for the whole evaluation: no
    log-probability tensor of a whole batch is ever made, only the logits the model returns.

    Per token, with lse = logsumexp(z) (log-softmax's normaliser): CE = lse − z[target], and since the
    clean probabilities p = exp(z_clean − lse_clean) sum to 1, KL = Σ p·(log p − log q) =
    Σ p·(z_clean − z) + lse − lse_clean: the same quantity as the dense Σ p·(log p − log q), differences
    taken before products as there. Float32 as before; each block's sums are added in Python floats."""

    def __init__(self) -> None:
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, shape: torch.Size, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        n = shape.numel()
        if self._scratch is None or self._scratch[0].numel() < n or self._scratch[0].device != device:
            size = max(n, _CHUNK_ELEMENTS)  # every block fits (pages are touched only where used)
            first, second = (torch.empty(size, dtype=torch.float32, device=device) for _ in range(2))
            self._scratch = (first, second)
        return self._scratch[0][:n].view(shape), self._scratch[1][:n].view(shape)

    def _lse(self, z: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """logsumexp over the last dimension, through ``buf`` (z's shape) instead of a fresh temporary."""
        top = z.amax(-1, keepdim=True)
        torch.sub(z, top, out=buf)
        return buf.exp_().sum(-1).log_().add_(top.squeeze(-1))

    def log_normaliser(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-token logsumexp of [batch, positions, vocab] logits, as a [batch, positions] float32 tensor."""
        out = torch.empty(logits.shape[:2], device=logits.device)
        for rows, pos in _token_chunks(*logits.shape):
            z = logits[rows, pos].float()
            out[rows, pos] = self._lse(z, self._buffers(z.shape, z.device)[0])
        return out

    def ce(self, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor | None = None) -> float:
        """Σ −log softmax(logits)[target] over every token (``lse``: the logits' log-normaliser, if known)."""
        return self.ce_kl(logits, target, None, lse)[0]

    def ce_kl(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        clean: tuple[torch.Tensor, torch.Tensor] | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[float, float]:
        """(Σ CE, Σ KL(clean ‖ these)) over every token of ``logits`` [batch, positions, vocab] with
        ``target`` [batch, positions]; KL 0.0 without ``clean`` = (clean logits, their log-normaliser)."""
        ce = kl = 0.0
        for rows, pos in _token_chunks(*logits.shape):
            z = logits[rows, pos].float()
            buf, other = self._buffers(z.shape, z.device)
            z_lse = self._lse(z, buf) if lse is None else lse[rows, pos]
            ce += float((z_lse - z.gather(-1, target[rows, pos].unsqueeze(-1)).squeeze(-1)).sum())
            if clean is not None:
                zc, clean_lse = clean[0][rows, pos].float(), clean[1][rows, pos]
                p = torch.sub(zc, clean_lse.unsqueeze(-1), out=buf).exp_()
                diff = torch.sub(zc, z, out=other)
                kl += float(torch.dot(p.view(-1), diff.view(-1))) + float((z_lse - clean_lse).sum())
        return ce, kl


def _standard_errors(per_batch: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Standard errors of ΔCE and KL over the evaluation's batches (equal-sized): sd / sqrt(batches);
    NaN with one batch."""
    import math

    out = {}
    for key, values in zip(("delta_ce_se", "kl_se"), zip(*per_batch, strict=True), strict=True):
        n = len(values)
        mean = sum(values) / n
        out[key] = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return out


def _effective_units(values: torch.Tensor) -> torch.Tensor:
    """exp(entropy of |a| / Σ|a|) per token (0 where every code is 0)."""
    weights = values.abs().double()
    total = weights.sum(-1, keepdim=True)
    p = weights / total.clamp_min(1e-300)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return torch.where(total[..., 0] > 0, entropy.exp(), torch.zeros_like(entropy))


def _jacobian(model, rep, block: int, x: torch.Tensor, directions, generator) -> torch.Tensor:
    """The per-token Jacobian cosine of a layer (``rep``: ``hooks.replacement(layer)``) against block
    ``block``'s MLP on inputs ``x`` [T, d_in] (what the layer reads: for a layer reading the residual
    before ln2, against ln2 then the MLP; to what it writes: for a layer writing hook_mlp_out of a block
    that normalises the MLP output, the MLP then that norm)."""
    layer, host = rep.layer, hooks.host_map(model, block, rep.reads, rep.writes)
    d_out = layer.cfg.d_out
    with torch.inference_mode(False):
        x = x.clone()  # out of inference mode, so autograd can record
        return jacobian_cosine(
            lambda v: rep.layer_output(v.to(layer.dtype)),
            host,
            x,
            None if directions is None or directions >= d_out else directions,
            generator,
        ).cpu()


def _run_from(
    model,
    resid: Mapping[int, torch.Tensor],
    block: int,
    outputs: Mapping[int, torch.Tensor],
    writes: hook_names.Writes = "hook_mlp_out",
    keep: int = 0,
):
    """Logits of the model run from ``block``'s residual stream on, with each given block's output at
    ``writes`` (``hook_mlp_out``, or the MLP module's, which the block's post-MLP norm follows) replaced
    by the given tensor (a layer's output on the clean input, zeros, the mean) from position ``keep`` on
    (before it the block's own output stays: the clean one, as the run starts from the clean residual)."""

    def replace(value: torch.Tensor):
        return lambda out: hooks.keep_first(out, value.to(out.dtype).expand_as(out), keep)

    with hooks.replacing_outputs(model, {(b, writes): replace(v) for b, v in outputs.items()}):
        return model(resid[block], start_at_layer=block)


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def check_disjoint(
    train_info: TextRecord | Mapping[str, Any] | None, eval_info: TextRecord | Mapping[str, Any]
) -> None:
    """Refuse evaluation text that may overlap a layer's training text.

    Both are :class:`~mxd_lens.records.TextRecord` values (or the JSON objects that store them: the
    trainer's in ``cfg.metadata.training["data"]``): source, side of the split ("train" | "eval"),
    ``eval_fraction``, ``split_seed`` and, where recorded, the digests of the files' content. The
    'eval' side of the split the layer trained on (same eval_fraction and split_seed) is always fine:
    the split is decided per document, so it shares no document with the training side of any text.
    Otherwise the texts must not overlap: when both record digests, no file content may be shared (the
    same file under another name or spelling counts); without digests, the sources' resolved paths
    must differ and neither folder may hold the other. A layer with no record gets a loud warning.
    """
    train, held = (
        i if isinstance(i, TextRecord) else TextRecord.from_dict(i) for i in (train_info, eval_info)
    )
    if not train:
        warnings.warn(
            "the layer records no training text, so overlap with the evaluation text cannot be ruled out",
            stacklevel=2,
        )
        return
    same_split = (train.eval_fraction, train.split_seed) == (held.eval_fraction, held.split_seed)
    if same_split and train.split == "train" and held.split == "eval":
        return
    if train.digests is not None and held.digests is not None:
        shared = set(train.digests.values()) & set(held.digests.values())
        if not shared:
            if _paths_overlap(train.text, held.text):
                warnings.warn(
                    f"the evaluation text {held.text!r} has the path of the layer's training "
                    "text but other content (edited since?); overlap of documents cannot be ruled out",
                    stacklevel=2,
                )
            return
        names = sorted(name for name, digest in held.digests.items() if digest in shared)
        overlap = f"holds the same content as the training text ({', '.join(names[:3])}"
        overlap += f" and {len(names) - 3} more)" if len(names) > 3 else ")"
    elif _paths_overlap(train.text, held.text):
        overlap = "is (or holds, or is inside) the training text"
    else:
        return
    raise ValueError(
        f"evaluation text {held.describe()} overlaps the training text {train.describe()}: it "
        f"{overlap}; evaluate on the 'eval' split of the same source with the same eval_fraction and "
        "split_seed, or on other text"
    )


def _paths_overlap(train_text: Any, eval_text: Any) -> bool:
    """Same source by name, by resolved path, or one a folder holding the other."""
    if train_text is None or eval_text is None:
        return False
    if str(train_text) == str(eval_text):
        return True
    from mxd_lens.data import resolve_text

    a, b = (resolve_text(str(t)).resolve() for t in (train_text, eval_text))
    return a == b or (a.is_dir() and b.is_relative_to(a)) or (b.is_dir() and a.is_relative_to(b))


def held_out_batches(
    model: Any,
    text: str | Path,
    split: str = "eval",
    eval_tokens: int = 25_600,
    context_size: int = 128,
    rows_per_forward: int = 8,
    eval_fraction: float = 0.02,
    split_seed: int = 0,
) -> list[torch.Tensor]:
    """[rows_per_forward, context_size] token batches, ``eval_tokens`` in all, from the ``split`` side of
    ``text``'s document split ('all': every document); a warning when the text holds fewer."""
    import itertools
    import logging
    import math

    from mxd_lens import data

    rows = data.TokenRows.for_model(model, context_size)
    texts = data.iter_texts(text)
    if split != "all":
        texts = data.split_texts(texts, split, eval_fraction, split_seed)
    n_rows = max(1, math.ceil(eval_tokens / context_size))
    name = data.text_name(text) + ("" if split == "all" else f" (its {split} side)")
    held_out = list(itertools.islice(rows.rows(texts, name=name), n_rows))
    if len(held_out) < n_rows:
        logging.getLogger(__name__).warning(
            "the held-out text holds %s tokens, fewer than the %s asked",
            f"{len(held_out) * context_size:,}",
            f"{eval_tokens:,}",
        )
    return [
        torch.stack(held_out[i : i + rows_per_forward]) for i in range(0, len(held_out), rows_per_forward)
    ]


EVAL_METRICS = ("delta_ce", "kl", "fvu", "l0", "l0_positive", "always_on", "effective_units", "top1_fvu",
                "dead_fraction", "train_dead_fraction", "jacobian_cos", "ce_recovered_zero", "ce_recovered_mean",
                "ce_clean", "ce_spliced", "ce_zero_ablation", "ce_mean_ablation", "delta_ce_se", "kl_se",
                "tokens")  # fmt: skip

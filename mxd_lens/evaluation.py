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

``skip_positions = N`` leaves the first N positions of every row out of everything: CE and KL count the
predictions made at positions N and later (of tokens N + 1 on), FVU and the usage counts the activations
at positions N and later (and at least position 0 with BOS). For layers not trained there, e.g. Gemma
Scope 2's instruction-tuned transcoders, which skipped the first 4 positions; the layer still replaces
the MLP at every position, so later positions see its output there through attention.

Layers from elsewhere (SAELens transcoders, ``mxd_lens.foreign``) are measured the same way: their codes
are ``encode(x)``, their output SAELens's forward. One that reads ``blocks.L.hook_mlp_in`` (the residual
before ln2) is given that residual, and its Jacobian is compared with ln2 then the MLP, the map from the
same residual to the MLP's output. ``k`` is None for a layer without one; ``top1_fvu`` is NaN for a class
whose output cannot be rebuilt from chosen codes (its forward is not SAELens's transcoder forward).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from mxd_lens import hooks
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
    if isinstance(layers, Mapping):
        named = dict(layers)
        reps = {name: hooks.replacement(layer) for name, layer in named.items()}
    else:
        reps = {(rep := hooks.replacement(layer)).default_name: rep for layer in layers}
        named = {name: rep.layer for name, rep in reps.items()}
    if not named:
        raise ValueError("evaluate needs at least one layer")
    index = {name: rep.block for name, rep in reps.items()}
    for name, rep in reps.items():
        where = getattr(rep.layer, "mxd_lens_folder", None) or name  # its folder, when loaded from one
        check_finite(rep.layer, where)  # NaN weights would give NaN or absurd metrics
        _warn_if_untrained(rep.layer, where)
        hooks.check_block(model, index[name])
        hooks.check_model_name(model, rep)
        rep.check_fits(model, index[name])
    if together and len(set(index.values())) != len(index):
        raise ValueError("together=True splices all layers at once, so each must replace a different block")
    blocks = sorted(set(index.values()))
    resid_blocks = sorted({rep.block for rep in reps.values() if rep.reads == "resid"})
    module_blocks = sorted({rep.block for rep in reps.values() if rep.writes == "mlp"})
    # (block, capture key) of every FVU target; hook_mlp_out's ("out") also gives mean-ablation's mean
    fvu_targets = sorted(
        {(b, "out") for b in blocks} | {(r.block, hooks.output_key(r.writes)) for r in reps.values()}
    )
    if isinstance(skip_positions, bool) or not isinstance(skip_positions, int) or skip_positions < 0:
        raise ValueError(f"skip_positions={skip_positions!r}: give a number of positions, 0 or more")
    first = skip_positions
    skip = max(
        int(model.cfg.default_prepend_bos if skip_first_position is None else skip_first_position), first
    )
    resid_names = [f"blocks.{b}.hook_resid_pre" for b in blocks]

    sums: dict[str, float] = {}
    firing = {name: FiringTracker(layer.cfg.d_sae) for name, layer in named.items()}
    usage = {name: torch.zeros(layer.cfg.d_sae, dtype=torch.long) for name, layer in named.items()}
    jacobian: dict[str, list[torch.Tensor]] = {name: [] for name in named}
    per_batch: dict[str, list[tuple[float, float]]] = {name: [] for name in named}  # (ΔCE, KL) per batch
    generator = torch.Generator().manual_seed(0)
    y_sum: dict[tuple[int, str], torch.Tensor] = {}  # Σ y and Σ ||y||² per target (float64), FVU's variance
    y_sq: dict[tuple[int, str], float] = {}
    kept: list[tuple[dict[int, torch.Tensor], torch.Tensor]] = []  # residuals for the mean-ablation pass
    scorer = _VocabScorer()
    n_pred = n_tokens = 0
    for tokens in tqdm(batches, desc="evaluating", unit="batch", disable=not progress):
        if tokens.shape[1] - 1 <= first:
            raise ValueError(
                f"skip_positions={first} leaves no prediction in rows of {tokens.shape[1]} tokens: "
                "skip fewer positions or evaluate longer rows"
            )
        with torch.inference_mode():
            with hooks.capture_mlp_io(model, blocks, resid=resid_blocks, module_out=module_blocks) as io:
                logits, cache = model.run_with_cache(tokens, names_filter=resid_names)
            resid = {b: cache[f"blocks.{b}.hook_resid_pre"] for b in blocks}
            target = tokens[:, first + 1 :].to(logits.device)
            n_pred += target.numel()
            # the clean logits and their per-token log-normaliser: all every variant's KL needs of them
            clean = (logits[:, first:-1], scorer.log_normaliser(logits[:, first:-1]))
            clean_sum = scorer.ce(clean[0], target, clean[1])
            _add(sums, "ce_clean", clean_sum)
            if baselines:
                kept.append(({b: r.cpu() for b, r in resid.items()}, target.cpu()))
            for target_at in fvu_targets:
                block, key = target_at
                y = io[block][key][:, skip:].double()
                y_sum[target_at] = y_sum.get(target_at, 0) + y.sum((0, 1))
                y_sq[target_at] = y_sq.get(target_at, 0.0) + float(y.pow(2).sum())
            n_tokens += io[blocks[0]]["out"][:, skip:].shape[:2].numel()

            for name, layer in named.items():
                block, rep = index[name], reps[name]
                x = io[block]["resid" if rep.reads == "resid" else "in"]
                y = io[block][hooks.output_key(rep.writes)]  # what the layer replaces
                out, values, idx = rep.forward_sparse(x)
                out = out.to(y.dtype)
                ce_sum, kl_sum = _score(
                    sums,
                    f"splice:{name}",
                    _run_from(model, resid, block, {block: out}, rep.writes),
                    target,
                    scorer,
                    clean,
                    first,
                )
                per_batch[name].append(((ce_sum - clean_sum) / target.numel(), kl_sum / target.numel()))
                out, values, idx = out[:, skip:], values[:, skip:], idx[:, skip:]
                x_kept, y_kept = x[:, skip:], y[:, skip:]
                _add(sums, f"sse:{name}", float((out - y_kept).double().pow(2).sum()))
                active = values != 0
                _add(sums, f"l0:{name}", float(active.sum()))
                _add(sums, f"l0_positive:{name}", float((values > 0).sum()))
                _add(sums, f"tokens:{name}", float(values.shape[0] * values.shape[1]))
                _add(sums, f"effective:{name}", float(_effective_units(values).sum()))
                top = values.abs().argmax(-1, keepdim=True)
                top1 = rep.output_from_codes(x_kept, values.gather(-1, top), idx.gather(-1, top))
                if top1 is not None:  # None: a layer from elsewhere whose output is not decode + skip
                    _add(sums, f"sse_top1:{name}", float((top1.to(y.dtype) - y_kept).double().pow(2).sum()))
                usage[name] += torch.bincount(idx[active].reshape(-1).cpu(), minlength=layer.cfg.d_sae)
                firing[name].update(values.cpu(), idx.cpu())
                done = sum(t.numel() for t in jacobian[name])
                if done < jacobian_tokens:
                    xs = x_kept.reshape(-1, x.shape[-1])[: jacobian_tokens - done]
                    jacobian[name].append(_jacobian(model, rep, block, xs, jacobian_directions, generator))
            if baselines:
                for block in blocks:
                    zero = torch.zeros_like(io[block]["out"])
                    _score(
                        sums,
                        f"zero:{block}",
                        _run_from(model, resid, block, {block: zero}),
                        target,
                        scorer,
                        None,
                        first,
                    )
            if together:
                with hooks.splice(model, *named.values()):
                    _score(
                        sums,
                        "together:None",
                        model(resid[blocks[0]], start_at_layer=blocks[0]),
                        target,
                        scorer,
                        clean,
                        first,
                    )
    if n_pred == 0:
        raise ValueError("evaluate got no token batches")

    means = {block: (y_sum[block, "out"] / n_tokens).float() for block in blocks}
    if baselines:  # mean-ablation, from the kept residuals, now that the mean is known
        with torch.inference_mode():
            for resid, target in kept:
                for block in blocks:
                    r = resid[block].to(model.cfg.device)
                    mean = means[block].to(r.dtype).expand_as(r)
                    logits = _run_from(model, {block: r}, block, {block: mean})[:, first:-1]
                    _add(sums, f"ce:mean:{block}", scorer.ce(logits, target.to(logits.device)))

    ce_clean = sums["ce_clean"] / n_pred
    rows = []
    for name, layer in named.items():
        block = index[name]
        at = (block, hooks.output_key(reps[name].writes))
        sst = y_sq[at] - n_tokens * float(y_sum[at].pow(2).sum()) / n_tokens**2  # Σ||y - ȳ||²
        row = _row(
            name, layer, block, sums, n_pred, ce_clean, f"splice:{name}", [block], baselines, k=reps[name].k
        )
        n = sums[f"tokens:{name}"]
        train_metrics = TrainingRecord.of(layer).metrics or {}
        row.update(
            fvu=sums[f"sse:{name}"] / max(sst, 1e-12),
            l0=sums[f"l0:{name}"] / n,
            l0_positive=sums[f"l0_positive:{name}"] / n,
            always_on=int((usage[name] > 0.5 * n).sum()),
            effective_units=sums[f"effective:{name}"] / n,
            top1_fvu=sums.get(f"sse_top1:{name}", float("nan")) / max(sst, 1e-12),
            dead_fraction=firing[name].dead_fraction(),  # silent on these tokens (mxd_lens.firing)
            train_dead_fraction=train_metrics.get("dead_fraction"),
            jacobian_cos=float(torch.cat(jacobian[name]).mean()) if jacobian[name] else None,
            **_standard_errors(per_batch[name]),
        )
        row["explained_variance"] = 1 - row["fvu"]
        rows.append(row)
    if together:
        rows.append(
            _row(
                "together",
                None,
                None,
                sums,
                n_pred,
                ce_clean,
                "together:None",
                blocks,
                baselines,
                list(named),
            )
        )
    for row in rows:
        row["skip_positions"] = first
    return rows


def _warn_if_untrained(layer: Any, where: Any) -> None:
    """Warn, naming ``where``, when ``layer`` is a BatchTopK transcoder whose threshold is still 0 (as
    built, before any training step): at inference every positive pre-activation fires."""
    from mxd_lens.layers.batchtopk import BatchTopKTranscoder

    if isinstance(layer, BatchTopKTranscoder) and not bool((layer.threshold > 0).any()):
        warnings.warn(
            f"{where}: its BatchTopK threshold is 0, as before any training step, so every positive "
            "pre-activation fires (a plain ReLU, L0 far above K): it is evaluated as an untrained layer",
            stacklevel=3,
        )


def _row(
    name, layer, block, sums, n_pred, ce_clean, label, blocks, baselines, names=None, k=None
) -> dict[str, Any]:
    ce = sums[f"ce:{label}"] / n_pred
    row: dict[str, Any] = {
        "name": name,
        "architecture": layer.cfg.architecture() if layer is not None else "+".join(names or []),
        "block": block if block is not None else ",".join(map(str, blocks)),
        "k": k,
        "d_sae": layer.cfg.d_sae if layer is not None else None,
        "params": sum(p.numel() for p in layer.parameters()) if layer is not None else None,
        "ce_clean": ce_clean,
        "ce_spliced": ce,
        "delta_ce": ce - ce_clean,
        "kl": sums[f"kl:{label}"] / n_pred,
        "tokens": n_pred,
    }
    if len(blocks) == 1 and baselines:
        for kind in ("zero", "mean"):
            ablated = sums[f"ce:{kind}:{blocks[0]}"] / n_pred
            row[f"ce_{kind}_ablation"] = ablated
            row[f"ce_recovered_{kind}"] = (
                (ablated - ce) / (ablated - ce_clean) if ablated != ce_clean else float("nan")
            )
    return row


def _score(
    sums,
    label: str,
    logits: torch.Tensor,
    target: torch.Tensor,
    scorer: _VocabScorer,
    clean: tuple[torch.Tensor, torch.Tensor] | None = None,
    first: int = 0,
) -> tuple[float, float]:
    """Add a variant's CE (and, given the clean (logits, log-normaliser), its KL from the clean model)
    to ``sums``, over the predictions made at positions ``first`` and later; return this batch's (CE sum,
    KL sum)."""
    ce, kl = scorer.ce_kl(logits[:, first:-1], target, clean)
    _add(sums, f"ce:{label}", ce)
    if clean is not None:
        _add(sums, f"kl:{label}", kl)
    return ce, kl


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
    writes: hooks.Writes = "hook_mlp_out",
):
    """Logits of the model run from ``block``'s residual stream on, with each given block's output at
    ``writes`` (``hook_mlp_out``, or the MLP module's, which the block's post-MLP norm follows) replaced
    by the given tensor (a layer's output on the clean input, zeros, the mean)."""

    def replace(value: torch.Tensor):
        return lambda out: value.to(out.dtype).expand_as(out)

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

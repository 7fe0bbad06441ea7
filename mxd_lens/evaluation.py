"""How much does a replacement hurt the model? CE/KL splicing with ablation baselines, FVU, L0, dead units.

Every spliced number replaces ``hook_mlp_out`` (never the input hook: SAELens's ``run_evals`` and the
reference code splice transcoders at the input, which is wrong whenever input and output differ). A
pass over the held-out batches does, per batch: one clean forward (keeping the residual stream before
the first replaced block), then per variant a forward *from that block on* (``start_at_layer``):
zero-ablation and mean-ablation of each block's MLP output, each layer spliced alone, and optionally all
of them at once. The mean for mean-ablation is the MLP output's mean over the same held-out tokens
(a first, cheap pass that stops after the last block needed).

Definitions (all per predicted token, averaged over the held-out tokens):
- CE: next-token cross-entropy in nats; ΔCE = CE(spliced) − CE(clean).
- CE recovered = (CE(ablated) − CE(spliced)) / (CE(ablated) − CE(clean)), for zero- and mean-ablation.
- KL = KL(clean ‖ spliced) of the next-token distributions.
- FVU = Σ‖ŷ − y‖² / Σ‖y − ȳ‖² against the true MLP output y on the clean input; explained variance
  = 1 − FVU. L0 = mean active codes per token. Dead fraction = units never active on these tokens
  (``mxd_lens.firing`` with the window = all held-out tokens; training uses the same definition with
  its own window).
  (When the model prepends BOS, position 0 is left out of FVU/L0/dead, as in training.)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mxd_lens import hooks
from mxd_lens.firing import FiringTracker
from mxd_lens.layers.base import MLPReplacement


def evaluate(
    model: Any,
    layers: Mapping[str, MLPReplacement] | Sequence[MLPReplacement],
    batches: Iterable[torch.Tensor],
    *,
    together: bool = False,
    skip_first_position: bool | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row of metrics per layer (and one for all layers spliced together when ``together``).

    ``batches`` are [batch, context] token tensors from *held-out* text; iterate it twice (a list,
    or anything re-iterable). Turn the result into a table with ``pandas.DataFrame(rows)``.
    """
    named = dict(layers) if isinstance(layers, Mapping) else {_default_name(layer): layer for layer in layers}
    if not named:
        raise ValueError("evaluate needs at least one layer")
    index = {name: hooks.layer_index(layer) for name, layer in named.items()}
    for name, layer in named.items():
        hooks.check_fits(model, layer, index[name])
    if together and len(set(index.values())) != len(index):
        raise ValueError("together=True splices all layers at once, so each must replace a different block")
    blocks = sorted(set(index.values()))
    start = blocks[0]
    skip = int(model.cfg.default_prepend_bos if skip_first_position is None else skip_first_position)
    batches = list(batches)  # iterated twice: the mean pass, then the evaluation
    if not batches:
        raise ValueError("evaluate got no token batches")

    means = _mlp_output_means(model, blocks, batches, skip)
    sums: dict[str, float] = {}
    firing = {name: FiringTracker(layer.cfg.d_sae) for name, layer in named.items()}
    variants = (
        [("zero", b) for b in blocks] + [("mean", b) for b in blocks] + [("splice", name) for name in named]
    )
    if together:
        variants.append(("together", None))
    n_pred = 0
    for tokens in tqdm(batches, desc="evaluating", unit="batch", disable=not progress):
        with torch.inference_mode():
            with hooks.capture_mlp_io(model, blocks) as io:
                logits, cache = model.run_with_cache(tokens, names_filter=f"blocks.{start}.hook_resid_pre")
            resid = cache[f"blocks.{start}.hook_resid_pre"]
            clean_logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
            clean_p = clean_logp.exp()  # once per batch, shared by every variant's KL
            target = tokens[:, 1:].to(clean_logp.device)
            n_pred += target.numel()
            _add(sums, "ce_clean", _ce_sum(clean_logp, target))
            for kind, key in variants:
                logp = F.log_softmax(
                    _run_variant(model, kind, key, named, means, resid, start)[:, :-1].float(), dim=-1
                )
                label = f"{kind}:{key}"
                _add(sums, f"ce:{label}", _ce_sum(logp, target))
                if kind in ("splice", "together"):
                    _add(sums, f"kl:{label}", float((clean_p * (clean_logp - logp)).sum()))
            for name, layer in named.items():
                x, y = (io[index[name]][k][:, skip:] for k in ("in", "out"))
                out, values, idx = layer.forward_sparse(x)
                _add(sums, f"sse:{name}", float((out - y).pow(2).sum()))
                _add(sums, f"sst:{name}", float((y - means[index[name]]).pow(2).sum()))
                _add(sums, f"l0:{name}", float((values > 0).sum()))
                _add(sums, f"tokens:{name}", float(values.shape[0] * values.shape[1]))
                firing[name].update(values.cpu(), idx.cpu())

    ce_clean = sums["ce_clean"] / n_pred
    rows = []
    for name, layer in named.items():
        block = index[name]
        row = _row(name, layer, block, sums, n_pred, ce_clean, f"splice:{name}", [block])
        row.update(
            fvu=sums[f"sse:{name}"] / max(sums[f"sst:{name}"], 1e-12),
            l0=sums[f"l0:{name}"] / sums[f"tokens:{name}"],
            dead_fraction=firing[name].dead_fraction(),  # never fired on these tokens (mxd_lens.firing)
        )
        row["explained_variance"] = 1 - row["fvu"]
        rows.append(row)
    if together:
        rows.append(
            _row("together", None, None, sums, n_pred, ce_clean, "together:None", blocks, names=list(named))
        )
    return rows


def _row(name, layer, block, sums, n_pred, ce_clean, label, blocks, names=None) -> dict[str, Any]:
    ce = sums[f"ce:{label}"] / n_pred
    row: dict[str, Any] = {
        "name": name,
        "architecture": layer.cfg.architecture() if layer is not None else "+".join(names or []),
        "layer": block if block is not None else ",".join(map(str, blocks)),
        "k": layer.cfg.k if layer is not None else None,
        "d_sae": layer.cfg.d_sae if layer is not None else None,
        "params": sum(p.numel() for p in layer.parameters()) if layer is not None else None,
        "ce_clean": ce_clean,
        "ce_spliced": ce,
        "delta_ce": ce - ce_clean,
        "kl": sums[f"kl:{label}"] / n_pred,
        "tokens": n_pred,
    }
    if len(blocks) == 1:
        for kind in ("zero", "mean"):
            ablated = sums[f"ce:{kind}:{blocks[0]}"] / n_pred
            row[f"ce_{kind}_ablation"] = ablated
            row[f"ce_recovered_{kind}"] = (
                (ablated - ce) / (ablated - ce_clean) if ablated != ce_clean else float("nan")
            )
    return row


def _run_variant(model, kind, key, named, means, resid, start) -> torch.Tensor:
    run = lambda: model(resid, start_at_layer=start)  # noqa: E731
    if kind == "splice":
        with hooks.splice(model, named[key]):
            return run()
    if kind == "together":
        with hooks.splice(model, *named.values()):
            return run()
    value = means[key]

    def ablate(out: torch.Tensor, hook: Any) -> torch.Tensor:
        return torch.zeros_like(out) if kind == "zero" else value.to(out.dtype).expand_as(out)

    with model.hooks(fwd_hooks=[(hooks.mlp_out_hook(key), ablate)]):
        return run()


@torch.inference_mode()
def _mlp_output_means(model, blocks, batches, skip) -> dict[int, torch.Tensor]:
    total: dict[int, torch.Tensor] = {}
    count = 0
    for tokens in batches:
        with hooks.capture_mlp_io(model, blocks) as io:
            model(tokens, stop_at_layer=blocks[-1] + 1)
        for block in blocks:
            y = io[block]["out"][:, skip:].double()
            total[block] = total.get(block, 0) + y.sum((0, 1))
        count += io[blocks[0]]["out"][:, skip:].shape[0] * io[blocks[0]]["out"][:, skip:].shape[1]
    return {block: (value / count).float() for block, value in total.items()}


def _ce_sum(logp: torch.Tensor, target: torch.Tensor) -> float:
    return float(-logp.gather(-1, target.unsqueeze(-1)).sum())


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _default_name(layer: MLPReplacement) -> str:
    return f"L{hooks.layer_index(layer)}.{layer.cfg.architecture().removeprefix('mxd_lens.')}.k{layer.cfg.k}"


def check_disjoint(train_info: Mapping[str, Any] | None, eval_info: Mapping[str, Any]) -> None:
    """Refuse evaluation text that may overlap a layer's training text.

    Both infos are ``{"text": source, "split": "train"|"eval", "eval_fraction": f, "split_seed": s}``,
    plus ``"digests": data.source_digests(source)`` where recorded (the trainer stores the first in
    ``cfg.metadata.training["data"]``). The 'eval' side of the split the layer trained on (same
    eval_fraction and split_seed) is always fine: the split is decided per document, so it shares no
    document with the training side of any text. Otherwise the texts must not overlap: when both
    record digests, no file content may be shared (the same file under another name or spelling
    counts); without digests, the sources' resolved paths must differ and neither folder may hold
    the other. A layer with no record gets a loud warning.
    """
    if not train_info:
        warnings.warn(
            "the layer records no training text, so overlap with the evaluation text cannot be ruled out",
            stacklevel=2,
        )
        return
    same_split = all(train_info.get(k) == eval_info.get(k) for k in ("eval_fraction", "split_seed"))
    if same_split and train_info.get("split") == "train" and eval_info.get("split") == "eval":
        return
    train_digests, eval_digests = train_info.get("digests"), eval_info.get("digests")
    if isinstance(train_digests, Mapping) and isinstance(eval_digests, Mapping):
        shared = set(train_digests.values()) & set(eval_digests.values())
        if not shared:
            if _paths_overlap(train_info.get("text"), eval_info.get("text")):
                warnings.warn(
                    f"the evaluation text {eval_info.get('text')!r} has the path of the layer's training "
                    "text but other content (edited since?); overlap of documents cannot be ruled out",
                    stacklevel=2,
                )
            return
        names = sorted(name for name, digest in eval_digests.items() if digest in shared)
        overlap = f"holds the same content as the training text ({', '.join(names[:3])}"
        overlap += f" and {len(names) - 3} more)" if len(names) > 3 else ")"
    elif _paths_overlap(train_info.get("text"), eval_info.get("text")):
        overlap = "is (or holds, or is inside) the training text"
    else:
        return
    raise ValueError(
        f"evaluation text {_describe(eval_info)} overlaps the training text {_describe(train_info)}: it "
        f"{overlap}; evaluate on the 'eval' split of the same source with the same eval_fraction and "
        "split_seed, or on other text"
    )


def _paths_overlap(train_text: Any, eval_text: Any) -> bool:
    """Same source by name, by resolved path, or one a folder holding the other."""
    if train_text is None or eval_text is None:
        return False
    if str(train_text) == str(eval_text):
        return True
    a, b = (Path(str(t)).expanduser().resolve() for t in (train_text, eval_text))
    return a == b or (a.is_dir() and b.is_relative_to(a)) or (b.is_dir() and a.is_relative_to(b))


def _describe(info: Mapping[str, Any]) -> str:
    """An info without its digests (a folder's can be long)."""
    return str({k: v for k, v in info.items() if k != "digests"})

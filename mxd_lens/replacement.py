"""The replacement model: a layer at every block of a model, all spliced at once.

A layer faithful alone says little about the whole: each block's layer errs, and every later block reads
the erring residual stream, so errors compound. These are the measurements of the whole
(``mxd-lens replacement`` runs them on held-out and out-of-domain text):

- ``compounding``: the first n blocks' layers spliced at once, for n = 1 ... every block: KL(clean ‖
  spliced) and ΔCE of the next-token predictions against n. At n = all it is the replacement model.
- ``exactness``: every layer spliced with its error term (``mxd_lens.splice(error_term=True)``: the MLP's
  output minus the layer's, added back where the layer writes), as an attribution graph's error nodes do;
  the model must then be exact. Its KL and largest log-probability difference are the sanity row.
- each block alone (KL, FVU, L0, the units' usage) is :func:`mxd_lens.evaluation.evaluate`'s rows.

Definitions follow :mod:`mxd_lens.evaluation` (per predicted token, position 0's prediction included;
each layer replaces the MLP from its first trained position on, the MLP's own output stays before it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from mxd_lens import hooks
from mxd_lens.hooks import by_block  # noqa: F401  (re-exported: the replacement model is placed by block)

if TYPE_CHECKING:
    from mxd_lens.layers.base import MLPReplacement


def _log_probs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float().log_softmax(-1)


def _kl_ce(clean: torch.Tensor, spliced: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float, int]:
    """Sums over predicted tokens of KL(clean ‖ spliced) and of the spliced CE, and their count."""
    kl = (clean.exp() * (clean - spliced)).sum(-1)[:, :-1]
    ce = -spliced[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return float(kl.sum()), float(ce.sum()), kl.numel()


@torch.inference_mode()
def compounding(
    model: Any,
    layers: Mapping[int, MLPReplacement | Any],
    batches: Iterable[torch.Tensor],
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per n = 1 ... len(layers): the layers of the first n blocks (in block order) spliced at
    once, with ``n``, ``last_block``, ``kl``, ``ce_clean``, ``ce_spliced``, ``delta_ce`` and ``tokens``
    (predicted tokens). The last row is the whole replacement model."""
    blocks = list(layers)
    sums = [{"kl": 0.0, "ce": 0.0} for _ in blocks]
    clean_ce, count = 0.0, 0
    batches = list(batches)
    bar = tqdm(total=len(batches) * len(blocks), desc="compounding", unit="forward", disable=not progress)
    for tokens in batches:
        clean = _log_probs(model, tokens)
        clean_ce += float(-clean[:, :-1].gather(-1, tokens[:, 1:, None]).sum())
        for n, spliced in enumerate(_first_n_spliced(model, layers, blocks, tokens), start=1):
            kl, ce, counted = _kl_ce(clean, spliced, tokens)
            sums[n - 1]["kl"] += kl
            sums[n - 1]["ce"] += ce
            bar.update(1)
        count += counted
    bar.close()
    if not count:
        raise ValueError("compounding got no token batches")
    return [
        {"n": n, "last_block": blocks[n - 1], "kl": s["kl"] / count, "ce_clean": clean_ce / count,
         "ce_spliced": s["ce"] / count, "delta_ce": (s["ce"] - clean_ce) / count, "tokens": count}
        for n, s in enumerate(sums, start=1)
    ]  # fmt: skip


def _first_n_spliced(
    model: Any, layers: Mapping[int, Any], blocks: Sequence[int], tokens: torch.Tensor
) -> Iterator[torch.Tensor]:
    """The log-probabilities with the layers of ``blocks[:n]`` spliced, for n = 1, 2, ...: the residual stream
    of the first n spliced is kept and carried one spliced block further, and each n runs only the blocks
    after its last spliced one clean (about half the block-forwards of a full forward per n). A model whose
    positional embedding is not in the residual stream (shortformer) runs each n in full."""
    if model.cfg.positional_embedding_type == "shortformer":
        for n in range(1, len(blocks) + 1):
            with hooks.splice(model, *(layers[b] for b in blocks[:n])):
                yield _log_probs(model, tokens)
        return
    residual, start = model(tokens, stop_at_layer=0), 0
    for block in blocks:
        with hooks.splice(model, layers[block]):
            residual = model(residual, start_at_layer=start, stop_at_layer=block + 1, tokens=tokens)
        start = block + 1
        yield model(residual, start_at_layer=start, tokens=tokens).float().log_softmax(-1)


@torch.inference_mode()
def exactness(model: Any, layers: Mapping[int, Any], batches: Iterable[torch.Tensor]) -> dict[str, Any]:
    """Every layer spliced at once with its error term: ``kl`` and ``max_abs_logprob_diff`` against the
    clean model over the predicted tokens (both ~0: the replacement with its errors is the model)."""
    kl_sum, count, worst = 0.0, 0, 0.0
    for tokens in batches:
        clean = _log_probs(model, tokens)
        with hooks.splice(model, *layers.values(), error_term=True):
            spliced = _log_probs(model, tokens)
        kl, _, counted = _kl_ce(clean, spliced, tokens)
        kl_sum, count = kl_sum + kl, count + counted
        worst = max(worst, float((clean - spliced)[:, :-1].abs().max()))
    return {"kl": kl_sum / max(count, 1), "max_abs_logprob_diff": worst, "tokens": count}


def compounding_figure(curves: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> Any:
    """KL (log scale) and ΔCE against the number of blocks spliced, one line per method (``curves``:
    label -> :func:`compounding` rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, rows in curves.items():
        n = [r["n"] for r in rows]
        axes[0].plot(n, [r["kl"] for r in rows], marker="o", markersize=3, label=label)
        axes[1].plot(n, [r["delta_ce"] for r in rows], marker="o", markersize=3, label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(clean ‖ spliced), nats/token")
    axes[1].set_ylabel("ΔCE, nats/token")
    axes[1].axhline(0, color="grey", linewidth=0.5)
    for ax in axes:
        ax.set_xlabel("blocks spliced at once (the first n)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def load_replacement(folders: Sequence[str | Path], model: Any = None, every: bool = True) -> dict[int, Any]:
    """The saved layers under ``folders`` (layer folders, or folders holding them: a run's final/), by
    block; one per block, and (``every``) one at every block of ``model``."""
    from mxd_lens.layers.io import layer_folders, load_any_layer

    return by_block({str(path): load_any_layer(path) for path in layer_folders(list(folders))}, model, every)

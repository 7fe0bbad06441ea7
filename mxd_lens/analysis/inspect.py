"""What does one expert (MxD) or latent (transcoder) respond to? Its top-activating contexts in a text stream.

``top_activations`` runs each token batch through the model up to the layer's block, encodes the MLP
input and keeps, per feature, the n largest activations seen so far: a topk of the batch merged into
the running top-n, each entry with its context window. Nothing else is kept, so the stream can be
arbitrarily long. ``to_html`` renders the resulting table as one self-contained page.

The activation of feature n at a token is its code ``a_n = TopK_K(ReLU(x W_enc + b_enc))_n`` (for an
MxD, expert n's coefficient). It is 0 wherever the unit is not among the K selected, so only positive
activations are listed: a feature that never fires in the stream has no rows.

Order: features as asked; within a feature by activation, descending; equal activations by first
occurrence in the stream (row, then position), so the table is the same on every run.
"""

from __future__ import annotations

import html
import operator
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mxd_lens import hooks
from mxd_lens.fileio import atomic_write
from mxd_lens.layers.base import MLPReplacement

COLUMNS = ("feature", "rank", "activation", "token", "left", "right", "row", "position")
DTYPES = {"activation": "float64", "token": "object", "left": "object", "right": "object"}


def top_activations(
    model: Any,
    layer: MLPReplacement[Any],
    token_batches: Iterable[torch.Tensor],
    features: Sequence[int],
    n: int = 20,
    context: int | tuple[int, int] = (8, 4),
    skip_bos: bool = True,
    progress: bool = True,
) -> pd.DataFrame:
    """The ``n`` top-activating tokens of each of ``features`` over ``token_batches`` ([batch, pos] ids).

    One row per (feature, rank): ``rank`` counts from 1; ``token`` is the activating token's text and
    ``left`` / ``right`` the text of up to ``context = (left, right)`` tokens around it in the same row
    (an int means the same on both sides), so that ``left + token + right`` is the decoded window.
    ``row`` numbers the rows of the whole stream from 0 and ``position`` is the index in the row. With
    ``skip_bos`` position 0 is never ranked (it is BOS in ``data.TokenRows`` rows), though it still
    shows as context. Without a tokenizer, token ids stand in for text.
    ``df.attrs`` records the features asked, the block and the number of tokens ranked.
    """
    (df,) = top_activations_of_layers(
        model, [(layer, features)], token_batches, n, context, skip_bos, progress
    )
    return df


def top_activations_of_layers(
    model: Any,
    asked: Sequence[tuple[MLPReplacement[Any], Sequence[int]]],
    token_batches: Iterable[torch.Tensor],
    n: int = 20,
    context: int | tuple[int, int] = (8, 4),
    skip_bos: bool = True,
    progress: bool = True,
) -> list[pd.DataFrame]:
    """:func:`top_activations` of several layers, each (layer, features) of ``asked``, from one forward per
    batch (up to the deepest layer's block): a table per layer, in order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1: how many contexts to keep per feature")
    n_left, n_right = _check_context(context)
    width = n_left + 1 + n_right
    runs = []
    for layer, features in asked:
        rep = hooks.replacement(layer)  # an mxd-lens layer or a SAELens transcoder from elsewhere
        hooks.check_fits(model, layer, rep.block)
        wanted = _check_features(features, rep.d_sae, rep.block)
        # Column of each asked feature in the [tokens, F] activation matrix; units not asked go to column F.
        column = torch.full((rep.d_sae,), len(wanted), dtype=torch.long, device=layer.device)
        column[torch.tensor(wanted, device=layer.device)] = torch.arange(len(wanted), device=layer.device)
        runs.append((layer, rep, wanted, column, _RunningTop(len(wanted), n, width)))
    if not runs:
        return []
    blocks = sorted({rep.block for _, rep, *_ in runs})
    resid = hooks.resid_blocks([rep for _, rep, *_ in runs])
    rows_seen = n_batches = n_ranked = 0
    batches = tqdm(token_batches, desc="top activations", unit="batch", disable=not progress)
    with torch.inference_mode(), hooks.capture_mlp_io(model, blocks, resid=resid) as io:
        for tokens in batches:
            tokens = _check_batch(tokens, n_batches)
            n_rows, n_pos = tokens.shape
            model(tokens.to(model.cfg.device), stop_at_layer=blocks[-1] + 1)
            padded = F.pad(tokens, (n_left, n_right), value=-1)
            for layer, rep, wanted, column, top in runs:
                values, units = rep.encode_sparse(hooks.layer_input(io, rep).to(layer.device))
                k = values.shape[-1]
                acts = _feature_acts(values.reshape(-1, k), units.reshape(-1, k), column, len(wanted))
                if skip_bos:
                    acts.view(len(wanted), n_rows, n_pos)[:, :, 0] = 0.0
                batch_top, flat = _batch_top(acts, n)
                row, pos = flat // n_pos, flat % n_pos
                window = padded[row[..., None], pos[..., None] + torch.arange(width)]
                top.merge(batch_top, row + rows_seen, pos, window)
            rows_seen += n_rows
            n_batches += 1
            n_ranked += n_rows * (n_pos - 1 if skip_bos else n_pos)
    if not n_batches:
        raise ValueError("token_batches yielded no batch: give at least one [batch, pos] tensor of token ids")
    tables = []
    for _, rep, wanted, _, top in runs:
        df = top.table(wanted, n_left, getattr(model, "tokenizer", None))
        df.attrs.update(features=wanted, block=rep.block, tokens=n_ranked)
        tables.append(df)
    return tables


class _RunningTop:
    """The top-n so far of F features: activation [F, n] (-inf in empty slots), stream row and position
    [F, n], and the window of token ids around each [F, n, width] (-1 beyond the row's ends)."""

    def __init__(self, n_feat: int, n: int, width: int):
        self.n = n
        self.activation = torch.full((n_feat, n), -torch.inf)
        self.row = torch.full((n_feat, n), -1, dtype=torch.long)
        self.position = torch.full((n_feat, n), -1, dtype=torch.long)
        self.window = torch.full((n_feat, n, width), -1, dtype=torch.long)

    def merge(
        self, activation: torch.Tensor, row: torch.Tensor, position: torch.Tensor, window: torch.Tensor
    ):
        """Merge a later batch's top entries, each [F, m] (window [F, m, width])."""
        # Running entries go first: they came earlier, and the stable sort keeps them ahead on ties.
        merged = torch.cat([self.activation, activation], dim=1)
        magnitude = torch.where(merged == -torch.inf, -1.0, merged.abs())  # empty slots last
        order = magnitude.sort(dim=1, descending=True, stable=True).indices[:, : self.n]
        self.activation = merged.gather(1, order)
        self.row = torch.cat([self.row, row], dim=1).gather(1, order)
        self.position = torch.cat([self.position, position], dim=1).gather(1, order)
        window = torch.cat([self.window, window], dim=1)
        self.window = window.gather(1, order[..., None].expand(-1, -1, window.shape[-1]))

    def table(self, features: list[int], n_left: int, tokenizer: Any) -> pd.DataFrame:
        records: dict[str, list[Any]] = {name: [] for name in COLUMNS}
        for i, feature in enumerate(features):
            for rank in range(self.n):
                activation = float(self.activation[i, rank])
                if activation == -torch.inf:
                    break
                ids = self.window[i, rank].tolist()
                left, token, right = _split_context(
                    tokenizer,
                    [t for t in ids[:n_left] if t >= 0],
                    ids[n_left],
                    [t for t in ids[n_left + 1 :] if t >= 0],
                )
                row, position = int(self.row[i, rank]), int(self.position[i, rank])
                entry = (feature, rank + 1, activation, token, left, right, row, position)
                for name, value in zip(COLUMNS, entry, strict=True):
                    records[name].append(value)
        return pd.DataFrame(
            {name: pd.Series(records[name], dtype=DTYPES.get(name, "int64")) for name in COLUMNS}
        )


def _check_features(features: Sequence[int], d_sae: int, index: int) -> list[int]:
    asked = []
    for f in features:
        try:
            if isinstance(f, bool):
                raise TypeError
            f = operator.index(f)
        except TypeError:
            raise TypeError(f"feature {f!r} is not an int index") from None
        if not 0 <= f < d_sae:
            raise ValueError(
                f"feature {f} is out of range: the layer at block {index} has d_sae={d_sae} features, "
                f"indices 0..{d_sae - 1}"
            )
        asked.append(f)
    if not asked:
        raise ValueError("features is empty: give at least one feature index")
    repeated = sorted(f for f, count in Counter(asked).items() if count > 1)
    if repeated:
        raise ValueError(f"features {repeated} are listed more than once; give each once")
    return asked


def _check_context(context: int | tuple[int, int]) -> tuple[int, int]:
    sides = (context, context) if isinstance(context, int) else tuple(context)
    if len(sides) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sides):
        raise ValueError(f"context={context!r} must be (left, right) token counts >= 0, or one int for both")
    return sides[0], sides[1]


def _check_batch(tokens: Any, number: int) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(
            f"batch {number} is a {type(tokens).__name__} ({getattr(tokens, 'dtype', '')}), "
            "not a tensor of token ids"
        )
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"batch {number} has shape {tuple(tokens.shape)}; expected [batch, pos] token ids")
    return tokens.long().cpu()


def _feature_acts(
    values: torch.Tensor, units: torch.Tensor, column: torch.Tensor, n_feat: int
) -> torch.Tensor:
    """The asked features' activations [F, T] from TopK codes (values, units) [T, K]: a scatter of the
    K values per token into F columns, never the dense [T, d_sae] codes."""
    acts = torch.zeros(values.shape[0], n_feat + 1, dtype=torch.float32, device=values.device)
    acts.scatter_(1, column[units], values.float())
    return acts[:, :n_feat].T.contiguous()


def _batch_top(acts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per feature, the min(n, T) activations of [F, T] largest in magnitude (-inf where fewer fired)
    and their flat token indices, equal magnitudes in index order. ReLU'd codes are >= 0, so this is
    their largest values; signed codes (MxD's ``gate="topk"``) keep their sign, and a unit that fires
    negative shows those contexts too.

    topk makes no promise on ties, so it ranks an exact int64 key instead: the bits of a positive
    float32 order like its value; the low 32 bits put earlier tokens first among equal values.
    """
    n_tokens = acts.shape[1]
    if n_tokens >= 2**32:
        raise ValueError(f"a batch of {n_tokens} tokens is too large; split it")
    later = torch.arange(n_tokens - 1, -1, -1, device=acts.device)
    magnitude = acts.abs()
    key = torch.where(magnitude > 0, (magnitude.view(torch.int32).long() << 32) | later, -1)
    key, flat = key.topk(min(n, n_tokens), dim=1)
    top = torch.where(key >= 0, acts.gather(1, flat), -torch.inf)
    return top.cpu(), flat.cpu()


def _split_context(
    tokenizer: Any, left_ids: list[int], token_id: int, right_ids: list[int]
) -> tuple[str, str, str]:
    """(left, token, right) texts whose concatenation is the decoded window, so a tokenizer's joining
    spaces land where the text has them. Token ids stand in for text without a tokenizer."""
    if tokenizer is None:
        return "".join(f"{t} " for t in left_ids), str(token_id), "".join(f" {t}" for t in right_ids)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, clean_up_tokenization_spaces=False)  # as HookedTransformer.to_string

    left = decode(left_ids)
    through = decode(left_ids + [token_id])
    whole = decode(left_ids + [token_id] + right_ids)
    if through.startswith(left) and whole.startswith(through):
        return left, through[len(left) :], whole[len(through) :]
    # A character split across tokens (byte-level BPE) decodes differently in pieces: decode each alone.
    return left, decode([token_id]), decode(right_ids)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
nav a { margin-right: 0.6em; }
section { margin-top: 2em; }
table { border-collapse: collapse; }
td, th { padding: 0.15em 0.6em; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.ctx { font-family: ui-monospace, monospace; white-space: pre-wrap; }
td.ctx .side { color: #555; }
mark { color: #000; border-bottom: 2px solid rgb(220, 90, 0); padding: 0 1px; }
.meta { color: #666; }
"""


def to_html(df: pd.DataFrame, title: str, path: str | Path | None = None) -> str:
    """One self-contained HTML page (inline CSS, no script) for a ``top_activations`` table: a section
    per feature, each context with its activating token highlighted (background opacity = activation /
    the feature's largest) and the activation shown. Written atomically to ``path`` when given."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"df lacks columns {missing}; pass the table from top_activations")
    present = list(dict.fromkeys(df["feature"].tolist()))
    features = list(dict.fromkeys([*df.attrs.get("features", []), *present]))
    meta = []
    if "block" in df.attrs:
        meta.append(f"block {df.attrs['block']}")
    if "tokens" in df.attrs:
        meta.append(f"{df.attrs['tokens']:,} tokens ranked")
    silent = [f for f in features if f not in present]
    if silent:
        meta.append(f"never active: {', '.join(map(str, silent))}")

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_text(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_text(title)}</h1>",
    ]
    if meta:
        parts.append(f'<p class="meta">{_text("; ".join(meta))}</p>')
    if present:
        parts.append("<nav>" + "".join(f'<a href="#feature-{f}">{f}</a>' for f in present) + "</nav>")
    else:
        parts.append("<p>No feature was active in the stream.</p>")
    for feature in present:
        rows = df[df["feature"] == feature].sort_values("rank", kind="stable")
        peak = float(rows["activation"].abs().max())
        parts.append(f'<section id="feature-{feature}"><h2>Feature {feature}</h2>')
        parts.append(f'<p class="meta">max activation {peak:.4g}; {len(rows)} contexts</p>')
        parts.append("<table><tr><th>#</th><th>activation</th><th>context</th><th>row:position</th></tr>")
        for r in rows.itertuples(index=False):
            alpha = min(abs(r.activation) / peak, 1.0) if peak > 0 else 0.0
            parts.append(
                f'<tr><td class="num">{r.rank}</td><td class="num">{r.activation:.4g}</td><td class="ctx">'
                f'<span class="side">{_text(r.left)}</span>'
                f'<mark style="background-color: rgba(255, 140, 0, {alpha:.3f})" title="{r.activation:.6g}">'
                f"{_text(r.token)}</mark>"
                f'<span class="side">{_text(r.right)}</span></td><td>{r.row}:{r.position}</td></tr>'
            )
        parts.append("</table></section>")
    parts.append("</body></html>\n")
    page = "\n".join(parts)
    if path is not None:
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return page


def _text(s: Any) -> str:
    """Escaped for HTML; a newline shows as ↵ so one context stays on one line."""
    return html.escape(str(s), quote=True).replace("\r\n", "↵").replace("\n", "↵").replace("\r", "↵")


# -- the study (mxd-lens inspect, the steering study, a notebook) ----------------------------------
def text_batches(
    model: Any, sources: Sequence[str | Path] | None, tokens: int, context_size: int, rows: int = 8
) -> Iterable[torch.Tensor]:
    """[rows, context_size] token batches (BOS first, as ``data.TokenRows``) from ``sources`` (default:
    the bundled English text), an equal share of ``tokens`` from each."""
    import itertools

    from mxd_lens.data import TokenRows, default_text, iter_texts

    token_rows = TokenRows.for_model(model, context_size)
    sources = list(sources) if sources else [default_text()]
    n_batches = max(1, tokens // (rows * context_size * len(sources)))
    return itertools.chain.from_iterable(
        itertools.islice(token_rows.batches(iter_texts(source), rows), n_batches) for source in sources
    )


def top_contexts(
    model: Any,
    layer: MLPReplacement[Any],
    features: Sequence[int],
    text: Sequence[str | Path] | None = None,
    tokens: int = 100_000,
    context_size: int = 128,
    n: int = 20,
    progress: bool = True,
) -> pd.DataFrame:
    """``top_activations`` of ``features`` over ``text_batches`` (``text``: the bundled English text when
    None): the ``n`` top contexts of each feature over ``tokens`` tokens."""
    batches = text_batches(model, text, tokens, context_size)
    return top_activations(model, layer, batches, features, n=n, progress=progress)


def contexts_title(name: str, table: pd.DataFrame) -> str:
    """The heading of a layer's top-contexts page."""
    return f"{name}: top contexts over {table.attrs['tokens']:,} tokens"

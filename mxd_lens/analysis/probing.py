"""Sparse probing (SAEBench's protocol, with feature selection on training data only).

1. ``pooled_activations``: run the clean model (no layer spliced) once over each text and mean-pool,
   over the text's own tokens, each layer's codes (MxD: expert coefficients; transcoders: latents) and
   the dense MLP input and output. Each text is ``[BOS] + its first context_size - 1 tokens``; the
   mean runs over those text tokens: never the BOS, never padding, the last token included.
2. ``probe_task``: for one binary task, rank features by the absolute difference of the class means
   on the training split, fit a logistic regression on the top k (its L2 strength chosen on the
   validation split) and report test accuracy. The dense ceiling is the same probe on every
   dimension of the MLP input or output.
3. ``run_probing``: every task of every set, every feature source and k, as one table.

``PooledCache`` keeps pooled activations on disk per task set, keyed by the model, the texts and
each layer's weights, so several layers and k values cost one model pass per text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mxd_lens import hook_names, hooks
from mxd_lens.analysis.tasks import Examples, TaskSet, binary_task, splits
from mxd_lens.fileio import atomic_write, atomic_write_text

if TYPE_CHECKING:
    import pandas as pd
    from transformer_lens import HookedTransformer

    from mxd_lens.layers.base import MLPReplacement

DENSE = ("mlp_in", "mlp_out")
NEURONS = "neurons"  # the host MLP's hidden activations (hook_post), probed like codes: a baseline
PROTOCOLS = ("saebench", "paper", "paper_val")
"""How features are chosen. saebench: the top k by |train mean difference|, chosen on the training
split only, then a probe (SAEBench; k in ks). paper: the reference code's probe_global.py, k = 1: of the
100 features with the largest *signed* train mean difference, the one whose one-feature probe has the best
*test* F1 (selected on test: it flatters a method with many weak features). paper_val: the same, but
selected by validation F1 (the fair variant)."""
DEFAULT_CS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)


def neuron_key(block: int) -> str:
    return f"{NEURONS}.L{block}"


def dense_key(kind: str, layer: int) -> str:
    return f"{kind}.L{layer}"


def tokenize_texts(model: HookedTransformer, texts: Sequence[str], context_size: int) -> list[list[int]]:
    """Each text as ``[BOS] + its first context_size - 1 tokens`` (no BOS when the model does not
    prepend one). Raises on a text with no tokens."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"{model.cfg.model_name} has no tokenizer: call model.set_tokenizer(...) first")
    if not 2 <= context_size <= model.cfg.n_ctx:
        raise ValueError(f"context_size={context_size} must be in 2..n_ctx={model.cfg.n_ctx}")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    head = [bos] if model.cfg.default_prepend_bos and bos is not None else []
    out = []
    for start in range(0, len(texts), 256):
        batch = list(texts[start : start + 256])
        for offset, ids in enumerate(tokenizer(batch, add_special_tokens=False)["input_ids"]):
            if not ids:
                raise ValueError(
                    f"text {start + offset} ({batch[offset][:40]!r}) tokenises to nothing: drop it"
                )
            out.append(head + ids[: context_size - len(head)])
    return out


@torch.no_grad()
def pooled_activations(
    model: HookedTransformer,
    layers: Mapping[str, MLPReplacement],
    texts: Sequence[str],
    dense_layers: Sequence[int] = (),
    context_size: int = 128,
    batch_size: int = 16,
    progress: bool = True,
    neurons: bool = False,
) -> dict[str, torch.Tensor]:
    """Mean-pooled codes ``{name: [n_texts, d_sae]}`` of each layer in ``layers`` and, for each block in
    ``dense_layers``, the dense MLP input and output (``mlp_in.L3``, ``mlp_out.L3``: [n_texts, d_model])
    and with ``neurons`` the MLP's hidden activations (``neurons.L3``: [n_texts, d_mlp]).

    One clean forward per text, up to the deepest block needed. Texts are sorted by length into
    batches (right padding never reaches a real token under causal attention) and returned in the
    given order."""
    reps = {name: hooks.replacement(layer) for name, layer in layers.items()}  # ours or from elsewhere
    blocks: dict[str, int] = {}
    for name, rep in reps.items():
        hooks.check_fits(model, layers[name], rep.block)
        blocks[name] = rep.block
    resid = hooks.resid_blocks(list(reps.values()))
    needed = sorted(set(blocks.values()) | set(dense_layers))
    if not needed:
        raise ValueError("nothing to pool: pass layers and/or dense_layers")
    if not texts:
        raise ValueError("no texts to pool")
    ids = tokenize_texts(model, texts, context_size)
    skip = 1 if model.cfg.default_prepend_bos else 0
    if skip and any(len(t) < 2 for t in ids):
        raise ValueError("a text tokenises to nothing after the BOS")
    device = next(model.parameters()).device
    out: dict[str, torch.Tensor] = {}
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    bar = tqdm(total=len(ids), desc="pooling", unit="text", disable=not progress)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(ids[i]) for i in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width)
        for row, i in enumerate(chunk):
            tokens[row, : len(ids[i])] = torch.tensor(ids[i])
            mask[row, skip : len(ids[i])] = 1.0
        tokens, mask = tokens.to(device), mask.to(device)
        weights = (mask / mask.sum(1, keepdim=True)).unsqueeze(-1)
        hidden: dict[int, torch.Tensor] = {}
        post = [(hook_names.mlp_post_hook(i), _store(hidden, i)) for i in dense_layers] if neurons else []
        with hooks.capture_mlp_io(model, needed, resid=resid) as io, model.hooks(fwd_hooks=post):
            model(tokens, stop_at_layer=needed[-1] + 1)
        pooled = {}
        for name, rep in reps.items():
            # the K non-zero codes only (no dense [b, p, d_sae] codes, no MxD hidden layer)
            values, units = rep.encode_sparse(hooks.layer_input(io, rep))
            sums = torch.zeros(len(chunk), rep.d_sae, dtype=values.dtype, device=values.device)
            sums.scatter_add_(1, units.flatten(1), (values * weights.to(values.dtype)).flatten(1))
            pooled[name] = sums
        for index in dense_layers:  # pooled in float32 whatever the model's dtype (--dtype bfloat16)
            for kind, key in zip(DENSE, ("in", "out"), strict=True):
                pooled[dense_key(kind, index)] = (io[index][key].float() * weights).sum(1)
            if neurons:
                pooled[neuron_key(index)] = (hidden[index].float() * weights).sum(1)
        for name, value in pooled.items():
            if name not in out:
                out[name] = torch.empty(len(ids), value.shape[-1], dtype=torch.float32)
            out[name][torch.tensor(chunk)] = value.float().cpu()
        bar.update(len(chunk))
    bar.close()
    return out


def _store(slot: dict[int, torch.Tensor], index: int):
    def hook(value: torch.Tensor, hook: Any) -> None:
        slot[index] = value

    return hook


def layer_fingerprint(layer: torch.nn.Module) -> str:
    """A digest of a module's weights: the cache key that notices retrained or edited layers."""
    digest = hashlib.blake2b(digest_size=8)
    for key, value in sorted(layer.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_identity(model: HookedTransformer) -> dict[str, Any]:
    """What identifies ``model`` for the pooled cache: the source ``load_model`` recorded (file or
    config digests, hub revision), and for a model it did not load, a digest of its weights, so two
    models with one ``cfg.model_name`` never share an entry."""
    from mxd_lens.models import model_source

    source = model_source(model)
    if source.get("kind") == "unknown":
        source["weights"] = layer_fingerprint(model)
    return source


class PooledCache:
    """Pooled activations on disk: ``root/<task set>/<source>.safetensors``, each stamped with the
    model, the context size, a digest of the texts and (for layers) of the weights; a stale or missing
    entry is recomputed, the rest are read back."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def get(
        self,
        model: HookedTransformer,
        examples: Examples,
        layers: Mapping[str, MLPReplacement],
        dense_layers: Sequence[int] = (),
        context_size: int = 128,
        batch_size: int = 16,
        progress: bool = True,
        neurons: bool = False,
    ) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        folder = self.root / examples.task_set.name
        texts_digest = hashlib.blake2b("\x00".join(examples.texts).encode(), digest_size=8).hexdigest()
        stamp = {"model": model_identity(model), "context_size": context_size, "texts": texts_digest}
        wanted = {name: {**stamp, "weights": layer_fingerprint(layer)} for name, layer in layers.items()}
        kinds = [dense_key(kind, i) for i in dense_layers for kind in DENSE]
        kinds += [neuron_key(i) for i in dense_layers] if neurons else []
        for key in kinds:
            wanted[key] = dict(stamp)
        found: dict[str, torch.Tensor] = {}
        for name, meta in wanted.items():
            path = folder / f"{name}.safetensors"
            if path.is_file() and (path.with_suffix(".json").is_file()):
                try:  # a damaged entry (a killed write, a bad disk) is a cache miss: recomputed below
                    if json.loads(path.with_suffix(".json").read_text()) == meta:
                        found[name] = load_file(path)["pooled"]
                except Exception:  # safetensors raises its own error type for a bad header or short file
                    found.pop(name, None)
        missing_layers = {n: layer for n, layer in layers.items() if n not in found}
        missing_dense = [
            i for i in dense_layers if any(k not in found and k.endswith(f".L{i}") for k in kinds)
        ]
        if missing_layers or missing_dense:
            fresh = pooled_activations(
                model,
                missing_layers,
                examples.texts,
                missing_dense,
                context_size,
                batch_size,
                progress,
                neurons,
            )
            folder.mkdir(parents=True, exist_ok=True)
            for name, value in fresh.items():
                path = folder / f"{name}.safetensors"
                tensors = {"pooled": value.contiguous()}
                atomic_write(path, lambda tmp, tensors=tensors: save_file(tensors, tmp))
                atomic_write_text(path.with_suffix(".json"), json.dumps(wanted[name]))
                found[name] = value
        return {name: found[name] for name in wanted}


def rank_features(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Feature indices by decreasing |mean(X | y=1) − mean(X | y=0)| (ties: lower index first)."""
    y = np.asarray(y).astype(bool)
    if y.all() or not y.any():
        raise ValueError("ranking needs both classes in the training split")
    diff = np.abs(X[y].mean(0) - X[~y].mean(0))
    return np.argsort(-diff, kind="stable")


def fit_probe(
    X_train: np.ndarray,
    y_train: np.ndarray,
    X_val: np.ndarray,
    y_val: np.ndarray,
    Cs: Sequence[float] = DEFAULT_CS,
    criterion: str = "accuracy",
) -> tuple[Any, float]:
    """Standardised logistic regression, its inverse L2 strength C chosen on the validation split by
    accuracy (ties: the smallest C, i.e. the strongest regularisation) or by log-loss (``criterion=
    "log_loss"``: calibrated probabilities, for probes whose P(class) is read as a score). Returns
    (fitted pipeline, C)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if criterion not in ("accuracy", "log_loss"):
        raise ValueError(f"criterion={criterion!r}: choose 'accuracy' or 'log_loss'")
    best, best_score, best_C = None, -np.inf, Cs[0]
    for C in sorted(Cs):
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
        probe.fit(X_train, y_train)
        if criterion == "accuracy":
            score = float((probe.predict(X_val) == y_val).mean())
        else:
            score = -log_loss(y_val, probe.predict_proba(X_val)[:, 1], labels=[0, 1])
        if score > best_score:
            best, best_score, best_C = probe, score, C
    return best, best_C


def probe_task(
    X: np.ndarray,
    y: np.ndarray,
    parts: Mapping[str, Sequence[int]],
    k: int | None,
    Cs: Sequence[float] = DEFAULT_CS,
    criterion: str = "accuracy",
) -> dict[str, Any]:
    """Train-only feature selection then a probe; ``parts`` maps train/val/test to row indices of X.
    ``k=None`` uses every feature (the dense ceiling); ``criterion`` as in ``fit_probe``."""
    n_features = X.shape[1]
    if k is not None and not 1 <= k <= n_features:
        raise ValueError(f"k={k} must be between 1 and the number of features ({n_features})")
    tr, va, te = (np.asarray(parts[s]) for s in ("train", "val", "test"))
    if k is None:
        features = np.arange(n_features)
    else:
        features = rank_features(X[tr], y[tr])[:k]
    probe, C = fit_probe(X[tr][:, features], y[tr], X[va][:, features], y[va], Cs, criterion)
    acc = lambda rows: float((probe.predict(X[rows][:, features]) == y[rows]).mean())  # noqa: E731
    return {
        "test_accuracy": acc(te),
        "val_accuracy": acc(va),
        "train_accuracy": acc(tr),
        "C": C,
        "features": features.tolist() if k is not None else None,
        "n_train": len(tr),
        "n_test": len(te),
        "probe": probe,
    }


def probe_paper(
    X: np.ndarray,
    y: np.ndarray,
    parts: Mapping[str, Sequence[int]],
    select_on: str = "test",
    candidates: int = 100,
) -> dict[str, Any]:
    """The reference code's protocol (``probe_global.py``), k = 1: of the ``candidates`` features with the
    largest signed train mean difference mean(X | y=1) − mean(X | y=0), keep the one whose one-feature
    logistic probe (standardised, C = 1, fitted on train) has the best F1 on ``select_on`` ("test", as
    the paper does, or "val"); report its test accuracy, balanced accuracy and F1."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score, f1_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if select_on not in ("test", "val"):
        raise ValueError(f"select_on={select_on!r}: choose 'test' (the paper's) or 'val'")
    tr, va, te = (np.asarray(parts[s]) for s in ("train", "val", "test"))
    yb = np.asarray(y).astype(bool)
    if yb[tr].all() or not yb[tr].any():
        raise ValueError("ranking needs both classes in the training split")
    diff = X[tr][yb[tr]].mean(0) - X[tr][~yb[tr]].mean(0)
    ranked = np.argsort(-diff, kind="stable")[:candidates]
    chosen = np.asarray(parts[select_on])
    best, best_f1 = None, -1.0
    for feature in ranked:
        column = X[:, [feature]]
        if np.ptp(column[tr]) == 0:  # never active on train: a constant, no probe
            continue
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
        probe.fit(column[tr], y[tr])
        f1 = f1_score(y[chosen], probe.predict(column[chosen]), zero_division=0.0)
        if f1 > best_f1:
            best, best_f1 = (int(feature), probe), f1
    if best is None:
        return {"test_accuracy": 0.5, "balanced_accuracy": 0.5, "test_f1": 0.0, "features": [],
                "n_train": len(tr), "n_test": len(te), "probe": None}  # fmt: skip
    feature, probe = best
    predicted = probe.predict(X[te][:, [feature]])
    return {
        "test_accuracy": float((predicted == y[te]).mean()),
        "balanced_accuracy": float(balanced_accuracy_score(y[te], predicted)),
        "test_f1": float(f1_score(y[te], predicted, zero_division=0.0)),
        "features": [feature],
        "n_train": len(tr),
        "n_test": len(te),
        "probe": probe,
    }


def task_splits(
    examples: Examples, fractions: tuple[float, float, float] = (0.6, 0.2, 0.2), seed: int = 0
) -> dict[str, tuple[dict[str, list[int]], np.ndarray]]:
    """Per task of the set: (balanced train/val/test row indices into the set's examples, 0/1 targets
    aligned with the rows). One stratified split of the set is shared by its tasks."""
    base = splits(examples.labels, fractions, seed)
    ts = examples.task_set
    out = {}
    for task, positive in zip(ts.tasks, ts.classes, strict=False):
        y = np.array([int(label == positive) for label in examples.labels])
        parts = {name: binary_task(examples.labels, positive, idx, seed)[0] for name, idx in base.items()}
        out[task] = (parts, y)
    return out


def run_probing(
    model: HookedTransformer,
    task_sets: Iterable[TaskSet],
    layers: Mapping[str, MLPReplacement],
    ks: Sequence[int] = (1, 2, 5),
    dense_layers: Sequence[int] | None = None,
    data_root: str | Path | None = None,
    cache: str | Path | None = None,
    context_size: int = 128,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    protocols: Sequence[str] = ("saebench",),
    neurons: bool = False,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Every task of every set, for each layer's codes at each k and the dense MLP input/output of
    each layer's block (``dense_layers`` defaults to those blocks), under each of ``protocols``
    (``PROTOCOLS``); with ``neurons`` the host MLP's hidden neurons are probed like codes (a baseline).
    Returns (table with one row per (task, source, protocol, k), fitted probes
    ``{(task, source, k): result}`` for the saebench protocol, ``{(task, source, protocol): ...}`` else)."""
    import pandas as pd

    if dense_layers is None:
        dense_layers = sorted({hooks.block_of(layer) for layer in layers.values()})
    unknown = sorted(set(protocols) - set(PROTOCOLS))
    if unknown or not protocols:
        raise ValueError(f"protocols {list(protocols)}: choose among {list(PROTOCOLS)}")
    for name, layer in layers.items():
        for k in ks:
            if not 1 <= k <= layer.cfg.d_sae:
                raise ValueError(f"k={k} must be between 1 and {name}'s {layer.cfg.d_sae} features")
    store = PooledCache(cache) if cache is not None else None
    rows, fitted = [], {}
    loaded = []
    for task_set in task_sets:  # load and split everything first: bad data fails before any model pass
        examples = task_set.load(data_root)
        loaded.append((task_set, examples, task_splits(examples, seed=seed)))
    for task_set, examples, task_parts in loaded:
        if store is not None:
            pooled = store.get(
                model, examples, layers, dense_layers, context_size, batch_size, progress, neurons
            )
        else:
            pooled = pooled_activations(
                model, layers, examples.texts, dense_layers, context_size, batch_size, progress, neurons
            )
        bar = tqdm(task_parts.items(), desc=f"probes {task_set.name}", unit="task", disable=not progress)
        for task, (parts, y) in bar:
            for source, X in pooled.items():
                X = X.numpy()
                dense = source.split(".")[0] in DENSE
                base = {"task_set": task_set.name, "family": task_set.family, "task": task, "source": source}
                if "saebench" in protocols or dense:
                    for k in [None] if dense else ks:
                        result = probe_task(X, y, parts, k)
                        fitted[(task, source, k)] = result
                        rows.append({**base, "protocol": "saebench", "k": "all" if k is None else k,
                                     **{key: v for key, v in result.items() if key != "probe"}})  # fmt: skip
                for protocol in [] if dense else [p for p in protocols if p != "saebench"]:
                    result = probe_paper(X, y, parts, select_on="test" if protocol == "paper" else "val")
                    fitted[(task, source, protocol)] = result
                    rows.append({**base, "protocol": protocol, "k": 1,
                                 **{key: v for key, v in result.items() if key != "probe"}})  # fmt: skip
    return pd.DataFrame(rows), fitted


def arch_columns(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with the ``arch`` and ``K`` columns of a probing table, also when it was written before
    they existed: ``method`` is the old name of ``arch`` (the same keys), and older tables still name a
    layer only by its label, 'MxD K=32', read back here through the registry."""
    table = table.copy()
    if "method" in table:
        method = table.pop("method")
        table["arch"] = table["arch"].fillna(method) if "arch" in table else method
    if "label" in table:
        from mxd_lens.layers import ARCHITECTURES

        keys = {cls.label: key for key, cls in ARCHITECTURES.items()}
        name, sep, K = (table.label.astype(str).str.rpartition(" K=")[i] for i in range(3))
        for column in ("arch", "K"):
            if column not in table:
                table[column] = None
        read = (sep != "") & name.isin(keys) & table["arch"].isna()
        table.loc[read, "arch"] = name[read].map(keys)
        table.loc[read, "K"] = K[read].astype(int)
    return table


def layer_sources(table: pd.DataFrame) -> dict[str, tuple[str, int]]:
    """{source: (architecture key, K)} of the layers' rows of a probing table (:func:`arch_columns`)."""
    table = arch_columns(table)
    if "arch" not in table:
        return {}
    rows = table.dropna(subset=["arch"]).drop_duplicates("source")
    return {s: (a, int(K)) for s, a, K in zip(rows.source, rows.arch, rows.K, strict=True)}


def source_label(source: str, layers: Mapping[str, tuple[str, int]]) -> str:
    """How a rendered table or plot names a probing source: a layer by its architecture's label and K
    (``MxD (gate=topk) K=32``; ``layers`` as :func:`layer_sources` gives them), the MLP's neurons as
    such, a dense source by its name."""
    from mxd_lens.layers import arch_label

    if source in layers:
        arch, K = layers[source]
        return f"{arch_label(arch)} K={K}"
    if source.startswith(NEURONS + "."):
        return f"MLP neurons ({source.split('.')[-1]})"
    return source


def _family(arch: str) -> str:
    from mxd_lens.layers import parse_arch

    return parse_arch(arch)[0]


def summarize(table: pd.DataFrame, protocol: str = "saebench", metric: str = "test_accuracy") -> pd.DataFrame:
    """Mean ``metric`` over tasks per (source, k) under ``protocol`` (tables written before protocols
    existed are saebench), one column per k (the dense ceiling under 'all'), each with its standard
    error over tasks (``se k=...``)."""
    import pandas as pd

    table = _with_protocol(table)
    table = table[(table.protocol == protocol) | (table.k.astype(str) == "all")]
    grouped = table.groupby(["source", "k"])["test_accuracy"]
    mean = grouped.mean().unstack("k")
    se = (grouped.std(ddof=1) / grouped.count() ** 0.5).unstack("k")
    columns = sorted(mean.columns, key=lambda c: (c == "all", str(c)))
    out = pd.concat({**{f"k={c}": mean[c] for c in columns}, **{f"se k={c}": se[c] for c in columns}}, axis=1)
    out["tasks"] = table.groupby("source")["task"].nunique()
    return out


def paired_difference(table: pd.DataFrame, a: str, b: str, protocol: str = "saebench") -> pd.DataFrame:
    """Per k: the mean over tasks of (accuracy of source ``a`` − of ``b``) on the same task, its
    standard error and the number of tasks each side wins: a paired comparison, tighter than the
    difference of two means since tasks vary far more than methods do. Rows of ``protocol`` only."""
    import pandas as pd

    table = _with_protocol(table)
    table = table[table.protocol == protocol]
    rows = []
    for k in sorted(set(table.k) - {"all"}, key=str):
        pair = [
            table[(table.source == s) & (table.k == k)].set_index("task")["test_accuracy"] for s in (a, b)
        ]
        diff = (pair[0] - pair[1]).dropna()
        if len(diff) < 2:
            raise ValueError(f"{a!r} and {b!r} share fewer than 2 tasks at k={k}")
        rows.append(
            {"k": k, "mean_difference": diff.mean(), "se": diff.std(ddof=1) / len(diff) ** 0.5,
             "a_wins": int((diff > 0).sum()), "b_wins": int((diff < 0).sum()), "tasks": len(diff)}
        )  # fmt: skip
    return pd.DataFrame(rows)


def _with_protocol(table: pd.DataFrame) -> pd.DataFrame:
    return table if "protocol" in table else table.assign(protocol="saebench")


def plot_probing(
    table: pd.DataFrame, layers: Mapping[str, tuple[str, int]], path: str | Path | None = None
) -> Any:
    """Mean test accuracy against k per layer under SAEBench's protocol (one panel per layer K, methods as
    lines, bars: standard error over tasks), the dense MLP input/output probes and the MLP's neurons as
    horizontal lines / a line in every panel. ``layers``: {source: (architecture key, K)}. Returns the
    Figure (saved to ``path`` when given)."""
    from matplotlib.figure import Figure

    from mxd_lens.layers import arch_label

    table = _with_protocol(table)
    table = table[table.protocol == "saebench"]
    neurons = table[table.source.str.startswith(NEURONS + ".") & (table.k != "all")]
    neuron_stats = neurons.groupby("k")["test_accuracy"].agg(["mean", "std", "count"])
    table = table[table.source.isin(layers) | (table.k == "all")]
    sparse = table[table.k != "all"].copy()
    sparse["shown"] = [arch_label(layers[s][0]) for s in sparse.source]  # the legend: labels, not keys
    sparse["K"] = [layers[s][1] for s in sparse.source]
    dense = table[table.k == "all"].groupby("source")["test_accuracy"].mean()
    Ks = sorted(sparse.K.unique())
    fig = Figure(figsize=(4.2 * len(Ks), 3.8), layout="tight")
    axes = fig.subplots(1, len(Ks), sharey=True, squeeze=False)
    for ax, K in zip(axes[0], Ks, strict=True):
        stats = sparse[sparse.K == K].groupby(["shown", "k"])["test_accuracy"]
        group = stats.mean().rename("mean").to_frame()
        group["se"] = stats.std(ddof=1) / stats.count() ** 0.5
        for shown, rows in group.reset_index().groupby("shown"):
            ax.errorbar(rows.k.astype(int), rows["mean"], yerr=rows["se"], marker="o", capsize=3, label=shown)
        if len(neuron_stats):
            ks_n = neuron_stats.index.astype(int)
            ax.errorbar(ks_n, neuron_stats["mean"], yerr=neuron_stats["std"] / neuron_stats["count"] ** 0.5,
                        marker="s", color="black", capsize=3, label="MLP neurons")  # fmt: skip
        for (source, acc), style in zip(dense.items(), ("--", ":", "-.", "--"), strict=False):
            ax.axhline(acc, color="gray", linestyle=style, label=f"dense {source} (all dims)")
        ax.set_title(f"K = {K}")
        ax.set_xlabel("k (features in the probe)")
        ax.set_xticks(sorted(sparse.k.astype(int).unique()))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"mean test accuracy ({table.task.nunique()} tasks)")
    axes[0][-1].legend(fontsize=8)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def paired_comparisons(table: pd.DataFrame, layers: Mapping[str, tuple[str, int]]) -> pd.DataFrame:
    """Each MxD (any gate) against each layer of another architecture at the same K: ``paired_difference``
    per k, one block per pair, its two layers named by their sources (``a``, ``b``) and architecture keys
    (``arch``, ``other_arch``). ``layers``: {source: (architecture key, K)}."""
    import pandas as pd

    frames = []
    for source, (arch, K) in layers.items():
        if _family(arch) != "mxd":
            continue
        for other_source, (other, other_K) in layers.items():
            if other_K == K and _family(other) != "mxd":
                frame = paired_difference(table, source, other_source)
                frames.append(frame.assign(K=int(K), arch=arch, other_arch=other, a=source, b=other_source))
    if not frames:
        return pd.DataFrame()
    cols = ["K", "arch", "other_arch", "a", "b", "k", "mean_difference", "se", "a_wins", "b_wins", "tasks"]
    return pd.concat(frames)[cols].sort_values(["K", "arch", "other_arch", "a", "b", "k"])

"""The evaluation study: saved layers, each spliced alone into the model on held-out text (the 'eval'
side of the training text's document split, or a text the layers never saw), measured by
:func:`mxd_lens.evaluation.evaluate` and recorded in each layer's folder; the table is printed."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mxd_lens.config import DEFAULT_MODEL
from mxd_lens.records import EvaluationRecord, TextRecord, TrainingRecord
from mxd_lens.studies import StudyIncomplete, StudyResult
from mxd_lens.studies.eval import EvalOptions

# the printed table; dead_fraction is headed "silent on N tokens" (it depends on N)
SHOWN = ("name", "ce_clean", "delta_ce", "kl", "zero_ablation_cost", "fvu", "l0", "always_on", "effective_units",
         "top1_fvu", "dead_fraction", "jacobian_cos", "ce_recovered_zero", "tokens")  # fmt: skip
NOTE = ("± : standard error over the evaluation's batches; zero-ablation ΔCE: CE with the MLP's output zeroed "
        "minus clean CE (what deleting the MLP costs)")  # fmt: skip


def run(model: Any, options: EvalOptions, out: Path | None = None, progress: bool = True) -> StudyResult:
    try:
        rows = evaluate_saved(model, options, progress=progress)
    except EvaluationNotRecorded as err:
        raise StudyIncomplete(str(err), eval_result(err.rows, recorded=False)) from err
    return eval_result(rows, recorded=options.write)


def eval_result(rows: list[dict[str, Any]], recorded: bool) -> StudyResult:
    """The rows as the table ``mxd-lens eval`` prints."""
    import pandas as pd

    from mxd_lens.studies.report import columns

    table = pd.DataFrame(rows)
    if "ce_zero_ablation" in table:
        table["zero_ablation_cost"] = table["ce_zero_ablation"] - table["ce_clean"]
    tokens = int(table["tokens"].iloc[0])
    skipped = int(table["skip_positions"].iloc[0]) if "skip_positions" in table else 0
    text = NOTE + (
        f"; the first {skipped} positions of every row left out of every metric" if skipped else ""
    )
    starts = sorted({int(v) for v in table["spliced_from"]}) if "spliced_from" in table else []
    if any(starts):
        text += (
            f"; each layer replaces the MLP from position {'/'.join(map(str, starts))} on (spliced_from: the "
            "first position it trained on; the MLP's own output before it, BOS)"
        )
    text += "\n\nrecorded in each layer's cfg.json (metadata.evaluations) and eval.json" if recorded else ""
    return StudyResult(name="eval", table=table, columns=columns(*SHOWN, se=("delta_ce", "kl"), dead_fraction=f"silent on {tokens:,} tokens"),
                       text=text, value=rows)  # fmt: skip


def recorded_model(record: dict[str, Any], folder: Path) -> str:
    """The model a layer's training record names, as ``load_model`` can load it from here: the name
    as recorded, or for a local file or folder not found from this directory, the absolute path
    recorded beside it; a ValueError naming the record when neither exists."""
    name = record.get("name") or DEFAULT_MODEL
    if record.get("kind") not in ("gguf", "hf_folder") or Path(name).expanduser().exists():
        return name
    if record.get("path") and Path(record["path"]).exists():
        return record["path"]
    if not ("/" in name or name.endswith(".gguf") or name.startswith((".", "~"))):
        return name  # not spelled as a path: load_model says what it accepts
    raise ValueError(
        f"the model {name!r} named in {folder / 'cfg.json'} (metadata.training.model) is not found from "
        f"{Path.cwd()}" + (f" nor at {record['path']}" if record.get("path") else "") + "; give --model"
    )


def evaluate_saved(model: Any, config: EvalOptions, progress: bool = True) -> list[dict[str, Any]]:
    """Evaluate the saved layer folders ``config.layers`` (or folders holding them) spliced into ``model``
    on held-out text and, with ``config.write``, record the result in each layer's cfg.json
    (``metadata.evaluations``; ``metadata.evaluation``: the latest: metrics, the text and split, tokens,
    the model's source, the library version) and in an eval.json beside it. One row per layer; an
    :class:`EvaluationNotRecorded` (holding the rows) when the folders cannot be written. Each row names
    its layer's architecture by its key (``arch``) beside ``evaluate``'s columns.

    A folder of another SAELens architecture (a transcoder trained elsewhere: ``mxd_lens.foreign``) is
    loaded with ``SAE.load_from_disk`` and evaluated alike. It has no mxd-lens training record, so its
    training text cannot be checked against the evaluation text: a warning says so (naming the
    ``dataset_path`` its SAELens metadata records, if any). Its record is written into its cfg.json's
    ``metadata`` as for ours: SAELens keeps unknown metadata keys, so the folder loads as before."""
    from mxd_lens.evaluation import evaluate
    from mxd_lens.layers.registry import layer_arch

    paths, layers, batches, eval_info = saved_layers_on_held_out(model, config)
    if batches:  # what the long part costs, said before it (none: evaluate says so)
        logging.getLogger(__name__).info("%s", evaluation_cost(layers, batches))
    rows = evaluate(model, layers, batches, skip_positions=config.skip_positions, progress=progress)
    # the architecture key with options (mxd:gate=topk), as every study table names it; ``architecture``
    # beside it is the SAELens name in cfg.json (mxd_lens.mxd)
    rows = [{"name": row["name"], "arch": layer_arch(layers[row["name"]]), **row} for row in rows]
    if config.write:
        try:
            _record_evaluations(paths, rows[: len(paths)], eval_info, config, model)
        except OSError as err:
            raise EvaluationNotRecorded(rows, err) from err
    return rows


def saved_layers_on_held_out(
    model: Any, config: EvalOptions
) -> tuple[list[Path], dict[str, Any], list[Any], dict[str, Any]]:
    """``config.layers``'s folders, the layers loaded from them (with ``config.compare``'s), checked to fit
    ``model`` and to have been trained on it and on other documents than the held-out ones, and the
    held-out token batches: ``(paths, layers by name, batches, the held-out text's record)``."""
    from mxd_lens import data, hooks
    from mxd_lens.config import StreamConfig
    from mxd_lens.evaluation import check_disjoint, held_out_batches
    from mxd_lens.layers.io import layer_folders, load_any_layer
    from mxd_lens.models import model_identity

    if config.eval_tokens <= 0:
        raise ValueError(f"--eval-tokens {config.eval_tokens}: evaluate at least one row of tokens")
    paths = layer_folders(config.layers)
    layers = {path.name: load_any_layer(path) for path in paths}
    for name in config.compare:  # published layers, on the same batches (their rows are not recorded)
        from mxd_lens.foreign import from_pretrained

        if name in layers:
            raise ValueError(f"--compare {name}: a layer folder has that name too")
        layers[name] = from_pretrained(name)
    for name, layer in layers.items():  # before reading any text: each layer fits this model
        try:
            hooks.check_fits(model, layer, hooks.block_of(layer))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    trained = [TrainingRecord.of(layer).text for layer in layers.values()]
    first = trained[0]
    text = config.text or _recorded_text(first, paths[0]) or str(data.default_text())
    same_text = config.text is None and first.text is not None

    def recorded(value: Any, default: Any) -> Any:  # the first layer's split setting for its own text
        return value if same_text and value is not None else default

    fraction = config.eval_fraction if config.eval_fraction is not None else (
        recorded(first.eval_fraction, StreamConfig.eval_fraction))  # fmt: skip
    seed = (
        config.split_seed
        if config.split_seed is not None
        else recorded(first.split_seed, StreamConfig.split_seed)
    )
    eval_info = {"text": data.text_name(text), "split": config.split, "eval_fraction": fraction, "split_seed": seed,
                 "digests": data.source_digests(text)}  # fmt: skip
    if config.split == "all":
        eval_info.update(split="eval", eval_fraction=1.0)  # every document held out
    for (name, layer), record in zip(layers.items(), trained, strict=True):
        if not record and not _ours(layer.cfg.architecture()):
            dataset = layer.cfg.metadata.dataset_path
            warnings.warn(
                f"{name} is a {layer.cfg.architecture()!r} layer from elsewhere: it has no mxd-lens training "
                + (f"record (its SAELens metadata names dataset_path={dataset!r})" if dataset else "record")
                + ", so overlap of its training text with the evaluation text cannot be ruled out",
                stacklevel=2,
            )
            continue
        try:
            check_disjoint(record, eval_info)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    if not config.allow_other_model:
        here = model_identity(model)
        for name, layer in layers.items():
            recorded = TrainingRecord.of(layer).model_source
            if "kind" in recorded and model_identity(recorded) != here:
                raise ValueError(
                    f"{name} was trained on {model_identity(recorded)}, but the model given is {here}: "
                    "another model (or another copy of its weights); evaluate with the model it was trained "
                    "on, or pass --allow-other-model to evaluate anyway (the record then names this model)"
                )
    batches = held_out_batches(model, text, config.split, config.eval_tokens, config.context_size,
                               config.rows_per_forward, fraction, seed)  # fmt: skip
    return paths, layers, batches, eval_info


def evaluation_cost(layers: Mapping[str, Any], batches: Sequence[Any]) -> str:
    """What ``evaluate(model, layers, batches)`` will cost, on one line: the held-out tokens and the
    model forwards (per batch one clean, one per layer spliced, one per block with the MLP zeroed and, at
    the end, one with it at its mean: ``evaluation.evaluate``'s docstring)."""
    from mxd_lens import hooks

    blocks = sorted({hooks.block_of(layer) for layer in layers.values()})
    n, rows = len(batches), sum(int(b.shape[0]) for b in batches)
    tokens = sum(int(b.numel()) for b in batches)
    spliced, ablated = n * len(layers), 2 * n * len(blocks)
    return (
        f"eval: {len(layers)} layer(s) at block(s) {', '.join(map(str, blocks))} on {tokens:,} held-out tokens "
        f"({rows:,} rows of {int(batches[0].shape[1])}) in {n:,} batches: {n + spliced + ablated:,} model "
        f"forwards ({n:,} clean, {spliced:,} spliced, {ablated:,} with the MLP zero- or mean-ablated, these "
        "from the block on); --eval-tokens sets the tokens"
    )


def _ours(architecture: Any) -> bool:
    """Whether ``architecture`` (a cfg's) is one of mxd-lens's."""
    from mxd_lens.layers import ARCHITECTURES

    return architecture in {cls.config_class.architecture() for cls in ARCHITECTURES.values()}


def _recorded_text(record: TextRecord, folder: Path) -> str | None:
    """The training text a layer records, as a source this process can read: a package resource name
    as it is, a path as recorded when it exists from here, else the absolute path recorded beside it;
    a recorded path found neither way is a ValueError that names where it came from."""
    from mxd_lens.data import PACKAGE_PREFIX, _looks_like_path

    text = record.text
    if text is None or str(text).startswith(PACKAGE_PREFIX) or Path(str(text)).expanduser().exists():
        return text
    if record.path and Path(record.path).exists():
        return record.path
    if _looks_like_path(str(text)) or record.path:
        raise ValueError(
            f"the training text {text!r} recorded in {folder / 'cfg.json'} (metadata.training.data.text) is not "
            f"found from {Path.cwd()}" + (f" nor at {record.path}" if record.path else "") + "; give --text"
        )
    return text  # a Hugging Face dataset name


def keep_evaluation(records: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``records`` (as cfg.json stores them) with ``record`` added, replacing one that is the same
    measurement (:meth:`EvaluationRecord.key`: the text by content and its side, tokens, context)."""
    key = EvaluationRecord.from_dict(record).key()
    return [dict(r) for r in records if r and EvaluationRecord.from_dict(r).key() != key] + [dict(record)]


class EvaluationNotRecorded(OSError):
    """The layers were evaluated but the result could not be written into their folders (read-only?);
    ``rows`` holds what was measured."""

    def __init__(self, rows: list[dict[str, Any]], err: OSError):
        super().__init__(
            f"measured, but not recorded in the layer folders ({err.strerror or err}: {err.filename}); "
            "the table above is the result; to only print it, add --nowrite"
        )
        self.rows = rows


def _record_evaluations(paths: Sequence[Path], rows: list[dict[str, Any]], eval_info: dict[str, Any],
                        config: Any, model: Any) -> None:  # fmt: skip
    for path, row in zip(paths, rows, strict=True):
        record_evaluation(path, row, {**eval_info, "split": config.split}, config.context_size,
                          config.skip_positions, model)  # fmt: skip


def record_evaluation(path: Path, row: dict[str, Any], text: dict[str, Any], context_size: int,
                      skip_positions: int, model: Any) -> None:  # fmt: skip
    """Record one evaluation (``row``: ``evaluate``'s row for the layer saved in ``path``, on ``text``:
    its source, side and split settings, as :class:`TextRecord` stores them) in the layer's cfg.json
    (``metadata.evaluations``; ``metadata.evaluation``: the latest) and in an eval.json beside it, as
    ``mxd-lens eval`` does; what the frontier and the demo record for the layers they train too."""
    from mxd_lens import __version__
    from mxd_lens.evaluation import EVAL_METRICS
    from mxd_lens.fileio import atomic_write_text, remove_abandoned_temporaries
    from mxd_lens.layers.io import read_layer_cfg
    from mxd_lens.models import model_source
    from mxd_lens.records import finite_json

    # left by a killed evaluation, whatever their age: those whose writer no longer holds their lock
    remove_abandoned_temporaries(path, ("cfg.json", "eval.json"))
    record = {
        "metrics": {k: row[k] for k in EVAL_METRICS if k in row},
        "text": text,
        "tokens": row["tokens"],
        "context_size": context_size,
        "skip_positions": skip_positions,
        "spliced_from": row.get("spliced_from", 0),
        "model": model_source(model),
        "mxd_lens_version": __version__,
    }
    cfg = read_layer_cfg(path)
    meta = cfg.setdefault("metadata", {})
    # one record per (text, split, tokens, context): evaluating on three texts keeps three; kept as
    # stored (a layer evaluated before there could be several has one "evaluation")
    earlier = meta.get("evaluations") or ([meta["evaluation"]] if meta.get("evaluation") else [])
    meta["evaluations"] = keep_evaluation(earlier, record)
    meta["evaluation"] = record  # the latest
    # strict JSON: a metric that is NaN (one batch's standard error, a top-1 FVU not known) as null
    atomic_write_text(path / "cfg.json", json.dumps(finite_json(cfg), indent=2, allow_nan=False))
    eval_json = finite_json({**record, "row": row})
    atomic_write_text(path / "eval.json", json.dumps(eval_json, indent=1, allow_nan=False))

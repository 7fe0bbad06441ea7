"""What every study's verb shares: where the model comes from, where results go, how many threads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxd_lens.config import HostOptions


@dataclass
class Where(HostOptions):
    """The model and where to write."""

    model: str | None = None
    """model name or path (default: the model the layers' training record or metadata names, else
    smollm2-135m)"""
    out: str = "results"
    """output folder (each study writes its own folder in it: OUT/probing, OUT/steering, ...)"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


@dataclass
class DemoWhere(Where):
    """The model and where to write."""

    out: str | None = None
    """output folder (default results/demo; results/demo-quick with --quick)"""


@dataclass
class Output:
    """Where to write (for studies that build their own model)."""

    out: str = "results"
    """output folder"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


@dataclass
class ModelOnly(HostOptions):
    """The model the layers replace MLPs of."""

    model: str | None = None
    """model name or path (default: the model the layers' training record or metadata names, else smollm2-135m)"""
    tl_name: str | None = None
    """for a .gguf file or folder: the TransformerLens official name whose architecture to build with
    (default: the one the training record names, if any)"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


def host_model(where: HostOptions, options: Any) -> Any:
    """The HookedTransformer ``--model`` names; without one, the model the study's saved layers
    (``options.layers`` or ``options.layer``) were trained on, loaded as their training record says
    (:func:`layers_model`), else the default model. The name is resolved from the layers' cfg.json
    before anything is loaded, and a name nothing can load is refused, naming the fix, before any
    model is read."""
    from mxd_lens.models import UnknownModelError, load_host

    if where.model:
        return load_host(where)
    name, recorded, origin = layers_model(layer_paths(options))
    try:
        return load_host(where, name=name, recorded=recorded)
    except UnknownModelError as err:
        if origin is None:
            raise
        raise UnknownModelError(
            f"{origin} names the model {name!r}, which cannot be loaded here ({err}); give --model: the "
            "model the layer was trained on, by a name load_model knows or the path of its .gguf file or folder"
        ) from None


TEXT_FIELDS = ("text", "eval_text", "ood_text", "data")
"""The option fields that name a text or data source (a file, a folder, a dataset)."""


def recorded_options(options: Any) -> dict[str, Any]:
    """A study's options as its record keeps them (``dataclasses.asdict``), each text or data source
    (:data:`TEXT_FIELDS`) named as training records name it (:func:`mxd_lens.data.text_name`): a local
    path given relative to the working folder is recorded absolute, so the record names it from
    anywhere; a dataset name or a file shipped with mxd-lens as before."""
    from dataclasses import asdict

    from mxd_lens.data import text_name

    record = asdict(options)
    for key in TEXT_FIELDS:
        value = record.get(key)
        if isinstance(value, str):
            record[key] = text_name(value)
        elif isinstance(value, list):
            record[key] = [text_name(v) if isinstance(v, str) else v for v in value]
    return record


def layer_paths(options: Any) -> list[str]:
    """The saved layers a study's options name (``layers``: a list or one folder; ``layer``)."""
    for attribute in ("layers", "layer"):
        value = getattr(options, attribute, None)
        if value:
            return [str(value)] if isinstance(value, (str, Path)) else [str(v) for v in value]
    return []


def layers_model(paths: Sequence[str | Path]) -> tuple[str, dict[str, Any] | None, str | None]:
    """(the model to load, the model source the layer's training record holds or None, where the name
    was read) for saved layers, from the first layer's cfg.json alone (nothing is loaded): the model its
    mxd-lens training record names (as :func:`mxd_lens.studies.eval.run.recorded_model` finds it from
    here); for a layer from elsewhere, the ``model_name`` of its SAELens metadata (``load_model`` takes
    any spelling of the default model's name); without layers, the default model."""
    from mxd_lens.config import DEFAULT_MODEL

    if not paths:
        return DEFAULT_MODEL, None, None
    from mxd_lens.layers.io import layer_folders, read_layer_cfg
    from mxd_lens.records import TrainingRecord
    from mxd_lens.studies.eval.run import _ours, recorded_model

    first = layer_folders(list(paths))[0]
    cfg = read_layer_cfg(first)
    meta = cfg.get("metadata") or {}
    record = TrainingRecord.from_dict(meta.get("training")).model_source
    if not record and meta.get("model_name") and not _ours(cfg.get("architecture")):  # from elsewhere
        return str(meta["model_name"]), None, f"{first / 'cfg.json'} (metadata.model_name)"
    origin = f"{first / 'cfg.json'} (metadata.training.model)" if record else None
    return recorded_model(record, first), record or None, origin

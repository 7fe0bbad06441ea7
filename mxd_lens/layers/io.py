"""Loading a saved layer with errors that say what is wrong with the folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME
from safetensors import safe_open

from mxd_lens.layers.base import MLPReplacement
from mxd_lens.records import EvaluationRecord, TrainingRecord


def load_layer(path: str | Path, device: str = "cpu", dtype: str | None = None) -> MLPReplacement:
    """Load an MxD / transcoder folder written by ``save_model``; ``sae_lens.SAE.load_from_disk``
    gives the same object once ``mxd_lens`` is imported, this adds clear errors for bad folders."""
    from mxd_lens.layers import ARCHITECTURES

    ours = [layer_cls.config_class.architecture() for layer_cls in ARCHITECTURES.values()]
    hint = "load other SAELens architectures with sae_lens.SAE.load_from_disk"
    return _load_checked(path, ours, "mxd-lens's", hint, device, dtype)


def load_any_layer(path: str | Path, device: str = "cpu", dtype: str | None = None) -> Any:
    """Load a layer folder of any SAELens architecture: ours as :func:`load_layer` does, any other (a
    transcoder trained elsewhere, see ``mxd_lens.foreign``) with ``sae_lens.SAE.load_from_disk``, after
    the same checks of the folder (what ``mxd-lens eval`` loads)."""
    from sae_lens.registry import SAE_CLASS_REGISTRY

    import mxd_lens.layers  # noqa: F401  (ours registered with SAELens)

    known = list(SAE_CLASS_REGISTRY)
    return _load_checked(
        path, known, "the SAELens architectures", "is it a SAELens layer folder?", device, dtype
    )


def _load_checked(
    path: str | Path, known: list[str], whose: str, hint: str, device: str, dtype: str | None
) -> Any:
    """``SAE.load_from_disk(path)`` once the folder holds both files, cfg.json is JSON naming one of the
    ``known`` architectures and the weights' header reads; a clear error naming the file otherwise."""
    from sae_lens import SAE

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a folder; expected one holding {SAE_CFG_FILENAME} and {SAE_WEIGHTS_FILENAME}"
        )
    missing = [name for name in (SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME) if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} lacks {missing}; a saved layer holds {SAE_CFG_FILENAME} and {SAE_WEIGHTS_FILENAME}"
        )
    try:
        cfg = json.loads((path / SAE_CFG_FILENAME).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / SAE_CFG_FILENAME} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(
            f"{path / SAE_CFG_FILENAME} holds a JSON {type(cfg).__name__}, not an object: not a saved layer's cfg"
        )
    architecture = cfg.get("architecture")
    if architecture not in known:
        raise ValueError(f"{path} holds architecture {architecture!r}, not one of {whose} {known}; {hint}")
    weights = path / SAE_WEIGHTS_FILENAME
    try:  # reads only the header, which also says how long the file must be
        with safe_open(weights, framework="pt") as f:
            f.keys()
    except Exception as err:  # safetensors' own SafetensorError: bad header, file cut short, ...
        raise ValueError(
            f"{weights} is not a readable safetensors file (truncated or damaged?): {err}"
        ) from None
    layer = SAE.load_from_disk(path, device=device, dtype=dtype)
    check_finite(layer, path)
    layer.mxd_lens_folder = str(path)  # where it was loaded from: what evaluate's messages name
    return layer


class NonFiniteLayerError(ValueError):
    """A layer holds NaN or infinite parameters (diverged in training, or damaged); the message names
    the folder (or the layer) and the tensor."""


def check_finite(layer: Any, where: str | Path) -> None:
    """Raise a :class:`NonFiniteLayerError` naming ``where`` (its folder, or its name) and the tensor
    when any floating-point parameter or buffer of ``layer`` (ours or any SAELens layer: weights, biases,
    JumpReLU / BatchTopK thresholds) is NaN or infinite: such a layer's metrics would be NaN or absurd."""
    import torch

    for name, tensor in layer.state_dict().items():
        if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
            continue
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise NonFiniteLayerError(
            f"{where}: its {name} holds {nan:,} NaN and {inf:,} infinite of {tensor.numel():,} values (a layer "
            "that diverged in training, or a damaged file); mxd-lens does not load or evaluate it"
        )


def layer_folders(paths: str | Path | list[str | Path]) -> list[Path]:
    """Layer folders (with a cfg.json) among ``paths``, or one level down in them (as a trainer's
    ``final/`` or the frontier's ``runs/*/final/``); a clear error for a path with none, or for two
    layers of the same folder name."""
    found: dict[str, Path] = {}
    for path in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if (path / SAE_CFG_FILENAME).is_file():
            folders = [path]
        else:
            folders = sorted(p.parent for p in path.glob(f"*/{SAE_CFG_FILENAME}"))
        if not folders:
            raise FileNotFoundError(
                f"{path}: no saved layer (a folder with {SAE_CFG_FILENAME}) here or one level down"
            )
        for folder in folders:
            if folder.name in found:
                raise ValueError(
                    f"two layers are named {folder.name!r} ({found[folder.name]}, {folder}); give folders with distinct names"
                )
            found[folder.name] = folder
    return list(found.values())


def check_layer_folder(folder: str | Path) -> str | None:
    """What stops ``folder`` from loading as one of our layers (None: it loads): a missing or damaged
    file, an architecture we do not know, weights whose shapes disagree with cfg.json."""
    try:
        load_layer(folder)
    except Exception as err:
        message = " ".join(str(err).split())
        return message if str(folder) in message else f"{folder}: {message}"
    return None


def load_layers(
    paths: str | Path | list[str | Path], device: str = "cpu", foreign: bool = False
) -> dict[str, Any]:
    """Layers by folder name from layer folders, or folders holding them one level down (as a
    trainer's ``final/`` or the frontier's ``runs/*/final/``): mxd-lens's, and with ``foreign`` also
    any other SAELens layer folder (:func:`load_any_layer`; what the studies accept)."""
    load = load_any_layer if foreign else load_layer
    return {folder.name: load(folder, device=device) for folder in layer_folders(paths)}


def describe_layer(folder: str | Path) -> Any:
    """A saved layer's record as a two-column table (field, value), read from its cfg.json: the
    architecture and sizes, model and hooks, the training record (config, data and digests, tokens,
    epochs, the model's source, the library version) and, once ``mxd-lens eval`` ran, its results."""
    import pandas as pd

    path = Path(folder)
    try:
        cfg = json.loads((path / SAE_CFG_FILENAME).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} holds no {SAE_CFG_FILENAME}: not a saved layer") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path / SAE_CFG_FILENAME} is not valid JSON (truncated or damaged?): {err}"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(
            f"{path / SAE_CFG_FILENAME} holds a JSON {type(cfg).__name__}, not an object: not a saved layer's cfg"
        )
    meta = cfg.get("metadata") or {}
    saved_training = meta.get("training")
    training = TrainingRecord.from_dict(saved_training)
    rows: list[tuple[str, Any]] = [
        ("architecture", cfg.get("architecture")),
        ("arch (--arch), as tables name it", _arch_with_options(cfg)),
        ("d_in -> d_out", f"{cfg.get('d_in')} -> {cfg.get('d_out')}"),
        ("units (d_sae), K", f"{cfg.get('d_sae')}, {cfg.get('k')}"),
        ("model", meta.get("model_name")),
        ("hooks", f"{meta.get('hook_name')} -> {meta.get('hook_name_out')}"),
        ("mxd-lens version", meta.get("mxd_lens_version")),
    ]
    source = training.model_source
    for key in ("name", "kind", "sha256", "revision", "config_sha256"):
        if key in source:
            rows.append((f"model source: {key}", source[key]))
    text = training.text
    if text:
        rows.append(("training text", text.describe()))
        for name, digest in (text.digests or {}).items():
            rows.append((f"digest of {name}", digest))
    if saved_training:
        rows += [("tokens seen", f"{training.tokens:,}"), ("steps", training.steps),
                 ("epochs", None if training.epochs is None else f"{training.epochs:.2f}")]  # fmt: skip
        for key, value in (training.config or {}).items():
            if value is not None:
                rows.append((f"train: {key}", value))
        for key, value in (training.metrics or {}).items():
            rows.append((f"last training {key}", f"{value:.4g}"))
    evaluations = EvaluationRecord.all_of(meta)
    for number, record in enumerate(evaluations, start=1):
        prefix = "eval" if len(evaluations) == 1 else f"eval {number}"
        rows.append(
            (
                "evaluated on" if len(evaluations) == 1 else f"evaluation {number} on",
                f"{record.text.text} ({record.text.split} side), {record.tokens:,} tokens",
            )
        )
        for key, value in record.metrics.items():
            rows.append((f"{prefix}: {key}", f"{value:.4g}" if isinstance(value, float) else value))
    if not evaluations:
        rows.append(("evaluation", "none yet (mxd-lens eval FOLDER)"))
    return pd.DataFrame([(k, "—" if v is None else str(v)) for k, v in rows], columns=["field", "value"])


def _arch_with_options(cfg: dict[str, Any]) -> str | None:
    """A saved layer's architecture key with the options it was built with (its config's variant fields
    that differ from their defaults), as ``--arch`` takes it, and the label tables give it:
    ``mxd:gate=topk,gate_standardize=0.1 (MxD (gate=topk, gate_standardize=0.1))``, so the paper's
    MxD and the recommended one do not look alike. A SAELens architecture not ours: ``sae_lens.NAME``."""
    import dataclasses

    from mxd_lens.layers.registry import ARCHITECTURES, arch_label, format_arch

    architecture = cfg.get("architecture")
    for key, layer_cls in ARCHITECTURES.items():
        config_cls = layer_cls.config_class
        if config_cls.architecture() != architecture:
            continue
        defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
        options = {
            name: cfg[name]
            for name in config_cls.variant_fields
            if name in cfg and cfg[name] != defaults.get(name, dataclasses.MISSING)
        }
        arch = format_arch(key, options)
        return f"{arch} ({arch_label(arch)})"
    return None if architecture is None else f"sae_lens.{architecture}"


def damaged_files(folder: str | Path) -> list[str]:
    """What is wrong with a saved layer folder's two files (empty: both read): cfg.json not a JSON
    object, sae_weights.safetensors without a readable header or shorter than its header says."""
    folder = Path(folder)
    problems = []
    cfg = folder / SAE_CFG_FILENAME
    if cfg.is_file():
        try:
            if not isinstance(json.loads(cfg.read_text()), dict):
                problems.append(f"{cfg} does not hold a JSON object")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            problems.append(f"{cfg} is not valid JSON (truncated or damaged?): {err}")
    weights = folder / SAE_WEIGHTS_FILENAME
    if weights.is_file():
        try:
            with safe_open(weights, framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors' own SafetensorError
            problems.append(f"{weights} is not a readable safetensors file (truncated or damaged?): {err}")
    return problems


class DamagedLayerError(ValueError):
    """A saved layer's cfg.json or weights file cannot be read; the message names the file."""


class LayerFolderError(ValueError):
    """A saved layer's files read but do not make a layer (weights missing, of another shape than its
    cfg.json says, refused by the layer); the message names the folder, on one line."""


def _named_folder_error(path: str | Path, err: BaseException) -> BaseException:
    """``err`` (raised while building the layer of folder ``path``) as one line naming the folder: a
    :class:`LayerFolderError`, or ``err`` itself when it already names the folder."""
    message = " ".join(str(err).split())
    if str(path) in message:
        return err
    if isinstance(err, KeyError):
        message = f"{SAE_WEIGHTS_FILENAME} lacks the tensor {message}"
    elif isinstance(err, RuntimeError) and "state_dict" in message:  # PyTorch's load_state_dict message
        message = (
            f"the weights in {SAE_WEIGHTS_FILENAME} do not fit the layer its {SAE_CFG_FILENAME} describes "
            f"(saved by another architecture or another size, or damaged?): {message}"
        )
    return LayerFolderError(f"{path}: {message}")


_WRAPPED = "_mxd_lens_names_damaged_files"


def name_damaged_files_in_sae_lens_loaders() -> None:
    """Make ``SAE.load_from_disk`` and ``SAE.from_pretrained`` name the damaged file when they fail on
    one (SAELens raises a bare ``JSONDecodeError`` / ``SafetensorError``): the error is re-raised as a
    :class:`DamagedLayerError` (a ``ValueError``) naming the file, with the original chained; for a hub
    download it also says to pass ``force_download=True``. A folder whose files read but do not make a
    layer (PyTorch's state-dict message for missing or mis-shaped weights, a layer's own refusal of its
    weights) is a :class:`LayerFolderError` naming the folder, on one line. Other errors pass through
    unchanged. Installed once, when our architectures are registered."""
    from sae_lens import SAE

    disk = SAE.__dict__["load_from_disk"]
    hub = SAE.__dict__["from_pretrained_with_cfg_and_sparsity"]
    if getattr(disk.__func__, _WRAPPED, False):
        return
    load_from_disk, from_hub = disk.__func__, hub.__func__

    def checked_load_from_disk(cls: Any, path: str | Path, *args: Any, **kwargs: Any) -> Any:
        try:
            return load_from_disk(cls, path, *args, **kwargs)
        except Exception as err:
            problems = damaged_files(path) if Path(path).is_dir() else []
            if problems:
                raise DamagedLayerError("; ".join(problems)) from err
            if Path(path).is_dir() and isinstance(err, (RuntimeError, ValueError, KeyError)):
                raise _named_folder_error(path, err) from err
            raise

    def checked_from_hub(cls: Any, release: str, sae_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return from_hub(cls, release, sae_id, *args, **kwargs)
        except Exception as err:
            folder = _hub_cache_folder(release, sae_id)
            problems = damaged_files(folder) if folder is not None else []
            if problems:
                raise DamagedLayerError(
                    "; ".join(problems) + f" (the hub cache's copy of {release}/{sae_id}): download it again "
                    f"with SAE.from_pretrained({release!r}, {sae_id!r}, force_download=True)"
                ) from err
            raise

    for wrapper, original in ((checked_load_from_disk, load_from_disk), (checked_from_hub, from_hub)):
        wrapper.__doc__, wrapper.__name__ = original.__doc__, original.__name__
        setattr(wrapper, _WRAPPED, True)
    SAE.load_from_disk = classmethod(checked_load_from_disk)
    SAE.from_pretrained_with_cfg_and_sparsity = classmethod(checked_from_hub)


def _hub_cache_folder(release: str, sae_id: str) -> Path | None:
    """The local hub-cache folder holding ``release`` (a repo id) / ``sae_id``'s cfg.json, if cached."""
    if "/" not in release:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(release, f"{sae_id}/{SAE_CFG_FILENAME}")
    except Exception:
        return None
    return Path(found).parent if isinstance(found, str) else None

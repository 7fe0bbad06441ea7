"""A saved layer's folder read from its files alone, without building the layer: no torch, SAELens or
TransformerLens, so ``mxd-lens info`` answers at once.

A saved layer is SAELens's folder: ``cfg.json`` (the config, with the training record and evaluations
in its ``metadata``) and ``sae_weights.safetensors``. For a built-in architecture (``BUILT_IN``: what each
writes, tested against the layers themselves) :func:`check_folder` finds from the files what
``mxd_lens.layers.io.load_layer`` would refuse: a missing or damaged file, sizes the layer refuses,
weights of other names or shapes than cfg.json's sizes make, NaN or infinite weights (not the other
config values a layer class refuses, such as an MxD's gate or activation name: loading says those). A
folder of any other architecture (a plug-in's, SAELens's) is loaded to check it, which imports torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CFG_FILENAME = "cfg.json"  # SAELens's names (sae_lens.constants; tests/test_info.py checks them)
WEIGHTS_FILENAME = "sae_weights.safetensors"

Shapes = dict[str, tuple[int, ...]]


def _dictionary(cfg: dict[str, Any]) -> Shapes:
    """What every layer has (``MLPReplacement.init_dictionary``): the encoder and the dictionary."""
    d_in, d_sae, d_out = cfg["d_in"], cfg["d_sae"], cfg["d_out"]
    return {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}


def _mxd(cfg: dict[str, Any]) -> Shapes:
    d_in, d_hidden, d_out = cfg["d_in"], cfg["d_hidden"], cfg["d_out"]
    glu = {"W_in_gate": (d_in, d_hidden), "b_in_gate": (d_hidden,)} if cfg.get("hidden_form") == "glu" else {}
    return {
        "W_in": (d_in, d_hidden),
        "b_in": (d_hidden,),
        **glu,
        "W_out": (d_hidden, d_out),
        **_dictionary(cfg),
    }


@dataclass(frozen=True)
class BuiltIn:
    """What a built-in architecture's folder holds, as its layer class says it (``mxd_lens.layers``)."""

    key: str  # its key in mxd_lens.ARCHITECTURES
    label: str  # the class's ``label``: how tables name it
    class_name: str  # the layer class
    config_name: str  # its config class
    variants: dict[str, Any]  # the config's variant_fields and their defaults
    tensors: Callable[[dict[str, Any]], Shapes]  # cfg.json -> the weights' names and shapes
    sizes: tuple[str, ...] = ("d_in", "d_out", "d_sae")  # positive ints the shapes are made of


BUILT_IN: dict[str, BuiltIn] = {  # by the architecture name cfg.json holds
    "mxd_lens.mxd": BuiltIn(
        "mxd", "MxD", "MxD", "MxDConfig",
        {"gate": "relu_topk", "balance_rate": 0.0, "balance_target": None, "gate_standardize": 0.0},
        _mxd, ("d_in", "d_out", "d_sae", "d_hidden"),
    ),
    "mxd_lens.topk_transcoder": BuiltIn(
        "transcoder", "Transcoder", "TopKTranscoder", "TopKTranscoderConfig", {}, _dictionary
    ),
    "mxd_lens.skip_transcoder": BuiltIn(
        "skip_transcoder", "Skip transcoder", "TopKSkipTranscoder", "TopKSkipTranscoderConfig", {},
        lambda cfg: {**_dictionary(cfg), "W_skip": (cfg["d_in"], cfg["d_out"])},
    ),
    "mxd_lens.batchtopk_transcoder": BuiltIn(
        "batchtopk_transcoder", "BatchTopK transcoder", "BatchTopKTranscoder", "BatchTopKTranscoderConfig",
        {"topk_threshold_lr": 0.01}, lambda cfg: {**_dictionary(cfg), "threshold": (cfg["d_sae"],)},
    ),
}  # fmt: skip


def layer_folders(paths: str | Path | list[str | Path]) -> list[Path]:
    """Layer folders (with a cfg.json) among ``paths``, or one level down in them (as a trainer's
    ``final/`` or the frontier's ``runs/*/final/``); a clear error for a path with none, or for two
    layers of the same folder name."""
    found: dict[str, Path] = {}
    for path in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if (path / CFG_FILENAME).is_file():
            folders = [path]
        else:
            folders = sorted(p.parent for p in path.glob(f"*/{CFG_FILENAME}"))
        if not folders:
            raise FileNotFoundError(
                f"{path}: no saved layer (a folder with {CFG_FILENAME}) here or one level down"
            )
        for folder in folders:
            if folder.name in found:
                raise ValueError(
                    f"two layers are named {folder.name!r} ({found[folder.name]}, {folder}); give folders with distinct names"
                )
            found[folder.name] = folder
    return list(found.values())


def read_layer_cfg(folder: str | Path) -> dict[str, Any]:
    """A saved layer's cfg.json as a dict: every place mxd-lens reads one reads it here, so a missing,
    damaged, undecodable or too deeply nested file, or one not holding a JSON object, is an error that
    names the file (FileNotFoundError, ValueError)."""
    from mxd_lens.fileio import read_json

    path = Path(folder) / CFG_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{Path(folder)} holds no {CFG_FILENAME}: not a saved layer")
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object: not a saved layer's cfg")
    return cfg


class NotBuiltIn(Exception):
    """The folder's architecture is not one of the built-in ones: only loading it can check it
    (``mxd_lens.layers.io.check_layer_folder``, which imports torch)."""


def check_folder(folder: str | Path) -> str | None:
    """What stops ``folder`` from loading as one of our built-in layers (None: nothing), on one line naming
    the folder or file, read from the files (no torch). ``NotBuiltIn`` for any other architecture."""
    try:
        known = _check_files(Path(folder))
    except ValueError as err:
        message = " ".join(str(err).split())
        return message if str(folder) in message else f"{folder}: {message}"
    if not known:
        raise NotBuiltIn(str(folder))
    return None


def _check_files(path: Path) -> bool:
    """Raise a ValueError saying what is wrong with the layer folder ``path``; True when it holds a
    built-in architecture with nothing wrong, False when its architecture is not a built-in one."""
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a folder; expected one holding {CFG_FILENAME} and {WEIGHTS_FILENAME}"
        )
    missing = [name for name in (CFG_FILENAME, WEIGHTS_FILENAME) if not (path / name).is_file()]
    if missing:
        raise ValueError(f"{path} lacks {missing}; a saved layer holds {CFG_FILENAME} and {WEIGHTS_FILENAME}")
    cfg = read_layer_cfg(path)
    built = BUILT_IN.get(cfg.get("architecture"))
    if built is None:
        return False
    got = weight_shapes(path / WEIGHTS_FILENAME)
    for name in built.sizes:
        value = cfg.get(name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{built.config_name}.{name} must be a positive int, got {value!r}")
    k = cfg.get("k", 32)
    if not isinstance(k, int) or not 0 < k <= cfg["d_sae"]:
        raise ValueError(f"{built.config_name}.k must satisfy 0 < k <= d_sae={cfg['d_sae']}, got k={k!r}")
    if built.key == "mxd" and cfg.get("hidden_form", "mlp") not in ("mlp", "glu"):
        raise ValueError(f"MxDConfig.hidden_form must be 'mlp' or 'glu', got {cfg['hidden_form']!r}")
    expected = built.tensors(cfg)
    if expected != got:  # the words of MLPReplacement.process_state_dict_for_loading
        wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        raise ValueError(
            f"{path}: weights do not fit {built.class_name}({cfg['architecture']!r}): missing "
            f"{sorted(set(expected) - set(got))}, unexpected {sorted(set(got) - set(expected))}, wrong shape "
            f"{[(k, got[k], expected[k]) for k in wrong]}; was the folder saved by another architecture?"
        )
    for name, nan, inf, size in non_finite(path / WEIGHTS_FILENAME):
        raise ValueError(non_finite_message(path, name, nan, inf, size))
    return True


def weight_shapes(path: Path) -> Shapes:
    """The tensors of a safetensors file by name, with their shapes, from its header (which safetensors
    checks against the file's length); a ValueError naming the file when it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # safetensors' own SafetensorError: bad header, file cut short, ...
        raise ValueError(
            f"{path} is not a readable safetensors file (truncated or damaged?): {err}"
        ) from None


# a float's bits by safetensors dtype: (the unsigned integer of its size, exponent bits, mantissa bits);
# all exponent bits set is infinite (mantissa 0) or NaN
_FLOAT_BITS = {
    "F64": ("<u8", 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
    "F32": ("<u4", 0x7F80_0000, 0x007F_FFFF),
    "F16": ("<u2", 0x7C00, 0x03FF),
    "BF16": ("<u2", 0x7F80, 0x007F),
}


def non_finite(path: Path) -> list[tuple[str, int, int, int]]:
    """(name, NaN count, infinite count, size) of each floating-point tensor of the safetensors file
    ``path`` that holds NaN or infinite values, by name; read from the bits, so bfloat16 too, without
    torch (a file whose header reads: :func:`weight_shapes` first)."""
    import numpy as np

    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    found = []
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        if info["dtype"] not in _FLOAT_BITS:
            continue
        unsigned, exponent, mantissa = _FLOAT_BITS[info["dtype"]]
        kind = np.dtype(unsigned)
        begin, end = info["data_offsets"]
        size = (end - begin) // kind.itemsize
        if size == 0:
            continue
        bits = np.memmap(path, dtype=kind, mode="r", offset=8 + length + begin, shape=(size,))
        exponent, mantissa = kind.type(exponent), kind.type(mantissa)
        nan = inf = 0
        for start in range(0, size, 1 << 22):  # a bounded chunk at a time: a layer may be GBs
            chunk = bits[start : start + (1 << 22)]
            special = (chunk & exponent) == exponent
            if special.any():
                is_nan = (chunk & mantissa) != 0
                nan += int((special & is_nan).sum())
                inf += int((special & ~is_nan).sum())
        if nan or inf:
            found.append((name, nan, inf, size))
    return found


def non_finite_message(where: str | Path, name: str, nan: int, inf: int, size: int) -> str:
    """What a layer with NaN or infinite values in its tensor ``name`` is told (``where``: its folder)."""
    return (
        f"{where}: its {name} holds {nan:,} NaN and {inf:,} infinite of {size:,} values (a layer that diverged "
        "in training, or a damaged file); mxd-lens does not load or evaluate it"
    )


def format_arch(key: str, options: dict[str, Any] | None = None) -> str:
    """``"mxd"`` or ``"mxd:balance_rate=0.001,gate=topk"`` (fields sorted): an architecture key with
    options as ``--arch`` takes it (``mxd_lens.layers.parse_arch`` reads it back)."""
    if not options:
        return key
    return key + ":" + ",".join(f"{name}={format_value(options[name])}" for name in sorted(options))


def label_with_options(label: str, options: dict[str, Any]) -> str:
    """How tables and plots name an architecture with options: ``MxD``, ``MxD (gate=topk)``."""
    if not options:
        return label
    return f"{label} ({', '.join(f'{n}={format_value(options[n])}' for n in sorted(options))})"


def format_value(value: Any) -> str:
    """An option's value as ``--arch`` spells it: none, true/false, floats by ``g``."""
    return (
        "none"
        if value is None
        else str(value).lower()
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def arch_with_options(cfg: dict[str, Any]) -> str | None:
    """A saved layer's architecture key with the options it was built with (its config's variant fields
    that differ from their defaults), as ``--arch`` takes it, and the label tables give it:
    ``mxd:gate=topk,gate_standardize=0.1 (MxD (gate=topk, gate_standardize=0.1))``, so the paper's
    MxD and the recommended one do not look alike. A SAELens architecture not ours: ``sae_lens.NAME``."""
    architecture = cfg.get("architecture")
    built = BUILT_IN.get(architecture)
    if built is not None:
        options = {
            name: cfg[name]
            for name, default in built.variants.items()
            if name in cfg and cfg[name] != default
        }
        return f"{format_arch(built.key, options)} ({label_with_options(built.label, options)})"
    registry = sys.modules.get("mxd_lens.layers.registry")
    if registry is not None:  # loaded (a plug-in's layers registered): look there; never imported from here
        import dataclasses

        for key, layer_cls in registry.ARCHITECTURES.items():
            config_cls = layer_cls.config_class
            if config_cls.architecture() != architecture:
                continue
            defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
            options = {
                name: cfg[name]
                for name in config_cls.variant_fields
                if name in cfg and cfg[name] != defaults.get(name, dataclasses.MISSING)
            }
            return f"{format_arch(key, options)} ({label_with_options(layer_cls.label, options)})"
    return None if architecture is None else f"sae_lens.{architecture}"


def describe_layer(folder: str | Path) -> Any:
    """A saved layer's record as a two-column table (field, value), read from its cfg.json: the
    architecture and sizes, model and hooks, the training record (config, data and digests, tokens,
    epochs, the model's source, the library version) and, once ``mxd-lens eval`` ran, its results."""
    import pandas as pd

    from mxd_lens.records import EvaluationRecord, TrainingRecord

    cfg = read_layer_cfg(folder)
    meta = cfg.get("metadata") or {}
    saved_training = meta.get("training")
    training = TrainingRecord.from_dict(saved_training)
    rows: list[tuple[str, Any]] = [
        ("architecture", cfg.get("architecture")),
        ("arch (--arch), as tables name it", arch_with_options(cfg)),
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

"""Loading a saved layer with errors that say what is wrong with the folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME
from safetensors import safe_open

from mxd_lens.layers.base import MLPReplacement

# describe_layer, layer_folders and read_layer_cfg read files without torch (`mxd-lens info` imports them
# from mxd_lens.saved_layers); they are named here too
from mxd_lens.saved_layers import describe_layer, layer_folders, non_finite_message, read_layer_cfg  # noqa: F401


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
    cfg = read_layer_cfg(path)
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
        raise NonFiniteLayerError(non_finite_message(where, name, nan, inf, tensor.numel()))


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


def damaged_files(folder: str | Path) -> list[str]:
    """What is wrong with a saved layer folder's two files (empty: both read): cfg.json not a JSON
    object, sae_weights.safetensors without a readable header or shorter than its header says."""
    folder = Path(folder)
    problems = []
    cfg = folder / SAE_CFG_FILENAME
    if cfg.is_file():
        try:
            read_layer_cfg(folder)
        except ValueError as err:
            problems.append(str(err))
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

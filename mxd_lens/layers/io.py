"""Loading a saved layer with errors that say what is wrong with the folder."""

from __future__ import annotations

import json
from pathlib import Path

from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME
from safetensors import safe_open

from mxd_lens.layers.base import MLPReplacement


def load_layer(path: str | Path, device: str = "cpu", dtype: str | None = None) -> MLPReplacement:
    """Load an MxD / transcoder folder written by ``save_model``; ``sae_lens.SAE.load_from_disk``
    gives the same object once ``mxd_lens`` is imported, this adds clear errors for bad folders."""
    from sae_lens import SAE

    from mxd_lens.layers import ARCHITECTURES

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
    ours = [layer_cls.config_class.architecture() for layer_cls in ARCHITECTURES.values()]
    architecture = cfg.get("architecture") if isinstance(cfg, dict) else None
    if architecture not in ours:
        raise ValueError(
            f"{path} holds architecture {architecture!r}, not one of mxd-lens's {ours}; "
            "load other SAELens architectures with sae_lens.SAE.load_from_disk"
        )
    weights = path / SAE_WEIGHTS_FILENAME
    try:  # reads only the header, which also says how long the file must be
        with safe_open(weights, framework="pt") as f:
            f.keys()
    except Exception as err:  # safetensors' own SafetensorError: bad header, file cut short, ...
        raise ValueError(
            f"{weights} is not a readable safetensors file (truncated or damaged?): {err}"
        ) from None
    return SAE.load_from_disk(path, device=device, dtype=dtype)


def load_layers(paths: str | Path | list[str | Path], device: str = "cpu") -> dict[str, MLPReplacement]:
    """Layers by folder name from layer folders, or folders holding them one level down (as a
    trainer's ``final/`` or the frontier's ``runs/*/final/``)."""
    found: dict[str, MLPReplacement] = {}
    for path in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        folders = (
            [path]
            if (path / SAE_CFG_FILENAME).is_file()
            else sorted(p.parent for p in path.glob(f"*/{SAE_CFG_FILENAME}"))
        )
        if not folders:
            raise FileNotFoundError(
                f"{path}: no saved layer (a folder with {SAE_CFG_FILENAME}) here or one level down"
            )
        for folder in folders:
            if folder.name in found:
                raise ValueError(
                    f"two layers are named {folder.name!r} ({folder}); give folders with distinct names"
                )
            found[folder.name] = load_layer(folder, device=device)
    return found

"""Crash-safe checkpoint folders, shared by every trainer in the library.

``checkpoints/step_000001000/`` is written as ``.tmp-step_000001000/`` and renamed, then the text file
``checkpoints/latest`` is replaced atomically to name it: a crash at any moment leaves the previous
checkpoint complete and ``latest`` pointing at it. Older folders beyond ``keep`` are removed last.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


class CheckpointError(OSError):
    """A checkpoint could not be written; the previous one is intact and still ``latest``."""


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_checkpoint(checkpoint_dir: str | Path, marker: str | None = None) -> Path | None:
    """The folder ``checkpoint_dir/latest`` names, if it exists (and holds ``marker``, when given)."""
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir / pointer.read_text().strip()
    ok = (path / marker).is_file() if marker else path.is_dir()
    return path if ok else None


def save_checkpoint_dir(checkpoint_dir: Path, step: int, fill: Callable[[Path], None], keep: int) -> Path:
    """``fill(folder)`` writes the state into a fresh temporary folder, which becomes ``step_N`` and
    ``latest``; on an OSError nothing changes and ``CheckpointError`` names the last good checkpoint."""
    final = checkpoint_dir / f"step_{step:09d}"
    tmp = checkpoint_dir / f".tmp-step_{step:09d}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fill(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomic(checkpoint_dir / "latest", final.name)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {final.name} ({err}); the last good checkpoint is "
            f"{latest_checkpoint(checkpoint_dir) or 'none'}"
        ) from err
    for old in sorted(checkpoint_dir.glob("step_*"))[: -max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final

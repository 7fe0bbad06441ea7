"""Writing files so that a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Have ``write(tmp)`` write a uniquely named temporary file next to ``path``, fsync it, then
    rename it onto ``path`` (atomic within one file system).

    The file gets the mode ``open()`` would give it (0o666 less the umask), not mkstemp's 0600, so
    files shared with others stay readable. On any error the temporary file is removed and the error
    re-raised; ``path`` is left as it was. Concurrent writers each use their own temporary name.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as written:  # on disk before the rename makes it visible
            os.fsync(written.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`atomic_write` does."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, as :func:`atomic_write` does."""
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def _umask() -> int:
    # The process umask can only be read by setting it; set it back at once.
    umask = os.umask(0)
    os.umask(umask)
    return umask


def remove_stale_temporaries(
    folder: str | Path, names: tuple[str, ...], older_than_s: float = 300.0
) -> list[Path]:
    """Remove the temporaries :func:`atomic_write` left for ``names`` in ``folder`` when its process was
    killed (``.NAME.XXXX.tmp``), if older than ``older_than_s`` (a live writer's are seconds old).
    Returns what was removed."""
    import time

    now, removed = time.time(), []
    for name in names:
        for tmp in Path(folder).glob(f".{name}.*.tmp"):
            try:
                if now - tmp.stat().st_mtime > older_than_s:
                    tmp.unlink()
                    removed.append(tmp)
            except FileNotFoundError:  # its writer finished meanwhile
                pass
    return removed


def file_digest(path: str | Path, algorithm: str = "sha256", **params: int) -> str:
    """The hex digest of a file's bytes (``hashlib.new(algorithm, **params)``, e.g. ``"blake2b",
    digest_size=32``), read in 8 MiB chunks: the one file hasher of the library."""
    h = hashlib.new(algorithm, **params) if params else hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def atomic_to_csv(table: object, path: str | Path, **kwargs: object) -> None:
    """``table.to_csv(path, **kwargs)`` (a pandas DataFrame) written atomically, as :func:`atomic_write`."""
    atomic_write(path, lambda tmp: table.to_csv(tmp, **kwargs))  # type: ignore[attr-defined]

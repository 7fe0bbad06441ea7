"""Writing files so that a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock on temporaries
    fcntl = None  # type: ignore[assignment]


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Have ``write(tmp)`` write a uniquely named temporary file next to ``path``, fsync it, then
    rename it onto ``path`` (atomic within one file system).

    The file gets the mode ``open()`` would give it (0o666 less the umask), not mkstemp's 0600, so
    files shared with others stay readable. On any error the temporary file is removed and the error
    re-raised; ``path`` is left as it was. Concurrent writers each use their own temporary name. The
    writer holds a lock on its temporary file (where ``fcntl`` exists) until the rename, so the one a
    killed writer left is told from a live writer's by :func:`remove_abandoned_temporaries`.
    """
    path = Path(path)
    fd, tmp = _locked_temporary(path)
    try:
        write(tmp)
        with open(tmp, "rb") as written:  # on disk before the rename makes it visible
            os.fsync(written.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _locked_temporary(path: Path) -> tuple[int | None, str]:
    """A fresh ``.NAME.XXXX.tmp`` beside ``path`` and an open descriptor holding an exclusive lock on it
    (None without ``fcntl``). A cleaner that took the lock between its creation and ours has removed
    it: then make another."""
    while True:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        if fcntl is None:  # nothing to hold (and an open file could not be renamed on Windows)
            os.close(fd)
            return None, tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: write unlocked (a cleaner never removes it)
            return fd, tmp
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_abandoned_temporaries(folder: str | Path, names: tuple[str, ...]) -> list[Path]:
    """Remove the temporaries :func:`atomic_write` left for ``names`` in ``folder`` (``.NAME.XXXX.tmp``)
    when their writer is gone (killed, e.g. by kill -9): those no process holds the lock of; a live
    writer's are kept, whatever their age. Without ``fcntl`` (not POSIX), those older than an hour
    (:func:`remove_stale_temporaries`). Returns what was removed."""
    import glob

    if fcntl is None:
        return remove_stale_temporaries(folder, names, older_than_s=3600.0)
    removed = []
    for name in names:
        for tmp in Path(folder).glob(f".{glob.escape(name)}.*.tmp"):
            try:
                fd = os.open(tmp, os.O_RDONLY)
            except OSError:  # its writer finished meanwhile, or not ours to read
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a live writer holds it (or the file system has no locks: keep it)
                os.close(fd)
                continue
            try:
                if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                    tmp.unlink()
                    removed.append(tmp)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
    return removed


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


def read_json(path: str | Path) -> object:
    """The JSON value in the file ``path``, or a ValueError naming the file and what is wrong with it:
    not UTF-8, not valid JSON (truncated or damaged?), or nested too deeply for Python to read (a
    RecursionError from ``json`` otherwise, naming nothing). A missing file raises FileNotFoundError."""
    import json

    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (truncated or damaged?): {err}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON (nested too deeply)") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (not UTF-8 text: {err.reason} at byte {err.start})"
        ) from None

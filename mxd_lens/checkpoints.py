"""Crash-safe checkpoint folders and run-folder locks, shared by every trainer in the library.

``checkpoints/step_000001000/`` is filled under a unique temporary name (``.tmp-step_000001000.XXXX``)
and renamed, then the text file ``checkpoints/latest`` is replaced atomically to name it: a crash at
any moment leaves the previous checkpoint complete and ``latest`` pointing at it. Older folders beyond
``keep`` are removed last. A resume walks :func:`checkpoint_candidates` newest first, so a ``latest``
that names a missing or damaged folder falls back to the newest intact one instead of restarting.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from mxd_lens.fileio import _umask, atomic_write_text


class CheckpointError(OSError):
    """A checkpoint could not be written or read; the message names the last good one and the fix."""


class RunLocked(RuntimeError):
    """Another process holds the run folder's lock."""


TMP_PREFIX = ".tmp-"  # a checkpoint folder being written: checkpoints/.tmp-step_000001000.XXXX


def remove_stale_checkpoint_temporaries(run_folder: str | Path) -> list[Path]:
    """Remove half-written checkpoint folders a killed run left (``.tmp-step_*``); only safe while
    holding the run's lock, as :class:`RunLock` does when it takes it. Returns what was removed."""
    stale = [p for p in Path(run_folder).glob(f"*/{TMP_PREFIX}step_*") if p.is_dir()]
    stale += [p for p in Path(run_folder).glob(f"{TMP_PREFIX}step_*") if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def checkpoint_candidates(checkpoint_dir: str | Path) -> list[Path]:
    """Checkpoint folders to try when resuming, newest first: the one ``latest`` names (if it exists),
    then every other ``step_*`` folder by descending step."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    folders = sorted((p for p in checkpoint_dir.glob("step_*") if p.is_dir()), reverse=True)
    pointer = checkpoint_dir / "latest"
    named = checkpoint_dir / pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and named in folders:
        folders.remove(named)
        folders.insert(0, named)
    return folders


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
    ``latest``; if writing fails (a full disk raises OSError, or RuntimeError from torch.save) nothing
    changes, the temporary folder is removed and ``CheckpointError`` names the last good checkpoint."""
    final = checkpoint_dir / f"step_{step:09d}"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=checkpoint_dir, prefix=f"{TMP_PREFIX}{final.name}."))
        os.chmod(
            tmp, 0o777 & ~_umask()
        )  # as readable as any folder (mkdtemp's is 0700): a colleague can resume
        fill(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tmp = None
        atomic_write_text(checkpoint_dir / "latest", final.name)
    except Exception as err:
        full = _disk_full(err)
        if not (full or isinstance(err, (OSError, RuntimeError))):
            raise
        last = f"the last good checkpoint is {latest_checkpoint(checkpoint_dir) or 'none'}"
        if full:  # torch says "[enforce fail at inline_container.cc:672] unexpected pos ..."
            free = shutil.disk_usage(checkpoint_dir).free
            raise CheckpointError(
                f"no space left on the disk of {checkpoint_dir} ({free / 2**20:,.1f} MiB free) to write "
                f"checkpoint {final.name}; {last}; free disk space (or move the run to a larger disk) and resume"
            ) from err
        raise CheckpointError(
            f"could not write checkpoint {final.name} in {checkpoint_dir} ({err}); {last}; free disk space "
            "and resume"
        ) from err
    finally:  # also on Ctrl-C: no half-written folder is left behind
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted(checkpoint_dir.glob("step_*"))[: -max(keep, 1)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` says a write found the disk (or the quota) full: OSError's ENOSPC / EDQUOT, or the
    RuntimeError torch.save raises then, which says only that its stream writer failed."""
    import errno

    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return True
    text = str(err)
    writer_failed = isinstance(err, RuntimeError) and (
        "unexpected pos" in text or "file write failed" in text or "PytorchStreamWriter failed" in text
    )
    return writer_failed or "No space left on device" in text or "StorageFull" in text


class RunLock:
    """An exclusive, non-blocking lock on a run folder (``folder/.lock``, a ``filelock.FileLock``, which
    holds the owner's pid), held from ``acquire`` until ``release`` or the process ends; a second holder
    gets ``RunLocked`` naming the first one's pid."""

    def __init__(self, folder: str | Path, what: str = "run"):
        self.folder, self.what = Path(folder), what
        self._lock: FileLock | None = None

    def acquire(self) -> RunLock:
        if self._lock is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / ".lock"
        lock = FileLock(path, timeout=0, mode=0o666 & ~_umask())  # as open() would make it
        try:
            lock.acquire()
        except Timeout:
            holder = path.read_text().strip() if path.is_file() else ""
            raise RunLocked(
                f"{self.folder} is in use by another {self.what} (pid {holder or 'unknown'}): wait for it to "
                "finish, or give another output folder"
            ) from None
        path.write_text(str(os.getpid()))  # for the message a second holder gets
        self._lock = lock
        remove_stale_checkpoint_temporaries(self.folder)  # no one else writes here while we hold the lock
        return self

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

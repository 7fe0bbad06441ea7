"""The atomic-write helper: the mode open() would give, unique temporary names, nothing left on failure."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mxd_lens.fileio import atomic_write, atomic_write_text


@pytest.fixture
def umask():
    def set_umask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_umask
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_gets_the_mode_open_would_give(tmp_path, umask, mask, mode):
    umask(mask)
    atomic_write_text(tmp_path / "a.json", "{}")
    (tmp_path / "plain").write_text("x")
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == mode
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == mode
    assert os.umask(mask) == mask  # the umask is left as it was


def test_the_temporary_file_is_unique_in_the_same_folder_and_removed_on_failure(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    seen = []

    def fail(tmp: str) -> None:
        seen.append(tmp)
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert seen[0] != seen[1]  # two writers never share a temporary name
    assert all(os.path.dirname(t) == str(tmp_path) for t in seen)  # same folder: os.replace is atomic
    assert os.path.basename(seen[0]).startswith(".data.bin.") and seen[0].endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"] and target.read_bytes() == b"old"
    atomic_write(target, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_an_interrupted_checkpoint_leaves_no_temporary_and_a_killed_ones_is_removed_by_the_next_lock(
    tmp_path,
):
    import stat

    from mxd_lens.checkpoints import RunLock, save_checkpoint_dir

    checkpoints = tmp_path / "run" / "checkpoints"

    def interrupted(folder):
        (folder / "state.pt").write_bytes(b"x" * 10)
        raise KeyboardInterrupt  # Ctrl-C inside the write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_dir(checkpoints, 5, interrupted, keep=2)
    assert list(checkpoints.iterdir()) == []
    killed = checkpoints / ".tmp-step_000000007.abcd"  # what kill -9 in the middle leaves
    killed.mkdir()
    (killed / "state.pt").write_bytes(b"partial")
    with RunLock(tmp_path / "run"):
        assert not killed.exists()
    old = os.umask(0o022)
    try:
        final = save_checkpoint_dir(
            checkpoints, 8, lambda folder: (folder / "state.pt").write_bytes(b"s"), keep=2
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE(final.stat().st_mode) == 0o755  # as mkdir gives, so a colleague can resume


def test_stale_atomic_write_temporaries_are_removed_and_fresh_ones_kept(tmp_path):
    import time

    from mxd_lens.fileio import remove_stale_temporaries

    stale, fresh = tmp_path / ".cfg.json.k1l2.tmp", tmp_path / ".cfg.json.m3n4.tmp"
    other = tmp_path / ".notes.txt.x.tmp"
    for path in (stale, fresh, other):
        path.write_text("{")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(other, (hour_ago, hour_ago))
    assert remove_stale_temporaries(tmp_path, ("cfg.json", "eval.json")) == [stale]
    assert fresh.exists() and other.exists()

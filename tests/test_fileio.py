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

"""What the repository holds: no binary state (weights, checkpoints; the scripts in analyses/ rebuild
them under results/), and docs/results.md stays a report of current results, short enough to read."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINARY = (".pt", ".safetensors", ".pth", ".ckpt", ".bin")


def tracked_files() -> list[str]:
    """``git ls-files`` in the repository root; skips when git or the checkout is missing."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout")
    done = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"git ls-files failed: {done.stderr.strip()}")
    return [name for name in done.stdout.split("\0") if name]


def test_no_binary_state_is_tracked():
    binary = sorted(name for name in tracked_files() if name.lower().endswith(BINARY))
    assert not binary, (
        f"binary state is tracked by git (keep it under results/, which analyses/ rebuilds): {binary}"
    )


def test_the_results_report_stays_short():
    lines = (ROOT / "docs" / "results.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 450, (
        f"docs/results.md has {len(lines)} lines (at most 450): history goes to CHANGELOG.md, "
        "details to docs/results/*.md"
    )

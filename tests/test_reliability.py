"""Nothing lost, nothing silent: a resume checks its data, a run folder has one trainer at a time, a
broken ``latest`` or a damaged checkpoint falls back to the newest intact one, a full disk is a
CheckpointError with nothing left behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_training import SPECS, assert_identical, config, crash_at, final_weights, source

from mxd_lens.activations import CachedActivations, write_cache
from mxd_lens.checkpoints import CheckpointError, RunLock, RunLocked
from mxd_lens.training import Trainer


def test_resume_on_other_data_is_refused(tmp_path):
    from test_activations import random_rows

    def cache(name, seed, text):
        live = source("gpt2", blocks=(1,))
        live.rows = random_rows(seed)
        info = {"text": text, "split": "train", "eval_fraction": 0.02, "split_seed": 0}
        write_cache(live, tmp_path / name, n_shards=4, progress=False, text_info=info)
        return tmp_path / name

    a, b, same_text_other_content = cache("a", 0, "a.txt"), cache("b", 1, "b.txt"), cache("c", 2, "a.txt")

    def trainer(path, steps, **kw):
        return Trainer(
            SPECS[1:2],
            CachedActivations(path, **kw),
            config(total_tokens=64 * steps),
            tmp_path / "run",
            progress=False,
        )

    trainer(a, 10).fit()
    with pytest.raises(ValueError, match="trained on other data"):
        trainer(b, 20).fit(resume=True)
    with pytest.raises(ValueError, match="trained on other data.*'content'"):
        trainer(same_text_other_content, 20).fit(resume=True)
    with pytest.raises(ValueError, match="other data.*'shards': \\(4, 3\\)"):
        trainer(a, 20, max_shards=3).fit(resume=True)
    # The same data under another path (a moved cache) is the same data.
    shutil.copytree(a, tmp_path / "moved", ignore=shutil.ignore_patterns(".lock"))
    trainer(tmp_path / "moved", 12).fit(resume=True)


def test_a_second_trainer_on_one_folder_is_refused_and_names_the_holder(tmp_path):
    import os

    with RunLock(tmp_path, "trainer"):
        with pytest.raises(RunLocked, match=f"in use by another trainer \\(pid {os.getpid()}\\)"):
            Trainer(SPECS[:1], source(), config(), tmp_path, progress=False).fit()
    Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path, progress=False).fit()  # released


def test_a_broken_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path, monkeypatch):
    cfg = config(keep_checkpoints=3)
    Trainer(SPECS[:2], source(), cfg, tmp_path / "whole", progress=False).fit()
    # A run killed after step 25, whose step-20 checkpoint was then lost, and `latest` names it.
    run = tmp_path / "broken"
    crash_at(Trainer(SPECS[:2], source(), cfg, run, progress=False), 25, monkeypatch)
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "step_000000020")
    with pytest.warns(UserWarning, match="step_000000020.*resuming from .*step_000000010"):
        resumed = Trainer(SPECS[:2], source(), cfg, run, progress=False)
        assert resumed.load_checkpoint().name == "step_000000010"
    resumed.fit()  # no restart from step 0, and the same weights as the unbroken run
    assert_identical(final_weights(tmp_path / "whole"), final_weights(run))


def test_damaged_newest_checkpoint_is_skipped_with_its_file_named(tmp_path):
    run = tmp_path / "run"
    Trainer(SPECS[:1], source(), config(keep_checkpoints=3), run, progress=False).fit()
    newest = run / "checkpoints" / "step_000000030" / SPECS[0].name / "train_state.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    trainer = Trainer(SPECS[:1], source(), config(keep_checkpoints=3), run, progress=False)
    with pytest.warns(UserWarning, match="step_000000030.*resuming from .*step_000000020"):
        assert trainer.load_checkpoint().name == "step_000000020"
    for folder in (run / "checkpoints").glob("step_*"):
        (folder / "trainer_state.json").write_text("{")
    with pytest.raises(
        CheckpointError, match="no checkpoint could be read.*step_000000010.*Delete the damaged"
    ):
        Trainer(SPECS[:1], source(), config(), run, progress=False).load_checkpoint()


def test_a_full_disk_inside_torch_save_is_a_checkpoint_error_and_leaves_nothing(tmp_path, monkeypatch):
    trainer = Trainer(SPECS[:1], source(), config(), tmp_path, progress=False)
    calls = {"n": 0}
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # what torch.save raises on a full disk
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(
        CheckpointError, match="no space left on .*step_000000020.*last good checkpoint is .*step_000000010"
    ):
        trainer.fit()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000000010"]


def test_a_resumed_run_leaves_no_temporary_files_in_final(tmp_path):
    Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path, progress=False).fit()
    stale = tmp_path / "final" / SPECS[0].name / ".sae_weights.safetensors.abc123.tmp"
    stale.write_bytes(b"half a file")
    Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path, progress=False).fit(resume=True)
    assert not list((tmp_path / "final").rglob("*.tmp"))
    assert json.loads((tmp_path / "final" / SPECS[0].name / "cfg.json").read_text())["architecture"]


def test_a_fresh_run_into_a_folder_holding_one_is_refused_and_nothing_is_overwritten(tmp_path):
    """issue 31 #1: `mxd-lens train --out DIR` without --resume over a finished run (or one with
    checkpoints only) used to overwrite it silently."""
    from mxd_lens.loop import RunExists

    Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path / "run", progress=False).fit()
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(RunExists, match=r"holds a run \(checkpoint step_.*--resume"):
        Trainer(
            SPECS[:1], source(), config(total_tokens=64 * 10, seed=3), tmp_path / "run", progress=False
        ).fit()
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # final layers only
    with pytest.raises(RunExists, match="final layers, no checkpoint"):
        Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path / "run", progress=False).fit()
    Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path / "empty", progress=False).fit()

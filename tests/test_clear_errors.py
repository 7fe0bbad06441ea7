"""Issue 58, "unclear or late errors": each case is refused (or warned about) early, in one message that
names the file or field at fault and what to do, never advising anything unsafe."""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import warnings

import pytest
import torch
from conftest import make_text_model, make_tokenizer

from mxd_lens.config import TrainConfig
from mxd_lens.studies.frontier import FrontierConfig


# -- frontier: every text read enough to fill one row before anything is cached or trained ------------
@pytest.mark.parametrize("case", ["empty_eval", "ood_not_utf8", "jsonl_without_text", "three_word_eval"])
def test_frontier_refuses_a_bad_text_before_caching_or_training(tmp_path, monkeypatch, case):
    import mxd_lens.studies.frontier.run as frontier_run

    model, corpus = make_text_model(tmp_path)
    config = FrontierConfig(
        text=str(corpus), blocks=[1], ks=[2], archs=["transcoder"], width_multiplier=8, train_tokens=64 * 4,
        eval_tokens=48, context_size=12, train=TrainConfig(epochs=1.0, batch_tokens=64), rows_per_shard=16,
        eval_fraction=0.1,
    )  # fmt: skip
    bad = {
        "empty_eval": ("eval_text", "empty.txt", b""),
        "ood_not_utf8": ("ood_text", "latin1.txt", "the cat sat on a mat, café\n".encode("latin-1") * 20),
        "jsonl_without_text": ("eval_text", "docs.jsonl", b'{"body": "the cat sat on a mat"}\n' * 20),
        "three_word_eval": ("eval_text", "short.txt", b"the cat sat"),
    }[case]
    field, name, content = bad
    (tmp_path / name).write_bytes(content)
    config = dataclasses.replace(config, **{field: str(tmp_path / name)})

    def cached(*args, **kwargs):
        raise AssertionError("the cache was written before the texts were checked")

    monkeypatch.setattr(frontier_run, "write_frontier_cache", cached)
    with pytest.raises(ValueError, match=re.escape(name)):
        frontier_run.run_frontier(model, config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# -- a text's unknown tokens are judged on a few thousand tokens, not on its first row ----------------
def test_unknown_token_share_is_judged_on_thousands_of_tokens_not_one_row():
    from mxd_lens.data import TokenRows

    words = "the cat sat on a mat while dogs ran over green hills".split()
    tokenizer = make_tokenizer([" ".join(words)])
    # a text 4.7% unknown, whose first 30-token row is half unknown (its unknown words come first)
    stream = ["zorp"] * 15 + [words[i % len(words)] for i in range(15)]
    stream += ["zorp" if i % 23 == 0 else words[i % len(words)] for i in range(4000)]
    assert f"{stream.count('zorp') / len(stream):.1%}" == "4.7%"
    docs = [" ".join(stream[i : i + 30]) for i in range(0, len(stream), 30)]
    rows = TokenRows(tokenizer, context_size=31)
    rows.separator_token_id = None  # the words alone: 30 a row after BOS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = next(rows.rows(docs, name="mostly_known.txt"))  # one row read, no false alarm
        assert len(list(rows.rows(docs, name="mostly_known.txt"))) == len(stream) // 30
    assert (first == 2).sum() == 15
    # a text that is mostly unknown is still warned about, however little of it is read
    with pytest.warns(UserWarning, match=r"bad.txt: .* of its first .* tokens \(90%\) are the unknown token"):
        next(rows.rows([" ".join(["zorp"] * 9 + ["the"]) for _ in range(500)], name="bad.txt"))


# -- a pickle given as the induction model: named, without PyTorch's unsafe advice --------------------
class Arbitrary:
    """Any object: torch.save pickles it, and loading it would run code."""


def test_spd_induction_refuses_a_pickle_as_its_model_naming_it(tmp_path, capsys):
    from mxd_lens.cli import main

    evil = tmp_path / "evil.pt"
    torch.save(Arbitrary(), evil)  # a pickle of an arbitrary object
    with pytest.raises(SystemExit) as exit_info:
        main(["spd-induction", "train", "--model", str(evil), "--out", str(tmp_path / "out")])
    message = str(exit_info.value)
    assert f"{evil} is not an induction model saved by mxd-lens" in message
    assert "weights_only" not in message + capsys.readouterr().err
    from mxd_lens.spd.induction import load_induction_model

    (tmp_path / "text.pt").write_text("not a model")  # a non-mxd file of another format
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(tmp_path / 'text.pt'))} is not an induction model"
    ):
        load_induction_model(tmp_path / "text.pt")


# -- a cfg.json nested too deeply: named, wherever mxd-lens reads one ---------------------------------
def test_a_too_deeply_nested_cfg_json_is_named_wherever_it_is_read(tmp_path, capsys):
    from conftest import make_model
    from sae_lens import SAE

    from mxd_lens.cli import main
    from mxd_lens.hub import stage
    from mxd_lens.layers import TopKTranscoder
    from mxd_lens.layers.io import describe_layer, load_any_layer, load_layer
    from mxd_lens.studies.common import layers_model
    from mxd_lens.studies.eval.run import record_evaluation

    folder = tmp_path / "L"
    TopKTranscoder.for_model(make_model(), 1, d_sae=8, k=2).save_model(folder)
    (folder / "cfg.json").write_text("[" * 100_000 + "]" * 100_000)
    said = f"{folder / 'cfg.json'} is not valid JSON (nested too deeply)"
    for read in (load_layer, load_any_layer, describe_layer, SAE.load_from_disk, lambda f: layers_model([f]),
                 lambda f: stage([f], "me/layers", tmp_path / "staged"),
                 lambda f: record_evaluation(f, {"tokens": 12}, {}, 12, 0, make_model())):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(said)):
            read(folder)
    assert main(["info", str(folder)]) == 1
    assert f"PROBLEM: {said}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=re.escape(said)):
        main(["eval", str(folder)])


# -- a cache manifest with a field of the wrong type: the manifest and the field named ---------------
def test_a_cache_manifest_with_a_field_of_the_wrong_type_names_the_manifest_and_the_field(tmp_path):
    from test_activations import _cache

    from mxd_lens.activations import CachedActivations, write_cache

    source, cache = _cache(tmp_path, shards=2)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["stream"]["rows_per_shard"] = "many"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    said = (
        rf"{re.escape(str(cache / 'manifest.json'))}: stream.rows_per_shard is 'many', not a positive integer"
    )
    with pytest.raises(ValueError, match=said):
        CachedActivations(cache)
    with pytest.raises(ValueError, match=said):
        write_cache(source, cache, n_shards=2, progress=False)


# -- mix: an empty source is named -----------------------------------------------------------------------
def test_mix_warns_naming_an_empty_source(tmp_path, capsys):
    from mxd_lens.cli import main

    (tmp_path / "a.txt").write_text("the cat sat on the mat\n\nthe dog ran over the hill")
    (tmp_path / "empty.txt").write_text("")
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(tmp_path / 'empty.txt'))}: no document") as said:
        assert main(["mix", str(tmp_path / "a.txt"), str(tmp_path / "empty.txt"), "--out",
                     str(tmp_path / "mixed.txt")]) == 0  # fmt: skip
    assert "a.txt" not in str(said[0].message)  # only the empty one
    assert "characters per source [47, 0]" in capsys.readouterr().out


# -- train --cache C --dtype: the cache fixes the activations' dtype, said in one line -----------------
def test_train_from_a_cache_says_dtype_does_not_change_its_activations(tmp_path, capsys):
    from test_activations import _cache

    from mxd_lens.cli import main

    _, cache = _cache(tmp_path, shards=2)  # float32
    train = ["train", "--cache", str(cache), "--no-progress"]
    train += "--tokens 128 --batch-tokens 64 --arch transcoder --k 2".split()
    assert main([*train, "--dtype", "bfloat16", "--out", str(tmp_path / "run")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "--dtype" in line]
    assert len(said) == 1 and said[0].startswith(
        f"--dtype bfloat16 does not change the activations: the cache {cache} fixes their dtype (float32"
    )
    assert main([*train, "--out", str(tmp_path / "run2")]) == 0  # no --dtype: nothing said
    assert "--dtype" not in capsys.readouterr().err


# -- gemma.sh before its fetch step: says to run it --------------------------------------------------------
def test_gemma_script_before_fetch_says_to_run_fetch_first(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "analyses" / "protocol" / "gemma.sh"
    copy = tmp_path / "analyses" / "protocol" / "gemma.sh"  # in a tree with no GGUF, no cache, no venv
    copy.parent.mkdir(parents=True)
    shutil.copy(script, copy)
    env = {"PATH": "/usr/bin:/bin", "ARCH_LR": "mxd=1e-3", "DATA": str(tmp_path), "THREADS": "1"}
    for step, said in (("G3", "run 'gemma.sh fetch' first"), ("cache", "run 'gemma.sh fetch' first"),
                       ("sweep9", "run 'gemma.sh cache' first")):  # fmt: skip
        done = subprocess.run(["bash", str(copy), step], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and said in done.stderr, (step, done.stderr)
        if step == "G3":
            assert "results/gguf/gemma-3-270m-q4_k_m.gguf" in done.stderr


# -- a checkpoint on a full disk: "no space left", naming the folder; the last good one survives -------
@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4306"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["torch", "oserror"],
)
def test_a_checkpoint_on_a_full_disk_says_no_space_left_naming_the_folder(tmp_path, monkeypatch, error):
    from mxd_lens.checkpoints import CheckpointError, save_checkpoint_dir

    folder = tmp_path / "run" / "checkpoints"

    def fill(where):
        torch.save({"weights": torch.ones(3)}, where / "train_state.pt")

    good = save_checkpoint_dir(folder, 100, fill, keep=2)

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint_dir(folder, 200, fill, keep=2)
    message = str(info.value)
    assert message.startswith(f"no space left on the disk of {folder}") and "MiB free" in message
    assert f"the last good checkpoint is {good}" in message and "inline_container" not in message
    assert (folder / "latest").read_text() == good.name and sorted(p.name for p in folder.iterdir()) == [
        "latest", good.name]  # fmt: skip


# -- an evaluation killed, run again at once: its temporaries go, whatever their age ---------------------
def test_a_killed_evaluations_temporaries_are_removed_by_the_next_whatever_their_age(tmp_path):
    import fcntl
    import os

    from conftest import make_model

    from mxd_lens.layers import TopKTranscoder
    from mxd_lens.studies.eval.run import record_evaluation

    model = make_model()
    folder = tmp_path / "L"
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(folder)
    left = [folder / ".cfg.json.k1ll3d.tmp", folder / ".eval.json.k1ll3d.tmp"]  # seconds old
    for tmp in left:
        tmp.write_text("{half")
    live = folder / ".cfg.json.wr1t3r.tmp"  # another evaluation writing now: holds its lock
    live.write_text("{")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        record_evaluation(
            folder, {"tokens": 12, "delta_ce": 0.5}, {"text": "t.txt", "split": "eval"}, 12, 0, model
        )
        assert not any(tmp.exists() for tmp in left) and live.exists()
    finally:
        os.close(fd)
    assert (
        json.loads((folder / "cfg.json").read_text())["metadata"]["evaluation"]["metrics"]["delta_ce"] == 0.5
    )


# -- train --resume with another lr, on a run that wrote no checkpoint yet: refused, naming lr ----------
def test_resume_with_another_lr_before_the_first_checkpoint_is_refused_naming_lr(tmp_path, monkeypatch):
    from test_activations import _cache

    import mxd_lens.training
    from mxd_lens.cli import main
    from mxd_lens.loop import ResumeMismatch

    _, cache = _cache(tmp_path, shards=2)
    run = ["--debug", "train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--no-progress"]
    run += "--tokens 256 --batch-tokens 64 --arch transcoder --k 2 --checkpoint-every 3".split()
    step = mxd_lens.training.Trainer.train_step

    def killed(self, batch):
        if self.step == 1:
            raise KeyboardInterrupt  # the first part ends before its first checkpoint (step 3)
        return step(self, batch)

    monkeypatch.setattr(mxd_lens.training.Trainer, "train_step", killed)
    with pytest.raises(KeyboardInterrupt):
        main([*run, "--lr", "1e-3"])
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"]["lr"] == 1e-3
    assert not (tmp_path / "run" / "checkpoints").exists()
    monkeypatch.setattr(mxd_lens.training.Trainer, "train_step", step)
    with pytest.raises(
        ResumeMismatch, match=r"run\.json records a run with other settings .*'lr': \(0\.001, 0\.003\)"
    ):
        main([*run, "--resume", "--lr", "3e-3"])
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"]["lr"] == 1e-3  # untouched
    assert main([*run, "--resume", "--lr", "1e-3", "--tokens", "192"]) == 0  # the same recipe (budget free)
    # and once a checkpoint is written, refused as before
    with pytest.raises(ResumeMismatch, match=r"checkpoint.*'lr': \(0\.001, 0\.003\)"):
        main([*run, "--resume", "--lr", "3e-3"])

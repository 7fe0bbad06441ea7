"""Training a layer at every block from one stream (the replacement model's training): block specs,
`--text` alone, the short progress lines and the JSONL metrics log, and a run in timed parts that ends
where an unbroken run ends."""

import json

import pytest
import torch
from conftest import make_text_model
from safetensors.torch import load_file

from mxd_lens.cli import PART_ENDED, main
from mxd_lens.config import DEFAULT_MODEL, parse_blocks


@pytest.fixture
def text_model(tmp_path, monkeypatch):
    """A 3-block model with a word-level tokenizer, served for any --model, and the names it was asked by."""
    model, corpus = make_text_model(tmp_path)
    import mxd_lens.models

    asked = []
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: asked.append(name) or model)
    return corpus, asked


def test_block_specs():
    assert parse_blocks(["all"], 4) == [0, 1, 2, 3]
    assert parse_blocks(["0-2", "5"], 8) == [0, 1, 2, 5]
    assert parse_blocks(["3", "1-2", "2"], None) == [1, 2, 3]  # sorted, no repeats
    assert parse_blocks("0,2", 3) == [0, 2] and parse_blocks([1, 0]) == [0, 1]  # a caller's ints
    assert parse_blocks(["all"], None) is None  # a cache: every block it holds
    for bad, match in (
        (["3-1"], "a range runs"),
        (["x"], "give block numbers"),
        (["all", "3"], "'all' stands alone"),
        (["0-30"], r"blocks 0-29 \(30 in all\)"),
        ([], "empty"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_blocks(bad, 30)


def _stream(corpus):
    return ["--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16"]


LEARN = ["--arch", "mxd", "transcoder", "--k", "2", "--batch-tokens", "32", "--log-every", "2"]


def test_text_alone_streams_from_the_default_model_at_every_block(tmp_path, text_model):
    corpus, asked = text_model
    out = tmp_path / "run"
    argv = ["train", *_stream(corpus), *LEARN, "--tokens", "128", "--no-progress"]
    assert main([*argv, "--blocks", "all", "--out", str(out)]) == 0
    assert asked == [DEFAULT_MODEL]
    trained = sorted(p.name for p in (out / "final").iterdir() if p.is_dir())
    assert [name.split(".")[0] for name in trained] == ["L0", "L0", "L1", "L1", "L2", "L2"]
    # a range says the same as its blocks
    assert main([*argv, "--blocks", "1-2", "--out", str(tmp_path / "r")]) == 0
    assert {p.name.split(".")[0] for p in (tmp_path / "r" / "final").iterdir() if p.is_dir()} == {"L1", "L2"}
    with pytest.raises(SystemExit, match=r"the model has blocks 0-2"):
        main([*argv, "--blocks", "0-3", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"a live stream needs --blocks"):
        main([*argv, "--out", str(tmp_path / "y")])


def test_many_learners_keep_short_progress_lines_and_log_every_learner(tmp_path, text_model, capsys):
    corpus, _ = text_model
    out = tmp_path / "run"
    archs = ["--arch", "mxd", "mxd:gate=topk", "transcoder", "skip_transcoder", "--k", "2", "4"]  # 8 kinds
    argv = ["train", *_stream(corpus), "--blocks", "all", *archs, "--batch-tokens", "32", "--log-every", "2"]
    assert (
        main([*argv, "--tokens", "192", "--out", str(out)]) == 0
    )  # 3 blocks x 8 = 24 learners, with the bar
    captured = capsys.readouterr()
    lines = [line for text in (captured.out, captured.err) for line in text.replace("\r", "\n").splitlines()]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3, lines  # a summary every --log-every steps (8 kinds: on two lines each)
    assert max(len(line) for line in lines) < 200, max(lines, key=len)
    # every learner's metrics are in the JSONL log, equal to the history saved with the final layers
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [2, 4, 6]
    history = json.loads((out / "final" / "metrics.json").read_text())
    assert len(history) == 24 == len(logged[0]["learners"])
    for name, records in history.items():
        for entry, record in zip(logged, records, strict=True):
            assert entry["learners"][name]["fvu"] == record["fvu"] and entry["step"] == record["step"]
    # the summary's numbers are the learners' own: the worst FVU of the plain transcoders at the last step
    worst = max(m["fvu"] for name, m in logged[-1]["learners"].items() if ".transcoder.k2." in name)
    last = lines[lines.index(steps[-1]) :]
    summary = next(
        part.strip() for line in last for part in line.split(" | ") if part.strip().startswith("transcoder1 ")
    )
    assert summary.split()[2].split("/")[1] == f"{worst:.3f}".removeprefix("0")


def test_a_run_in_timed_parts_ends_bit_identical_to_an_unbroken_one(tmp_path, text_model, capsys):
    corpus, _ = text_model
    argv = ["train", *_stream(corpus), "--blocks", "all", *LEARN, "--tokens", "256", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    parts = tmp_path / "parts"
    # each part ends after its first step (a limit of ~0 minutes), with a checkpoint, and says so
    codes = [main([*argv, "--resume", "--max-minutes", "1e-9", "--out", str(parts)]) for _ in range(3)]
    assert codes == [PART_ENDED] * 3
    assert "ended after" in capsys.readouterr().out
    assert (parts / "checkpoints" / "step_000000003").is_dir() and not (parts / "final").exists()
    assert main([*argv, "--resume", "--out", str(parts)]) == 0  # the rest in one go
    for folder in (tmp_path / "whole" / "final").iterdir():
        if folder.is_dir():
            a = load_file(folder / "sae_weights.safetensors")
            b = load_file(parts / "final" / folder.name / "sae_weights.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder.name
    # the log holds each step once, as the unbroken run's does
    whole = (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert (parts / "metrics.jsonl").read_text() == whole

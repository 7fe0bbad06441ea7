import re

import pandas as pd
import pytest
import torch
from conftest import make_text_model
from sae_lens import SAE
from safetensors.torch import load_file

from mxd_lens.cli import main
from mxd_lens.layers import arch_label
from mxd_lens.studies import STUDIES


def test_check_runs_and_from_mlp_is_exact(capsys):
    assert main(["check", "--k", "4"]) == 0
    out = capsys.readouterr().out
    lines = [
        line for line in out.splitlines() if "MxD.from_mlp" in line and line.startswith(("gpt2", "gated"))
    ]
    assert len(lines) == 2 and all(line.rstrip().endswith("+0.0000") for line in lines)
    # every layer type the README names: MxD, TopK, skip and BatchTopK transcoders, on both block shapes
    for kind in ("gpt2-like", "gated"):
        for layer in ("MxD (N=", "Transcoder (H=", "Skip transcoder (H=", "BatchTopK transcoder (H="):
            assert re.search(
                rf"^{kind} +{re.escape(layer)}\d+, untrained\) .* [+-]\d\.\d{{4}}$", out, re.M
            ), (kind, layer)


@pytest.fixture
def text_model(tmp_path, monkeypatch):
    """A tiny model with a word-level tokenizer, served by `--model tiny`, and a local text file."""
    model, corpus = make_text_model(tmp_path)
    import mxd_lens.models

    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    return corpus


def test_cache_then_train_from_it_equals_training_live(tmp_path, text_model, capsys):
    stream = ["--model", "tiny", "--text", str(text_model), "--context-size", "12", "--rows-per-shard", "16"]
    assert main(["cache", *stream, "--blocks", "1", "--shards", "4", "--out", str(tmp_path / "cache")]) == 0
    learn = [
        "--arch",
        "mxd",
        "skip_transcoder",
        "--k",
        "2",
        "4",
        "--tokens",
        "320",
        "--batch-tokens",
        "32",
        "--no-progress",
    ]
    cached = ["train", "--cache", str(tmp_path / "cache"), "--shuffle", "shard"]
    assert main([*cached, *learn, "--out", str(tmp_path / "a")]) == 0
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", str(tmp_path / "b")]) == 0
    assert main([*cached, *learn, "--grad-clip", "none", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "a" / "final").iterdir() if p.is_dir())
    assert names == ["L1.mxd.k2.m8", "L1.mxd.k4.m8", "L1.skip_transcoder.k2.m8", "L1.skip_transcoder.k4.m8"]
    import json

    for run in ("a", "b"):  # the training text is recorded, whether read live or through the cache
        cfg = json.loads((tmp_path / run / "final" / names[0] / "cfg.json").read_text())
        record = cfg["metadata"]["training"]["data"]
        assert record.pop("digests").keys() == {"corpus.txt"}  # content digests, for the overlap check
        assert record == {"text": str(text_model), "split": "train", "eval_fraction": 0.02, "split_seed": 0}
        assert cfg["metadata"]["training"]["config"]["grad_clip"] == 1.0  # the default
    off = json.loads((tmp_path / "c" / "final" / names[0] / "cfg.json").read_text())["metadata"]["training"]
    assert off["config"]["grad_clip"] is None and off["metrics"]["clipped_steps"] == 0
    for name in names:
        assert f"{name} loss=" in out
        a = load_file(tmp_path / "a" / "final" / name / "sae_weights.safetensors")
        b = load_file(tmp_path / "b" / "final" / name / "sae_weights.safetensors")
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_model_with_a_cache_is_used_and_checked_and_cache_applies_the_default_model(tmp_path, monkeypatch):
    import mxd_lens.models
    from mxd_lens.config import DEFAULT_MODEL

    model, corpus = make_text_model(tmp_path)
    (tmp_path / "b").mkdir()
    other, _ = make_text_model(tmp_path / "b")
    other.cfg.model_name = "another"
    asked = []
    monkeypatch.setattr(mxd_lens.models, "load_model",
                        lambda name, **kw: asked.append(name) or (other if name == "other" else model))  # fmt: skip
    stream = ["--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16"]
    assert main(["cache", *stream, "--blocks", "1", "--shards", "2", "--out", str(tmp_path / "cache")]) == 0
    assert asked == [DEFAULT_MODEL]  # what --help names as the default
    learn = [
        "--arch",
        "mxd",
        "--k",
        "2",
        "--tokens",
        "64",
        "--batch-tokens",
        "32",
        "--no-progress",
        "--init",
        "mlp",
    ]
    with pytest.raises(SystemExit, match="init='mlp' needs the model .*give --model"):
        main(["train", "--cache", str(tmp_path / "cache"), *learn, "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="--model other is .*'another'.*, but the cache .* was made with"):
        main(
            [
                "train",
                "--cache",
                str(tmp_path / "cache"),
                "--model",
                "other",
                *learn,
                "--out",
                str(tmp_path / "b"),
            ]
        )
    assert (
        main(
            [
                "train",
                "--cache",
                str(tmp_path / "cache"),
                "--model",
                "m",
                *learn,
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 0
    )


def test_train_without_a_source_is_refused(tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"give --text to stream from the model \(--model, default smollm2-135m\), or --cache DIR",
    ):
        main(["train", "--tokens", "1024", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="mxd-lens train: .*not an activation cache"):
        main(["train", "--cache", str(tmp_path / "none"), "--tokens", "1024", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="mxd-lens train: give exactly one of total_tokens"):
        main(["train", "--cache", str(tmp_path / "none"), "--out", str(tmp_path)])  # no budget


def test_errors_are_one_line_naming_the_verb_and_the_traceback_is_on_request(tmp_path, monkeypatch):
    import subprocess
    import sys

    argv = ["train", "--cache", str(tmp_path / "none"), "--tokens", "1024", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        main(argv)
    first, hint = str(info.value).split("\n")
    assert (
        first
        == f"mxd-lens train: {tmp_path / 'none'} is not an activation cache (no manifest.json); write one with `mxd-lens cache`"
    )
    assert "MXD_LENS_DEBUG=1" in hint
    with pytest.raises(FileNotFoundError, match="not an activation cache"):
        main(["--debug", *argv])
    monkeypatch.setenv("MXD_LENS_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="not an activation cache"):
        main(argv)
    monkeypatch.delenv("MXD_LENS_DEBUG")
    # from the shell: no traceback, exit status 1
    done = subprocess.run([sys.executable, "-m", "mxd_lens.cli", *argv], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("mxd-lens train: ") and done.stderr.count("\n") == 2


def test_train_options_are_the_train_config_fields(capsys):
    """Every TrainConfig field is an option of `mxd-lens train`, with its docstring as help."""
    import dataclasses

    from mxd_lens.training import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
    assert "training tokens (more than a cache holds: several epochs)" in text
    assert (
        "AuxK loss weight for dead units (0: off; sparsify's 1/32 left more dead, docs/training.md) (default: 0.5)"
        in text
    )


def test_help_explains_every_option():
    import argparse

    from mxd_lens.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) >= {"check", "cache", "train"}
    for name, sub in subparsers.choices.items():
        assert sub.description, name
        for action in sub._actions:
            assert action.help and len(action.help) > 10, (name, action.dest)


def test_help_shows_each_description_once_positionals_by_name_and_each_default_once(capsys):
    def shown(*argv):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        return capsys.readouterr().out

    probe = shown("probe")
    assert probe.count("Sparse probing of saved layers on a task suite") == 1  # not again as its group's
    text = " ".join(probe.split())
    assert "examples per class (default: the suite's, 200) --ks" in text  # not then "(default: None)"
    assert (
        "(default: the sets bundled with mxd-lens; the suite runs on the sets whose files are there) --per"
        in text
    )
    assert "(default: 0)" in text and "(default: [1, 2, 5])" in text  # defaults the help does not state
    demo = " ".join(shown("demo").split())
    assert "tokens of text to cache (default 262,144; 8,192 with --quick), rounded up to whole shards" in demo
    assert "(default: float32 unless given)" not in demo and "(default), bfloat16" in demo
    info = shown("info")
    assert "usage: mxd-lens info [-h] LAYERS [LAYERS ...]" in info and "list" not in info
    assert re.search(r"^  LAYERS +layer folders", info, re.M)
    mix = shown("mix")
    assert "mxd-lens mix [-h]" in mix and "SOURCES [SOURCES ...]" in mix and "\n    source" not in mix
    assert "usage: mxd-lens eval [-h]" in shown("eval") and "LAYERS [LAYERS ...]" in shown("eval")


def test_relative_text_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """A text (or data folder) given relative to the working folder is recorded by its absolute path: in
    the training record, the evaluation record and the study records."""
    import json
    import shutil

    import mxd_lens.models

    model, corpus = make_text_model(tmp_path)
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    work = tmp_path / "work"
    (work / "probing").mkdir(parents=True)
    shutil.copy(corpus, work / "corpus.txt")
    monkeypatch.chdir(work)
    stream = ["--model", "tiny", "--text", "corpus.txt", "--context-size", "12", "--rows-per-shard", "16"]
    learn = ["--arch", "transcoder", "--k", "2", "--tokens", "160", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", "run"]) == 0
    folder = work / "run" / "final" / "L1.transcoder.k2.m8"
    absolute = str((work / "corpus.txt").resolve())
    assert json.loads((folder / "cfg.json").read_text())["metadata"]["training"]["data"]["text"] == absolute
    evaluate = ["eval", str(folder), "--text", "./corpus.txt", "--eval-tokens", "60", "--context-size", "12"]
    assert main(evaluate) == 0
    assert json.loads((folder / "cfg.json").read_text())["metadata"]["evaluation"]["text"]["text"] == absolute
    from mxd_lens.studies.common import recorded_options
    from mxd_lens.studies.frontier import FrontierConfig
    from mxd_lens.studies.probe import ProbeOptions

    config = FrontierConfig(text="corpus.txt", blocks=[1], eval_text="corpus.txt", ood_text="no/such")
    frontier = recorded_options(config)
    assert (frontier["text"], frontier["eval_text"], frontier["ood_text"]) == (absolute, absolute, "no/such")
    probe = recorded_options(ProbeOptions(layers=["run"], data="probing"))
    assert probe["data"] == str((work / "probing").resolve()) and probe["layers"] == ["run"]


def test_demo_runs_end_to_end(tmp_path, text_model, capsys):
    args = ["demo", "--quick", "--model", "tiny", "--text", str(text_model), "--block", "1", "--k", "2"]
    args += ["--context-size", "12", "--batch-tokens", "64", "--train-tokens", "640", "--eval-tokens", "120"]
    assert main([*args, "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "demo" / "frontier.png").exists()
    rows = pd.read_csv(tmp_path / "demo" / "frontier.csv").sort_values("kl")
    best = rows.iloc[0]
    # the epochs it trained (1,280 tokens over a cache of 2 shards of 363), not the 2 it asked for
    assert best["epochs"] == pytest.approx(1280 / 726)
    assert (
        "| MxD " in out
        and "| Transcoder " in out
        and "K = 2, 1,280 training tokens (2 x 640 cache tokens; 1.76 epochs over the 726 tokens the cache "
        "holds in whole shards)"
        in out
    )
    label = arch_label(best["arch"])  # rows hold the key; the verdict names its label
    assert f"{label} stays closest to the model: KL(clean ‖ spliced) {label} {best['kl']:.4f}" in out
    assert f"{label} {best['delta_ce']:+.4f}" in out
    assert "On text none of them trained on" in out and "KL (other text)" in out  # the bundled fortunes
    assert f"deleting the MLP gives {best['ce_zero_ablation'] - best['ce_clean']:+.4f}" in out
    ood_zero = best["ood_ce_zero_ablation"] - best["ood_ce_clean"]
    assert f"(deleting the MLP gives {ood_zero:+.4f} there)" in out  # on the other text, not the held-out one
    # a finished demo keeps its weights, tables and cache, not its training checkpoints, and says its size
    assert not list((tmp_path / "demo").glob("runs/*/checkpoints")) and "checkpoints (" in out
    assert re.search(r"demo holds [\d,]+ MiB", out)
    assert "smoke test" in out and re.search(rf"\|\s+{int(best['params']):,}\s+\|", out)
    assert sorted(
        p.name for p in (tmp_path / "demo" / "runs" / "L1.seed0" / "final").iterdir() if p.is_dir()
    ) == [
        "L1.mxd-gate=topk-gate_standardize=0.1.k2.m8",  # the recommended MxD
        "L1.transcoder.k2.m8",
    ]
    cfg = SAE.load_from_disk(
        tmp_path / "demo/runs/L1.seed0/final/L1.mxd-gate=topk-gate_standardize=0.1.k2.m8"
    ).cfg
    assert (cfg.gate, cfg.gate_standardize) == ("topk", 0.1) and "|   always on |" in out


def test_threads_option_of_the_heavy_verbs_and_plain_flags(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests run on one thread (conftest.py): --threads 1 must change it
    try:
        with pytest.raises(SystemExit, match="not an activation cache"):  # --threads applies before the work
            main(
                [
                    "train",
                    "--threads",
                    "1",
                    "--cache",
                    str(tmp_path / "none"),
                    "--tokens",
                    "1024",
                    "--out",
                    str(tmp_path),
                ]
            )
        assert torch.get_num_threads() == 1
        with pytest.raises(SystemExit, match="--threads -1 must be >= 0"):
            main(["eval", str(tmp_path), "--threads", "-1"])
    finally:
        torch.set_num_threads(before)
    for verb in ("demo", "cache", "train", "eval"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        shown = capsys.readouterr().out
        assert "--threads int" in shown and "--nono" not in shown, verb


@pytest.mark.parametrize(
    "verb, old",
    [
        ("cache", "--layers"),
        ("cache", "--rows-per-block"),
        ("train", "--layers"),
        ("train", "--rows-per-block"),
        ("frontier", "--layers"),
        ("frontier", "--rows-per-block"),
        ("demo", "--layer"),
        ("spd-ablation", "--layer"),
    ],
)
def test_the_old_option_names_are_gone(verb, old, capsys):
    """0.2.0 dropped the old names of block-index and shard options (--blocks, --block, --rows-per-shard)."""
    import re

    with pytest.raises(SystemExit):
        main([verb, "--help"])
    shown = capsys.readouterr().out
    assert not re.search(rf"{old}(?![\w-])", shown), (verb, old)
    assert re.search(r"--blocks? |--rows-per-shard ", shown)


@pytest.mark.parametrize("command", ["", "check", "cache", "train", *sorted(STUDIES)])
def test_help_imports_no_torch(command):
    """`mxd-lens [SUB] --help` (every study's verb included) reads only light modules, so it answers at once."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom mxd_lens.cli import main\n"
        f"try:\n    main({[command, '--help'] if command else ['--help']!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'sae_lens', 'transformer_lens', 'pandas') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: mxd-lens" in done.stdout


def test_import_mxd_lens_registers_with_saelens_in_either_order():
    import subprocess
    import sys

    for first, second in (("mxd_lens", "sae_lens"), ("sae_lens", "mxd_lens")):
        code = (
            f"import {first}\nimport {second}\nfrom sae_lens.registry import SAE_CLASS_REGISTRY\n"
            "assert {'mxd_lens.mxd', 'mxd_lens.topk_transcoder', 'mxd_lens.skip_transcoder'} <= set(SAE_CLASS_REGISTRY)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (first, done.stderr[-2000:])


def test_eval_records_results_in_the_layer_and_info_shows_the_provenance(tmp_path, text_model, capsys):
    import json

    from mxd_lens import __version__
    from mxd_lens.evaluation import evaluate, held_out_batches
    from mxd_lens.layers.io import load_layer
    from mxd_lens.models import load_model

    stream = ["--model", "tiny", "--text", str(text_model), "--context-size", "12", "--rows-per-shard", "16"]
    learn = ["--arch", "mxd", "--k", "2", "--tokens", "320", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", str(tmp_path / "run")]) == 0
    folder = tmp_path / "run" / "final" / "L1.mxd.k2.m8"
    cfg = json.loads((folder / "cfg.json").read_text())["metadata"]
    assert cfg["mxd_lens_version"] == __version__ and cfg["training"]["model"]["name"] == "tiny-gated"
    assert cfg["training"]["data"]["digests"] and cfg["training"]["tokens"] == 320

    assert (
        main(
            [
                "eval",
                str(tmp_path / "run" / "final"),
                "--model",
                "tiny",
                "--eval-tokens",
                "240",
                "--context-size",
                "12",
            ]
        )
        == 0
    )
    record = json.loads((folder / "cfg.json").read_text())["metadata"]["evaluation"]
    assert record == {k: v for k, v in json.loads((folder / "eval.json").read_text()).items() if k != "row"}
    assert record["text"]["text"] == str(text_model) and record["text"]["split"] == "eval"
    # the recorded numbers are evaluate()'s on the eval side of the layer's own split
    model = load_model("tiny")
    batches = held_out_batches(model, text_model, "eval", 240, 12, 8, 0.02, 0)
    (row,) = evaluate(model, {"x": load_layer(folder)}, batches, progress=False)
    for key in ("delta_ce", "kl", "fvu", "l0", "dead_fraction"):
        assert record["metrics"][key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), key
    capsys.readouterr()
    assert main(["info", str(folder)]) == 0
    shown = capsys.readouterr().out
    assert "eval: delta_ce" in shown and "digest of corpus.txt" in shown and "tokens seen" in shown
    # the training text, all of it, overlaps what the layer was trained on: refused, named
    with pytest.raises(SystemExit, match="L1.mxd.k2.m8: .*overlap"):
        main(["eval", str(folder), "--model", "tiny", "--text", str(text_model), "--split", "all"])


def test_eval_with_another_copy_of_the_model_is_refused_unless_allowed(tmp_path, monkeypatch):
    """Same name, same shapes, another config digest: not the model the layer was trained on."""
    import json

    import mxd_lens.models
    from mxd_lens.layers.io import load_layer

    model, corpus = make_text_model(tmp_path)
    source = {"name": "m", "model_name": model.cfg.model_name, "kind": "hf_folder", "path": "/x/m"}
    model.mxd_lens_source = {**source, "config_sha256": "a" * 64}
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    stream = ["--model", "m", "--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16"]
    learn = ["--arch", "transcoder", "--k", "2", "--tokens", "320", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", str(tmp_path / "run")]) == 0
    folder = tmp_path / "run" / "final" / "L1.transcoder.k2.m8"
    evaluate = ["eval", str(folder), "--model", "m", "--eval-tokens", "120", "--context-size", "12"]
    model.mxd_lens_source = {**source, "path": "/elsewhere/m", "config_sha256": "a" * 64}  # moved: same
    assert main(evaluate) == 0
    model.mxd_lens_source = {**source, "config_sha256": "b" * 64}
    with pytest.raises(
        SystemExit,
        match=r"L1.transcoder.k2.m8 was trained on .*'a{64}'.* the model given is .*'b{64}'.*--allow-other-model",
    ):
        main(evaluate)
    assert main([*evaluate, "--allow-other-model"]) == 0
    record = json.loads((folder / "cfg.json").read_text())["metadata"]["evaluation"]
    assert record["model"]["config_sha256"] == "b" * 64
    assert load_layer(folder).cfg.metadata.training["model"]["config_sha256"] == "a" * 64


def test_info_flags_folders_that_cannot_load(tmp_path, capsys):
    import json

    from conftest import make_model

    from mxd_lens.layers import MxD, TopKTranscoder

    model = make_model("gpt2")
    names = ["good", "no_weights", "other_shapes", "unknown_arch", "garbled_cfg"]
    for name in names:
        TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / name)
    (tmp_path / "no_weights" / "sae_weights.safetensors").unlink()
    MxD.for_model(model, 1, d_sae=4, k=2).save_model(tmp_path / "mxd")
    cfg = json.loads((tmp_path / "other_shapes" / "cfg.json").read_text())
    (tmp_path / "other_shapes" / "cfg.json").write_text(json.dumps({**cfg, "d_sae": 16}))
    (tmp_path / "unknown_arch" / "cfg.json").write_text(json.dumps({**cfg, "architecture": "jumprelu"}))
    (tmp_path / "garbled_cfg" / "cfg.json").write_text(json.dumps(cfg)[:40])
    capsys.readouterr()
    assert main(["info", str(tmp_path / "good")]) == 0
    assert "PROBLEM" not in capsys.readouterr().out
    assert main(["info", *(str(tmp_path / n) for n in names[1:])]) == 1
    out = capsys.readouterr().out
    assert re.search(r"PROBLEM: .*no_weights lacks \['sae_weights.safetensors'\]", out)
    assert re.search(r"PROBLEM: .*other_shapes: weights do not fit TopKTranscoder.* wrong shape", out)
    assert re.search(r"PROBLEM: .*unknown_arch holds architecture 'jumprelu'", out)
    assert re.search(r"PROBLEM: .*garbled_cfg/cfg.json is not valid JSON", out)
    assert "4 of 4 layer folder(s) cannot be loaded" in out


def test_eval_from_another_folder_finds_what_the_record_names_and_says_what_it_cannot(
    tmp_path, monkeypatch, capsys
):
    """Relative model and text paths recorded at training are found from another directory through the
    absolute paths recorded beside them; a read-only layer folder keeps the measured table on screen;
    --eval-tokens 0 is refused."""
    import shutil

    import mxd_lens.fileio
    import mxd_lens.models

    model, corpus = make_text_model(tmp_path)
    work, other = tmp_path / "work", tmp_path / "other"
    (work / "models" / "m").mkdir(parents=True)
    other.mkdir()
    shutil.copy(corpus, work / "corpus.txt")
    asked = []
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: asked.append(name) or model)
    model.mxd_lens_source = {"name": "models/m", "kind": "hf_folder", "path": str(work / "models" / "m"),
                             "model_name": model.cfg.model_name, "config_sha256": "c" * 64}  # fmt: skip
    monkeypatch.chdir(work)
    stream = ["--model", "models/m", "--text", "corpus.txt", "--context-size", "12", "--rows-per-shard", "16"]
    learn = ["--arch", "transcoder", "--k", "2", "--tokens", "320", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", "run"]) == 0
    folder = work / "run" / "final" / "L1.transcoder.k2.m8"
    monkeypatch.chdir(other)
    assert (
        main(["eval", str(folder), "--eval-tokens", "120", "--context-size", "12", "--write", "false"]) == 0
    )
    assert asked[-1] == str(work / "models" / "m")
    with pytest.raises(SystemExit, match="--eval-tokens 0: evaluate at least one row"):
        main(["eval", str(folder), "--eval-tokens", "0", "--context-size", "12"])

    def read_only(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(mxd_lens.fileio, "atomic_write_text", read_only)
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"measured, but not recorded .*Permission denied.*--nowrite"):
        main(["eval", str(folder), "--eval-tokens", "120", "--context-size", "12"])
    assert (
        "L1.transcoder.k2.m8" in capsys.readouterr().out
        and "delta_ce" not in (folder / "cfg.json").read_text()
    )
    (work / "corpus.txt").unlink()
    with pytest.raises(
        SystemExit,
        match=r"training text '.*corpus.txt' recorded in .*cfg.json .*not found from .*give --text",
    ):
        main(["eval", str(folder), "--eval-tokens", "120", "--context-size", "12"])
    shutil.rmtree(work / "models")
    with pytest.raises(
        SystemExit, match=r"the model 'models/m' named in .*cfg.json .*not found .*give --model"
    ):
        main(["eval", str(folder), "--eval-tokens", "120", "--context-size", "12"])


def test_the_bundled_text_is_recorded_by_its_package_name(tmp_path, monkeypatch):
    """A layer trained on the text shipped with mxd-lens records it as mxd_lens:resources/..., which
    reads back wherever the package is installed (the absolute path would break once the checkout moves)."""
    import json

    import mxd_lens.models
    from mxd_lens import data

    model, _ = make_text_model(tmp_path)
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    name = data.text_name(data.default_text())
    assert name == "mxd_lens:resources/jane_austen_novels.txt.xz"
    assert data.resolve_text(name) == data.default_text()
    assert next(iter(data.iter_texts(name))) == next(iter(data.iter_texts(data.default_text())))
    assert data.source_digests(name) == data.source_digests(data.default_text())
    stream = [
        "--model",
        "tiny",
        "--text",
        str(data.default_text()),
        "--context-size",
        "12",
        "--rows-per-shard",
        "16",
    ]
    learn = ["--arch", "transcoder", "--k", "2", "--tokens", "160", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", str(tmp_path / "run")]) == 0
    folder = tmp_path / "run" / "final" / "L1.transcoder.k2.m8"
    recorded = json.loads((folder / "cfg.json").read_text())["metadata"]["training"]["data"]
    assert recorded["text"] == name and "path" not in recorded
    assert main(["eval", str(folder), "--model", "tiny", "--eval-tokens", "120", "--context-size", "12"]) == 0
    evaluation = json.loads((folder / "cfg.json").read_text())["metadata"]["evaluation"]
    assert evaluation["text"]["text"] == name


def test_tl_name_reaches_load_model_and_eval_reuses_the_recorded_one(tmp_path, monkeypatch):
    import mxd_lens.models

    model, corpus = make_text_model(tmp_path)
    model.mxd_lens_source = {"name": "tiny", "kind": "hf_folder", "tl_name": "google/gemma-3-270m"}
    asked = []
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: asked.append((name, kw)) or model)
    stream = [
        "--model",
        "tiny",
        "--tl-name",
        "google/gemma-3-270m",
        "--text",
        str(corpus),
        "--context-size",
        "12",
    ]
    learn = ["--arch", "mxd", "--k", "2", "--tokens", "160", "--batch-tokens", "32", "--no-progress"]
    assert (
        main(
            [
                "train",
                *stream,
                "--rows-per-shard",
                "16",
                "--blocks",
                "1",
                *learn,
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert asked[-1] == ("tiny", {"tl_name": "google/gemma-3-270m"})
    # eval without --model: the model and tl_name the training record names
    final = str(tmp_path / "run" / "final")
    assert main(["eval", final, "--eval-tokens", "120", "--context-size", "12", "--write", "false"]) == 0
    assert asked[-1] == ("tiny", {"tl_name": "google/gemma-3-270m"})


def test_probe_steer_and_inspect_run_end_to_end_on_a_data_folder(tmp_path, text_model, capsys):
    """The three study verbs on one trained layer: each writes its files under OUT/<verb folder>/."""
    import json
    import lzma
    import random

    import pandas as pd
    from conftest import WORDS

    rng, rows = random.Random(0), []
    for marker, label in zip(
        ("cat", "dogs", "birds", "rain", "hills"), ("en", "fr", "de", "es", "nl"), strict=True
    ):
        for _ in range(24):
            words = [rng.choice(WORDS[8:]) for _ in range(rng.randint(3, 8))]
            words.insert(rng.randrange(len(words)), marker)
            rows.append({"text": " ".join(words), "label": label})
    data = tmp_path / "data"
    data.mkdir()
    with lzma.open(data / "language_id.jsonl.xz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    stream = ["--model", "tiny", "--text", str(text_model), "--context-size", "12", "--rows-per-shard", "16"]
    learn = ["--arch", "mxd", "--k", "2", "--tokens", "320", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *stream, "--blocks", "1", *learn, "--out", str(tmp_path / "run")]) == 0
    final, out = tmp_path / "run" / "final", tmp_path / "out"
    where = ["--model", "tiny", "--out", str(out), "--threads", "1"]

    suite = ["--data", str(data), "--per-class", "20", "--context-size", "12"]
    assert main(["probe", "--layers", str(final), *suite, "--ks", "1", "2", *where]) == 0
    table = pd.read_csv(out / "probing" / "probing.csv")
    assert set(table.task.str.split("/").str[0]) == {"language_id"} and table.task.nunique() == 5
    assert {"1", "2"} <= set(table.k.astype(str))

    steer = ["--k", "2", "--tasks", "language_id/fr", "--multiples", "0", "4", "--samples", "2", "--new-tokens", "3",
             "--context-tokens", "0", "--probing", str(out / "probing" / "pooled")]  # fmt: skip
    assert main(["steer", "--layers", str(final), *suite, *steer, *where]) == 0
    steering = pd.read_csv(out / "steering" / "steering.csv")
    assert sorted(steering.multiple) == [0.0, 4.0] and (steering.task == "language_id/fr").all()

    layer = final / "L1.mxd.k2.m8"
    text = ["--text", str(text_model), "--tokens", "240", "--context-size", "12", "--n", "3"]
    assert main(["inspect", "--layer", str(layer), "--features", "0", "1", *text, *where]) == 0
    (page,) = (out / "inspect").glob("*.html")
    contexts = pd.read_csv(page.with_suffix(".csv"))
    assert set(contexts.feature) <= {0, 1} and len(contexts) <= 6

    with pytest.raises(SystemExit, match="mxd-lens steer: .*no/such"):
        main(["steer", "--layers", str(final), *suite, *steer[:2], "--tasks", "no/such", *where])

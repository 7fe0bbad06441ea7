"""The benchmark scripts run, and compare equal functions (speed itself is not tested)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import layer_speed  # noqa: E402


def test_layer_speed_runs_on_tiny_dims_and_checks_agreement(capsys):
    result = layer_speed.run(
        ["--tokens", "32", "--m", "2", "--d-model", "32", "--d-hidden", "32", "--k", "4", "--repeats", "1"]
    )
    assert result["dims"].n_experts == 32
    assert result["agreement"]["mxd output max|diff|"] < 1e-4
    assert result["agreement"]["tc output max|diff|"] < 1e-4
    assert "MxD sparse / Transcoder sparse" in capsys.readouterr().out


def test_spd_step_smoke_compares_old_and_new_steps_on_the_same_losses(capsys):
    import spd_step

    result = spd_step.run(["--smoke", "--hidden", "8"])
    (res,) = result["results"]
    assert res["median_s"]["old"] > 0 and res["median_s"]["new"] > 0
    # From the same parameters the losses agree to rounding; one Adam step later the parameters are
    # apart by that rounding (Adam divides it by sqrt(v)), so the second step's terms agree less tightly.
    assert max(res["rel_diff_first"].values()) <= 1e-5
    assert max(res["rel_diff"].values()) <= 1e-4
    assert "| H 8 |" in capsys.readouterr().out


def test_train_throughput_runs_on_a_tiny_model_and_reports_three_ratios(capsys):
    import math

    import train_throughput

    result = train_throughput.run(
        ["--tokens", "128", "--batch-tokens", "64", "--context-size", "16", "--rows-per-shard", "8"]
        + ["--rows-per-forward", "8", "--n-layers", "2", "--d-model", "32", "--d-mlp", "64", "--n-heads", "2"]
        + ["--d-vocab", "100", "--layer", "1", "--k", "4", "--m", "4"]
    )
    ratios = result["ratios"]
    assert set(ratios) == {"one_stream_vs_separate", "ours_vs_saelens", "cache_vs_live"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    assert result["steps"] == 2 and result["rows_read"]["SAELens store + our transcoder"] > 0
    assert "(b) our trainer / SAELens" in capsys.readouterr().out


def test_eval_speed_runs_on_a_tiny_model_and_the_evaluations_agree(capsys):
    """The benchmark asserts that ours (with and without baselines) and the previous implementation
    give the same numbers before it times them."""
    import subprocess

    import eval_speed
    from conftest import make_model

    root = Path(__file__).resolve().parents[1]
    history = subprocess.run(["git", "cat-file", "-e", eval_speed.PREVIOUS], cwd=root).returncode == 0
    median = eval_speed.main(
        ["--blocks", "0", "1", "--learners", "3", "--batches", "2", "--rows", "2", "--context", "12"]
        + ["--repeats", "1"]
        + ([] if history else ["--no-previous"]),  # a shallow clone has no PREVIOUS commit
        model=make_model("gated"),
    )
    expected = {"floor", "floor, no baselines", "ours", "ours, no baselines"}
    assert set(median) == expected | ({"previous"} if history else set())
    assert "| ours | " in capsys.readouterr().out


def test_eval_speed_large_vocabulary_smoke_run_agrees_with_the_dense_evaluation(capsys):
    """--large-vocab --smoke: one 2 x 32 batch through a 262,144-token vocabulary; the benchmark asserts
    that the chunked evaluation and the dense one (commit DENSE) give the same numbers."""
    import subprocess

    import eval_speed

    root = Path(__file__).resolve().parents[1]
    history = subprocess.run(["git", "cat-file", "-e", eval_speed.DENSE], cwd=root).returncode == 0
    median = eval_speed.main(["--large-vocab", "--smoke"] + ([] if history else ["--no-previous"]))
    assert set(median) >= {"floor", "ours"} and ("dense" in median) == history
    assert "tiny-vocab-262144" in capsys.readouterr().out


def test_mix_texts_interleaves_by_volume_and_keeps_every_document(tmp_path):
    from mxd_lens import data
    from mxd_lens.cli import main

    (tmp_path / "long.txt").write_text("\n\n".join(f"long {i} " + "x" * 400 for i in range(5)))
    (tmp_path / "short.txt").write_text("\n\n".join(f"short {i}" for i in range(200)))
    out = tmp_path / "mixed.txt.xz"
    assert main(["mix", str(tmp_path / "long.txt"), str(tmp_path / "short.txt"), "--out", str(out)]) == 0
    mixed = list(data.iter_texts(out))
    originals = list(data.iter_texts(tmp_path / "long.txt")) + list(data.iter_texts(tmp_path / "short.txt"))
    assert sorted(mixed) == sorted(originals)
    # by volume: about 400 characters of short documents (~50 of them) follow each long one
    first_two_long = [i for i, d in enumerate(mixed) if d.startswith("long")][:2]
    assert 40 <= first_two_long[1] - first_two_long[0] <= 60


def test_vs_sparsify_runs_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """Only where sparsify is installed (it is not a dependency): the three runs train on the same
    rows and report tokens/s and held-out FVU."""
    pytest.importorskip("sparsify")
    import json

    import vs_sparsify
    from test_models import write_tiny_gguf

    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path / "cache"))
    gguf = (
        write_tiny_gguf(tmp_path / "tiny-llama" / "tiny-llama.gguf")
        if (tmp_path / "tiny-llama").mkdir() is None
        else None
    )
    text = tmp_path / "text.txt"
    text.write_text(
        "\n\n".join(f"the cat sat on the mat number {i} and then it ran away" for i in range(300))
    )
    vs_sparsify.main(
        [
            "--model",
            str(gguf),
            "--text",
            str(text),
            "--layer",
            "1",
            "--k",
            "4",
            "--m",
            "4",
            "--tokens",
            "1024",
        ]
        + ["--context", "16", "--rows-per-step", "4", "--eval-tokens", "256", "--out", str(tmp_path / "out")]
    )
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["sparsify transcoder", "ours: transcoder", "ours: MxD"]
    assert len({r["train_tokens"] for r in rows}) == 1 and all(0 < r["heldout_fvu"] < 10 for r in rows)
    assert rows[0]["params"] == rows[1]["params"]  # the same transcoder size
    assert "time / sparsify" in capsys.readouterr().out


def test_stability_runs_each_clip_on_one_cache_and_counts_what_it_clipped(tmp_path, capsys):
    import stability
    from conftest import make_model
    from test_activations import random_rows

    from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
    from mxd_lens.layers.learners import LearnerSpec
    from mxd_lens.training import TrainConfig, Trainer

    write_cache(ModelActivations(make_model(), [1], random_rows(), 12, 16), tmp_path / "cache", n_shards=3)
    histories = stability.main(
        ["--cache", str(tmp_path / "cache"), "--block", "1", "--k", "4", "--m", "4", "--max-shards", "3"]
        + ["--batch-tokens", "32", "--total-steps", "12", "--stop", "9", "--clips", "none", "0.01"]
        + ["--window", "4", "--out", str(tmp_path / "out")]
    )
    free, clipped = histories["clip=None"], histories["clip=0.01"]
    assert len(free) == len(clipped) == 9  # stopped at 9 of the 12 steps' schedule
    # The unclipped run is the plain trainer's, step for step.
    reference = Trainer(
        [LearnerSpec("mxd", 1, 4, 4)],
        CachedActivations(tmp_path / "cache", blocks=[1], max_shards=3),
        TrainConfig(total_tokens=12 * 32, batch_tokens=32, grad_clip=None, log_every=1, checkpoint_every=0),
        progress=False,
    )
    reference.fit()
    assert [h["fvu"] for h in free] == [h["fvu"] for h in reference.learners["L1.mxd.k4.m4"].history[:9]]
    assert clipped[-1]["clipped_steps"] == sum(h["grad_norm"] > 0.01 for h in clipped) > 0
    table = (tmp_path / "out" / "stability.csv").read_text().splitlines()
    assert len(table) == 3 + 3  # header lines (run, metric, index name), windows ending at steps 4, 8, 9
    assert "clip=0.01: 9 steps" in capsys.readouterr().out


def test_many_learners_prints_each_architectures_ratio_to_the_floor(capsys):
    import many_learners

    argv = [
        "--d-model",
        "32",
        "--d-hidden",
        "64",
        "--tokens",
        "32",
        "--k",
        "4",
        "--learners",
        "2",
        "--repeats",
        "1",
    ]
    assert many_learners.main(argv) == 0
    out = capsys.readouterr().out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.startswith(("mxd:", "transcoder", "skip_transcoder"))
    ]
    assert [row[0] for row in rows] == ["mxd:gate=topk,gate_standardize=0.1", "transcoder", "skip_transcoder"]
    for row in rows:  # step, floor, step/floor: the ratio is the two columns' quotient
        step, floor, ratio = map(float, row[1:4])
        assert step > 0 and floor > 0 and ratio == pytest.approx(step / floor, rel=0.05)

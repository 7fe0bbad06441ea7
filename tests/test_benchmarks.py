"""The benchmark scripts run, and compare equal functions (speed itself is not tested)."""

import sys
from pathlib import Path

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


def test_train_throughput_runs_on_a_tiny_model_and_reports_three_ratios(capsys):
    import math

    import train_throughput

    result = train_throughput.run(
        ["--tokens", "128", "--batch-tokens", "64", "--context-size", "16", "--rows-per-block", "8"]
        + ["--forward-rows", "8", "--n-layers", "2", "--d-model", "32", "--d-mlp", "64", "--n-heads", "2"]
        + ["--d-vocab", "100", "--layer", "1", "--k", "4", "--m", "4"]
    )
    ratios = result["ratios"]
    assert set(ratios) == {"one_stream_vs_separate", "ours_vs_saelens", "cache_vs_live"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    assert result["steps"] == 2 and result["rows_read"]["SAELens store + our transcoder"] > 0
    assert "(b) our trainer / SAELens" in capsys.readouterr().out

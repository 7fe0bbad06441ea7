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

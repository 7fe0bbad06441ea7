"""The frontier study end to end on a tiny model and local text."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import make_text_model
from sae_lens import SAE

from mxd_lens.analysis.frontier import FrontierConfig, run_frontier


def test_frontier_trains_evaluates_and_writes_everything(tmp_path):
    model, corpus = make_text_model(tmp_path)
    config = FrontierConfig(
        text=str(corpus),
        layers=[1],
        ks=[2, 4],
        width_multiplier=8,
        train_tokens=64 * 12,
        eval_tokens=200,
        context_size=12,
        batch_tokens=64,
        lr=3e-3,
        rows_per_block=16,
        eval_fraction=0.1,
    )
    rows = run_frontier(model, config, tmp_path / "out", progress=False)
    assert sorted((r["method"], r["k"]) for r in rows) == [
        (m, k) for m in ("MxD", "Skip transcoder", "Transcoder") for k in (2, 4)
    ]
    for row in rows:
        assert row["train_tokens"] == 64 * 12 and row["model"] == "tiny-gated"
        assert row["l0"] <= row["k"] and row["tokens"] >= 200 - 20
        assert row["ce_spliced"] == pytest.approx(row["ce_clean"] + row["delta_ce"])
    record = json.loads((tmp_path / "out" / "frontier.json").read_text())
    assert record["config"]["ks"] == [2, 4] and len(record["results"]) == 6 and "command" in record
    assert len(pd.read_csv(tmp_path / "out" / "frontier.csv")) == 6
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 10_000
    # Parameter-matched: the MxD and the transcoder have (nearly) the same size.
    params = {r["method"]: r["params"] for r in rows if r["k"] == 2}
    assert abs(params["MxD"] - params["Transcoder"]) / params["Transcoder"] < 0.02
    weights = SAE.load_from_disk(tmp_path / "out" / "runs" / "final" / rows[0]["name"])
    assert weights.cfg.metadata.training["data"]["split"] == "train"
    # A second run reuses the cache and the finished training.
    again = run_frontier(model, config, tmp_path / "out", progress=False)
    assert [r["delta_ce"] for r in again] == [r["delta_ce"] for r in rows]

"""The frontier study end to end on a tiny model and local text."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch
from conftest import make_text_model
from sae_lens import SAE

from mxd_lens.config import RECOMMENDED_MXD, TrainConfig
from mxd_lens.layers import arch_label
from mxd_lens.studies.frontier import FrontierConfig
from mxd_lens.studies.frontier.run import plot_frontier, run_frontier


def test_frontier_trains_evaluates_and_writes_everything(tmp_path):
    model, corpus = make_text_model(tmp_path)
    config = FrontierConfig(
        text=str(corpus),
        blocks=[1],
        ks=[2, 4],
        width_multiplier=8,
        train_tokens=64 * 12,
        eval_tokens=200,
        context_size=12,
        train=TrainConfig(epochs=1.0, batch_tokens=64, lr=3e-3),
        rows_per_shard=16,
        eval_fraction=0.1,
    )
    rows = run_frontier(model, config, tmp_path / "out", progress=False)
    # By default the paper's MxD, the recommended one and both transcoders
    assert sorted((r["arch"], r["k"]) for r in rows) == [
        (m, k) for m in sorted(("mxd", RECOMMENDED_MXD, "skip_transcoder", "transcoder")) for k in (2, 4)
    ]
    assert {arch_label(r["arch"]) for r in rows} == {
        "MxD",
        "MxD (gate=topk, gate_standardize=0.1)",
        "Skip transcoder",
        "Transcoder",
    }  # rows carry keys; labels are rendered from them
    assert all("label" not in r and "method" not in r for r in rows)  # one column: arch
    for row in rows:
        assert row["train_tokens"] == 64 * 12 and row["model"] == "tiny-gated"
        assert row["l0"] <= row["k"] and row["tokens"] >= 200 - 20
        assert row["ce_spliced"] == pytest.approx(row["ce_clean"] + row["delta_ce"])
    record = json.loads((tmp_path / "out" / "frontier.json").read_text())
    assert record["config"]["ks"] == [2, 4] and len(record["results"]) == 8 and "command" in record
    assert len(pd.read_csv(tmp_path / "out" / "frontier.csv")) == 8
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 10_000
    # Parameter-matched: the MxD and the transcoder have (nearly) the same size.
    params = {r["arch"]: r["params"] for r in rows if r["k"] == 2}
    assert abs(params["mxd"] - params["transcoder"]) / params["transcoder"] < 0.02
    weights = SAE.load_from_disk(tmp_path / "out" / "runs" / "L1.seed0" / "final" / rows[0]["name"])
    assert rows[0]["weights"] == str(tmp_path / "out" / "runs" / "L1.seed0" / "final" / rows[0]["name"])
    assert weights.cfg.metadata.training["data"]["split"] == "train"
    # A second run reuses the cache and the finished training.
    again = run_frontier(model, config, tmp_path / "out", progress=False)
    assert [r["delta_ce"] for r in again] == [r["delta_ce"] for r in rows]


def test_frontier_grid_seeds_and_other_eval_text(tmp_path):
    """Grid entries add (block, K, seed) points; another seed trains in its own folder from the same
    cache with another initialisation; held-out text can be a separate file; the plot has a column of
    panels per block and error bars over seeds."""
    model, corpus = make_text_model(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(" ".join(d.split()[::-1]) for d in corpus.read_text().split("\n\n")[:80]))
    config = FrontierConfig(
        text=str(corpus),
        grid=["1:2@0,1", "0:2"],
        archs=["mxd", "transcoder"],
        eval_text=str(other),
        train_tokens=64 * 6,
        eval_tokens=120,
        context_size=12,
        train=TrainConfig(epochs=1.0, batch_tokens=64),
        rows_per_shard=16,
        eval_fraction=0.1,
    )
    assert config.learners() == [(1, 2, 0), (1, 2, 1), (0, 2, 0)] and config.all_blocks == [0, 1]
    rows = run_frontier(model, config, tmp_path / "out", progress=False)
    assert sorted((r["block"], r["seed"], r["arch"]) for r in rows) == [
        (0, 0, "mxd"), (0, 0, "transcoder"), (1, 0, "mxd"), (1, 0, "transcoder"),
        (1, 1, "mxd"), (1, 1, "transcoder"),
    ]  # fmt: skip
    by = {(r["block"], r["seed"], r["arch"]): r for r in rows}
    a = SAE.load_from_disk(by[(1, 0, "mxd")]["weights"])
    b = SAE.load_from_disk(by[(1, 1, "mxd")]["weights"])
    assert "L1.seed1" in by[(1, 1, "mxd")]["weights"] and not torch.equal(a.W_enc, b.W_enc)
    assert all(r["ce_clean"] == rows[0]["ce_clean"] for r in rows)  # every group on the same held-out batches
    fig = plot_frontier(pd.DataFrame(rows))
    assert len(fig.axes) == 6  # ΔCE, KL and FVU for each of the two blocks

    def spreads(ax):  # the lengths of a panel's error bars
        return [abs(seg[1][1] - seg[0][1]) for c in ax.containers for seg in c.lines[2][0].get_segments()]

    assert max(spreads(fig.axes[1])) > 0  # block 1's ΔCE panel: two seeds, so a spread
    assert max(spreads(fig.axes[0])) == 0  # block 0: one seed
    with pytest.raises(ValueError, match="BLOCK:K"):
        FrontierConfig(text=str(corpus), grid=["15-32"])
    with pytest.raises(ValueError, match="overlaps"):
        run_frontier(
            model, dataclasses.replace(config, eval_text=str(corpus)), tmp_path / "out", progress=False
        )


def test_summary_means_over_seeds_and_compares_with_the_transcoder(tmp_path):
    import json

    from mxd_lens.studies.frontier.run import load_results, summarize, summary_markdown

    rows = []
    # run_frontier writes the key ("mxd"); rows written before then hold the label ("MxD"); both are read
    for method, base in (("MxD", 0.01), ("Transcoder", 0.04), ("skip_transcoder", 0.02)):
        for seed in (0, 1):
            rows.append(dict(method=method, layer=15, k=32, seed=seed, delta_ce=base + 0.002 * seed, kl=base / 2,
                             fvu=0.1, l0=32.0, dead_fraction=0.01 * seed, ce_recovered_zero=0.9))  # fmt: skip
    rows.append(dict(method="mxd", layer=5, k=32, seed=0, delta_ce=0.005, kl=0.001, fvu=0.2, l0=30.0,
                     dead_fraction=0.0, ce_recovered_zero=0.95))  # fmt: skip
    (tmp_path / "frontier.json").write_text(json.dumps({"results": rows}))  # written before the rename
    table = load_results(tmp_path)
    assert "block" in table and "layer" not in table
    summary = summarize(table).set_index(["block", "k", "arch"])
    mxd = summary.loc[(15, 32, "mxd")]
    assert (
        mxd.seeds == 2 and mxd.delta_ce == pytest.approx(0.011) and mxd.dead_fraction == pytest.approx(0.005)
    )
    assert (mxd.delta_ce_min, mxd.delta_ce_max) == pytest.approx((0.010, 0.012))
    assert mxd.delta_ce_vs_transcoder == pytest.approx(0.011 / 0.041)
    assert summary.loc[(15, 32, "transcoder")].delta_ce_vs_transcoder == pytest.approx(1.0)
    assert (
        summary.loc[(5, 32, "mxd")].delta_ce_vs_transcoder
        != summary.loc[(5, 32, "mxd")].delta_ce_vs_transcoder
    )
    text = summary_markdown(summarize(table))
    assert "+0.0110 [+0.0100, +0.0120]" in text and "0.27" in text
    assert [line.split("|")[3].strip() for line in text.splitlines()[2:5]] == [
        "mxd",
        "mxd",
        "skip_transcoder",
    ]
    assert "grad clip" not in text  # one setting throughout: no column for it
    # A rerun of one point with clipping replaces that row and is marked in the table.
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    point = dict(rows[0], delta_ce=0.003)
    (rerun / "frontier.json").write_text(json.dumps({"results": [point], "train_config": {"grad_clip": 1.0}}))
    merged = load_results(tmp_path, [rerun])
    assert len(merged) == len(rows)
    mxd0 = merged[(merged.arch == "mxd") & (merged.block == 15) & (merged.seed == 0)]
    assert mxd0.delta_ce.tolist() == [0.003] and mxd0.grad_clip.tolist() == [1.0]
    assert mxd0.study.tolist() == [str(rerun)]
    text = summary_markdown(summarize(merged))
    clip_column = [line.split("|")[-2].strip() for line in text.splitlines()[2:]]
    assert clip_column[:3] == ["off", "mixed", "off"]  # block 5 mxd; block 15 mxd: seed 0 clipped, 1 not
    with pytest.raises(FileNotFoundError, match="no frontier results"):
        load_results(tmp_path / "missing")


def test_frontier_variants_rates_and_out_of_domain_text(tmp_path):
    """An architecture with options is a method of its own; arch_lr gives each its rate (the learner's
    optimiser runs at it, on the shared schedule); ood_text adds a second evaluation to every row."""
    model, corpus = make_text_model(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(" ".join(d.split()[::-1]) for d in corpus.read_text().split("\n\n")[:80]))
    config = FrontierConfig(
        text=str(corpus),
        blocks=[1],
        ks=[2],
        archs=["mxd", "mxd:gate=topk", "transcoder"],
        arch_lr=["transcoder=0.004", "mxd:gate=topk=0.001"],
        ood_text=str(other),
        ood_eval_tokens=96,
        train_tokens=64 * 6,
        eval_tokens=120,
        context_size=12,
        train=TrainConfig(epochs=1.0, batch_tokens=64, lr=2e-3),
        rows_per_shard=16,
        eval_fraction=0.1,
    )
    missing = dataclasses.replace(config, ood_text=str(tmp_path / "no" / "bbc.jsonl.xz"))
    with pytest.raises(ValueError, match="no such file or folder: .*bbc.jsonl.xz"):
        run_frontier(model, missing, tmp_path / "refused", progress=False)  # before any cache or training,
    assert not (tmp_path / "refused").exists()  # not after an hour of it (as it once did)
    rows = {r["arch"]: r for r in run_frontier(model, config, tmp_path / "out", progress=False)}
    assert set(rows) == {"mxd", "mxd:gate=topk", "transcoder"}
    assert (rows["mxd"]["lr"], rows["mxd:gate=topk"]["lr"], rows["transcoder"]["lr"]) == (2e-3, 1e-3, 4e-3)
    assert SAE.load_from_disk(rows["mxd:gate=topk"]["weights"]).cfg.gate == "topk"
    assert rows["mxd:gate=topk"]["l0"] == 2  # the signed gate: every selected code is active
    for row in rows.values():
        assert row["ood_tokens"] >= 96 - 12 and row["ood_kl"] >= 0 and row["ood_kl"] != row["kl"]
        assert 0 < row["ood_fvu"] and -1 <= row["ood_jacobian_cos"] <= 1
    from mxd_lens.studies.frontier.run import load_results, summarize, usage_markdown

    summary = summarize(load_results(tmp_path / "out"))
    text = usage_markdown(summary)
    assert "MxD (gate=topk)" in text and "KL (OOD)" in text and "always on" in text
    row = summary[summary.arch == "mxd:gate=topk"].iloc[0]
    assert row.ood_kl == pytest.approx(rows["mxd:gate=topk"]["ood_kl"]) and row.l0 == 2
    with pytest.raises(ValueError, match="write ARCH=LR"):
        dataclasses.replace(config, arch_lr=["mxd:0.001"])
    with pytest.raises(ValueError, match="not in archs"):
        dataclasses.replace(config, arch_lr=["skip_transcoder=0.001"])


def test_a_failed_out_of_domain_evaluation_resumes_after_the_held_out_one(tmp_path, monkeypatch):
    """A group whose OOD evaluation fails keeps its held-out rows: the rerun evaluates the OOD text only,
    and its rows are those of a run that never failed (the held-out record goes when the group ends)."""
    import mxd_lens.studies.frontier.run as frontier_run

    model, corpus = make_text_model(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(" ".join(d.split()[::-1]) for d in corpus.read_text().split("\n\n")[:80]))
    config = FrontierConfig(
        text=str(corpus), blocks=[1], ks=[2], archs=["mxd", "transcoder"], ood_text=str(other),
        ood_eval_tokens=96, train_tokens=64 * 4, eval_tokens=120, context_size=12,
        train=TrainConfig(epochs=1.0, batch_tokens=64, lr=2e-3), rows_per_shard=16, eval_fraction=0.1,
    )  # fmt: skip
    whole = run_frontier(model, config, tmp_path / "whole", progress=False)
    real_batches, real_evaluate, evaluated = frontier_run.held_out_batches, frontier_run.evaluate, []

    def failing(model, text, *args, **kwargs):
        if text == config.ood_text:
            raise OSError("the OOD text's disk went away")
        return real_batches(model, text, *args, **kwargs)

    def counting(model, layers, batches, **kwargs):
        evaluated.append(len(batches))
        return real_evaluate(model, layers, batches, **kwargs)

    monkeypatch.setattr(frontier_run, "held_out_batches", failing)
    monkeypatch.setattr(frontier_run, "evaluate", counting)
    with pytest.raises(OSError, match="went away"):
        run_frontier(model, config, tmp_path / "out", progress=False)
    assert len(evaluated) == 1 and (tmp_path / "out/runs/L1.seed0/eval-held-out.json").is_file()
    monkeypatch.setattr(frontier_run, "held_out_batches", real_batches)
    rows = run_frontier(model, config, tmp_path / "out", progress=False)
    assert len(evaluated) == 2  # the OOD text only: the held-out rows came from their record
    assert not (tmp_path / "out/runs/L1.seed0/eval-held-out.json").exists()
    for resumed, straight in zip(rows, whole, strict=True):
        differ = {k for k in resumed.keys() | straight.keys() if resumed.get(k) != straight.get(k)}
        # NaN (a standard error of one evaluation row) is not equal to itself
        nan = {k for k in differ if pd.isna(resumed.get(k)) and pd.isna(straight.get(k))}
        assert differ - nan == {"weights"}, differ  # the same numbers; only the folder differs


def test_each_learner_runs_at_its_own_rate_on_the_shared_schedule(tmp_path):
    from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
    from mxd_lens.config import StreamConfig
    from mxd_lens.layers.learners import LearnerSpec
    from mxd_lens.training import TrainConfig, Trainer

    model, corpus = make_text_model(tmp_path)
    stream = ModelActivations.from_config(model, [1], StreamConfig(text=str(corpus), context_size=12,
                                                                   rows_per_shard=16))  # fmt: skip
    write_cache(stream, tmp_path / "cache", n_shards=2, progress=False)
    specs = [LearnerSpec("transcoder", 1, 2, 8), LearnerSpec("transcoder", 1, 2, 8, lr=5e-4)]
    config = TrainConfig(total_tokens=64 * 4, batch_tokens=64, lr=2e-3, log_every=1, checkpoint_every=1000)
    trainer = Trainer(specs, CachedActivations(tmp_path / "cache"), config, progress=False)
    trainer.fit()
    base, own = (trainer.learners[s.name].optimizer.param_groups[0]["lr"] for s in specs)
    assert specs[1].name.endswith(".lr0.0005") and own == pytest.approx(base / 4)
    history = [trainer.learners[s.name].history for s in specs]
    assert [h["lr"] for h in history[0]] == [h["lr"] for h in history[1]]  # the run's schedule, logged


def test_plot_against_measured_l0_places_points_at_their_l0():
    rows = [
        {"block": 15, "k": k, "arch": m, "seed": 0, "delta_ce": 0.01, "kl": 0.01 * k, "fvu": 0.1, "l0": l0,
         "model": "m", "width_multiplier": 8, "train_tokens": 100}
        for m, ratio in (("mxd", 0.25), ("transcoder", 1.0)) for k in (16, 32) for l0 in [ratio * k]
    ]  # fmt: skip
    fig = plot_frontier(pd.DataFrame(rows), x="l0")
    lines = {c.get_label(): c.lines[0] for c in fig.axes[1].containers}
    assert list(lines["MxD"].get_xdata()) == [4.0, 8.0] and list(lines["Transcoder"].get_xdata()) == [16, 32]
    assert "L0 measured" in fig.axes[0].get_xlabel()
    with pytest.raises(ValueError, match="choose 'k' or 'l0'"):
        plot_frontier(pd.DataFrame(rows), x="K")


def test_frontier_starts_mxd_from_the_mlp_on_request(tmp_path):
    """init="mlp": the MxD learners copy the host MLP's E, b_E and D (as `train --init mlp`), the
    transcoder starts as always; rows say which."""
    from mxd_lens.studies.frontier.run import _init

    model, corpus = make_text_model(tmp_path)
    config = FrontierConfig(text=str(corpus), blocks=[1], ks=[2], width_multiplier=8, train_tokens=64 * 12,
                            eval_tokens=100, context_size=12, train=TrainConfig(epochs=1.0, batch_tokens=64), rows_per_shard=16,
                            eval_fraction=0.1, archs=["mxd", "transcoder"], init="mlp")  # fmt: skip
    assert _init("mxd:gate=topk", config) == "mlp" and _init("transcoder", config) == "default"
    rows = run_frontier(model, config, tmp_path / "out", progress=False)
    assert sorted((r["arch"], r["init"]) for r in rows) == [("mxd", "mlp"), ("transcoder", "default")]
    names = sorted(p.name for p in (tmp_path / "out" / "runs" / "L1.seed0" / "final").iterdir() if p.is_dir())
    assert names == ["L1.mxd.k2.m8.init-mlp", "L1.transcoder.k2.m8"]
    with pytest.raises(ValueError, match="init='given': choose 'default' or 'mlp'"):
        FrontierConfig(text=str(corpus), blocks=[1], ks=[2], init="given")

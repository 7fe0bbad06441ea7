"""The studies' one shape: the registry makes verbs, the report writer writes what a study returns, and
a new study is one folder plus one registration line (the docs' example, run through `mxd-lens`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import make_text_model, randomise

from mxd_lens.cli import main
from mxd_lens.layers import TopKTranscoder
from mxd_lens.studies import STUDIES, Study, StudyResult, get_study, register_study
from mxd_lens.studies.report import Column, columns, render_table, write_result

DOCS = Path(__file__).resolve().parents[1] / "docs" / "studies.md"


def docs_example(name: str) -> str:
    """The code block that follows the line naming ``name`` in docs/studies.md."""
    found = re.search(rf"`{re.escape(name)}`:\n\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert found, name
    return found[1]


def test_the_docs_example_study_runs_as_a_verb_and_measures_what_a_hand_loop_does(
    tmp_path, monkeypatch, capsys
):
    package = tmp_path / "toy_study"
    package.mkdir()
    (package / "__init__.py").write_text(docs_example("toy_study/__init__.py"))
    (package / "run.py").write_text(docs_example("toy_study/run.py"))
    model, _ = make_text_model(tmp_path)
    import mxd_lens.models

    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    monkeypatch.chdir(tmp_path)  # --import finds modules in the current directory
    monkeypatch.delitem(STUDIES, "toy-usage", raising=False)
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=16, k=3), 0, scale=0.3)
    layer.save_model(tmp_path / "L1")
    try:
        argv = [
            "--import",
            "toy_study",
            "toy-usage",
            "--layers",
            str(tmp_path / "L1"),
            "--tokens",
            "128",
            "--context-size",
            "12",
        ]
        assert main([*argv, "--model", "tiny", "--out", str(tmp_path / "out")]) == 0
    finally:
        STUDIES.pop("toy-usage", None)
        sys.modules.pop("toy_study", None)
        sys.modules.pop("toy_study.run", None)
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "out" / "toy-usage" / "toy_usage.csv")
    # by hand: the same rows of the bundled text, the MLP input from the model's own cache, the codes
    from mxd_lens.analysis.inspect import text_batches

    batch = next(iter(text_batches(model, None, 128, 12)))
    with torch.no_grad():
        _, cache = model.run_with_cache(batch, names_filter="blocks.1.ln2.hook_normalized")
        codes = layer.encode(cache["blocks.1.ln2.hook_normalized"].reshape(-1, model.cfg.d_model))
    assert table.l0[0] == pytest.approx(float((codes != 0).sum(-1).float().mean()))
    assert table.tokens[0] == codes.shape[0]
    assert "| L1 " in printed and f"{table.l0[0]:.1f}" in printed


def test_the_registry_refuses_what_would_shadow_or_mislead():
    with pytest.raises(ValueError, match="already registered"):
        register_study(Study("probe", "another", "x:Y", "x.run:run"))
    with pytest.raises(ValueError, match="usable as a verb"):
        register_study(Study("two words", "x", "x:Y", "x.run:run"))
    with pytest.raises(TypeError, match="takes a mxd_lens.studies.Study"):
        register_study({"name": "x"})
    with pytest.raises(KeyError, match="no study named 'nope'"):
        get_study("nope")
    assert get_study("probe").out_folder("results") == Path("results/probing")
    assert get_study("frontier").out_folder("results/f") == Path("results/f")
    assert get_study("eval").out_folder(None) is None


def test_the_report_writer_writes_every_part_and_renders_by_the_column_specs(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    table = pd.DataFrame({"name": ["a", "b"], "delta_ce": [0.01234, -0.5], "delta_ce_se": [0.001, 0.02],
                          "dead_fraction": [0.25, 0.0], "params": [1234567, 12]})  # fmt: skip
    result = StudyResult(
        name="study", table=table, record={"path": Path("x"), "n": torch.tensor(3)},
        tables={"sub/extra.csv": table.set_index("name")}, figures={"plot.png": fig},
        pages={"sub/page.html": "<p>hi</p>"},
    )  # fmt: skip
    written = write_result(result, tmp_path)
    assert {str(p.relative_to(tmp_path)) for p in written} == {
        "study.csv", "study.json", "sub/extra.csv", "plot.png", "sub/page.html"}  # fmt: skip
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "study.csv"), table)
    assert pd.read_csv(tmp_path / "sub/extra.csv", index_col="name").loc["b", "params"] == 12
    assert json.loads((tmp_path / "study.json").read_text()) == {"path": "x", "n": 3}
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.rglob(".*.tmp"))  # every temporary renamed into place
    shown = render_table(table, columns("name", "delta_ce", "dead_fraction", "params", se=("delta_ce",)))
    header, _, first, second = shown.splitlines()
    assert [h.strip() for h in header.strip("|").split("|")] == ["layer", "ΔCE ± se", "silent", "params"]
    assert [c.strip() for c in first.strip("|").split("|")] == ["a", "+0.0123 ± 0.0010", "25%", "1,234,567"]
    assert [c.strip() for c in second.strip("|").split("|")] == ["b", "-0.5000 ± 0.0200", "0%", "12"]
    assert Column("x", format="{:.2f}").render(float("nan")) == ""


def test_each_metric_is_described_once_and_each_architecture_label_only_in_the_registry():
    """`git grep` for a column spec and for the architectures' labels: one place each."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "grep", "-n", 'Column("delta_ce"', "--", "mxd_lens"], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    assert len(done.stdout.splitlines()) == 1, done.stdout
    # labels are set once, on the layer classes (the registry reads them); nothing else spells or compares one
    for pattern in ('label = "', '"Skip transcoder"', '"TopK transcoder"', '== "MxD"', '!= "MxD"'):
        found = subprocess.run(["git", "grep", "-n", pattern, "--", "mxd_lens"], cwd=root, capture_output=True,
                               text=True).stdout.splitlines()  # fmt: skip
        assert all(line.startswith("mxd_lens/layers/") for line in found), found

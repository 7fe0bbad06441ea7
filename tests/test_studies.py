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
            "384",  # 4 batches of 8 rows of 12: --tokens is read in full, not one batch
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

    batches = list(text_batches(model, None, 384, 12))
    with torch.no_grad():
        codes = []
        for batch in batches:
            _, cache = model.run_with_cache(batch, names_filter="blocks.1.ln2.hook_normalized")
            codes.append(layer.encode(cache["blocks.1.ln2.hook_normalized"].reshape(-1, model.cfg.d_model)))
        codes = torch.cat(codes)
    assert len(batches) == 4 and table.tokens[0] == codes.shape[0] == 384
    assert table.l0[0] == pytest.approx(float((codes != 0).sum(-1).float().mean()))
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
    # tables hold architecture keys; the rendered table shows their labels
    keyed = pd.DataFrame({"arch": ["mxd:gate=topk", "transcoder"], "kl": [0.01, 0.02]})
    rendered = render_table(keyed, columns("arch", "kl")).splitlines()
    assert [c.strip() for c in rendered[2].strip("|").split("|")] == ["MxD (gate=topk)", "0.0100"]
    assert rendered[0].strip("|").split("|")[0].strip() == "architecture" and "Transcoder" in rendered[3]


def test_each_metric_is_described_once_and_each_architecture_label_only_in_the_registry():
    """`git grep` for a column spec and for the architectures' labels: one place each."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "grep", "-n", 'Column("delta_ce"', "--", "mxd_lens"], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    assert len(done.stdout.splitlines()) == 1, done.stdout
    # the built-in labels are spelled once, in the torch-free table the layer classes read theirs from
    # (saved_layers.BUILT_IN); only a layer class sets one; nothing else spells or compares one
    for pattern, where in (('label = "', "mxd_lens/layers/"), ('"Skip transcoder"', "mxd_lens/saved_layers.py"),
                           ('"Transcoder"', "mxd_lens/saved_layers.py"), ('== "MxD"', "mxd_lens/layers/"),
                           ('!= "MxD"', "mxd_lens/layers/")):  # fmt: skip
        found = subprocess.run(["git", "grep", "-n", pattern, "--", "mxd_lens"], cwd=root, capture_output=True,
                               text=True).stdout.splitlines()  # fmt: skip
        assert all(line.startswith(where) for line in found), found
    labels = subprocess.run(["git", "grep", "-c", '"Skip transcoder"', "--", "mxd_lens"], cwd=root,
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    assert labels == ["mxd_lens/saved_layers.py:1"], labels


PLUG_TABLE = '''
from dataclasses import dataclass

from mxd_lens.studies import Study, StudyResult, register_study


@dataclass
class Options:
    """A table of a few rows."""

    rows: int = 2
    """rows to write"""


def run(model, options, out):
    import pandas as pd

    return StudyResult(name="t", table=pd.DataFrame({"x": range(options.rows)}))


register_study(Study("plug-table", "a table", "plug_table:Options", "plug_table:run", model=None,
                     where="mxd_lens.studies.common:Output"))
'''


def test_an_import_reads_only_the_named_module_from_the_working_folder(tmp_path, monkeypatch):
    """`--import MODULE` reads MODULE.py from the working folder, but the folder is not put on sys.path:
    a pandas.py (or any module) lying there never runs in place of the installed one."""
    (tmp_path / "plug_table.py").write_text(PLUG_TABLE)
    (tmp_path / "pandas.py").write_text("raise SystemExit('the pandas.py of the working folder ran')\n")
    (tmp_path / "shadow_probe_xyz.py").write_text("raise SystemExit('shadow_probe_xyz ran')\n")
    # -P: Python itself puts no working folder on sys.path (as for the installed `mxd-lens` script)
    line = [sys.executable, "-P", "-m", "mxd_lens.cli", "--import", "plug_table", "plug-table", "--out", "o"]
    done = subprocess.run(line, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert pd.read_csv(tmp_path / "o" / "plug-table" / "t.csv").x.tolist() == [0, 1]
    # in this process too: the plug-in is imported, the folder stays off sys.path
    import importlib.util

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        with pytest.raises(SystemExit):
            main(["--import", "plug_table", "plug-table", "--help"])
        assert "plug-table" in STUDIES and sys.modules["plug_table"].__file__ == str(
            tmp_path / "plug_table.py"
        )
        assert str(tmp_path) not in sys.path and importlib.util.find_spec("shadow_probe_xyz") is None
    finally:
        STUDIES.pop("plug-table", None)
        sys.modules.pop("plug_table", None)


def test_a_broken_import_is_one_line_naming_it_and_its_traceback_is_on_request(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raising_plug.py").write_text("raise RuntimeError('boom in the plug-in')\n")
    (tmp_path / "syntax_plug.py").write_text("def broken(:\n")
    (tmp_path / "taken_plug.py").write_text(
        "from mxd_lens.studies import Study, register_study\n"
        "register_study(Study('train', 'x', 'taken_plug:X', 'taken_plug:run'))\n"
    )
    cases = {
        "raising_plug": "mxd-lens: --import raising_plug: boom in the plug-in",
        "syntax_plug": "mxd-lens: --import syntax_plug: SyntaxError: ",
        "taken_plug": "mxd-lens: --import taken_plug: study name 'train' is a built-in command of mxd-lens",
    }
    try:
        for module, first in cases.items():
            with pytest.raises(SystemExit) as info:
                main(["--import", module, "probe", "--help"])
            lines = str(info.value).split("\n")
            assert lines[0].startswith(first) and len(lines) == 2 and "MXD_LENS_DEBUG=1" in lines[1], lines
        with pytest.raises(
            SystemExit, match=r"^mxd-lens: --import nowhere_xyz: no nowhere_xyz.py .* installed"
        ):
            main(["--import", "nowhere_xyz", "probe", "--help"])
        with pytest.raises(RuntimeError, match="boom in the plug-in"):  # the error itself, on request
            main(["--debug", "--import", "raising_plug", "probe", "--help"])
        with pytest.raises(SyntaxError):
            main(["--import", "syntax_plug", "--debug", "probe", "--help"])
    finally:
        for module in cases:
            sys.modules.pop(module, None)
    assert "train" not in STUDIES


@pytest.fixture
def entry_points(monkeypatch):
    """Serve the given entry points as the installed ones of mxd_lens.studies, loaded afresh."""
    import importlib.metadata
    import types

    import mxd_lens.studies

    module = types.ModuleType("plug_ep_xyz")
    module.STUDY = Study("plugged-verb", "a plugged-in study", "plug_ep_xyz:X", "plug_ep_xyz:run")
    module.PROBE = Study("probe", "another probe", "plug_ep_xyz:X", "plug_ep_xyz:run")
    module.TRAIN = Study("train", "another train", "plug_ep_xyz:X", "plug_ep_xyz:run")
    monkeypatch.setitem(sys.modules, "plug_ep_xyz", module)
    served = []

    def serve(*points):
        served[:] = [importlib.metadata.EntryPoint(name, value, "mxd_lens.studies") for name, value in points]
        monkeypatch.setattr(mxd_lens.studies, "_PLUGINS_LOADED", False)

    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: served if group == "mxd_lens.studies" else []
    )
    yield serve
    STUDIES.pop("plugged-verb", None)


def test_a_broken_entry_point_is_one_warning_line_and_breaks_no_verb(entry_points, capsys):
    entry_points(("broken", "no_such_package_xyz:STUDY"), ("plugged-verb", "plug_ep_xyz:STUDY"))
    with pytest.raises(SystemExit) as info:
        main(["prbe"])  # a mistyped verb: argparse's own error, not the plug-in's traceback
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'prbe'" in err and "Traceback" not in err
    assert (
        "mxd-lens: warning: skipped the mxd_lens.studies plug-in 'broken' (no_such_package_xyz:STUDY): it "
        "failed to load: ModuleNotFoundError: No module named 'no_such_package_xyz'\n" in err
    )
    entry_points(("broken", "no_such_package_xyz:STUDY"))
    with pytest.raises(SystemExit) as info:
        main(["--debug", "--help"])  # the traceback on request
    assert info.value.code == 0 and "Traceback" in capsys.readouterr().err


def test_plugin_registration_errors_are_one_line_each(entry_points, capsys):
    entry_points(("probe", "plug_ep_xyz:PROBE"), ("train", "plug_ep_xyz:TRAIN"), ("dumps", "json:dumps"))
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    captured = capsys.readouterr()
    assert info.value.code == 0 and "usage: mxd-lens" in captured.out and "Traceback" not in captured.err
    warnings = captured.err.splitlines()
    assert len(warnings) == 3 and all(
        w.startswith("mxd-lens: warning: skipped the mxd_lens.studies") for w in warnings
    )
    assert "a study named 'probe' is already registered" in warnings[0]
    assert "study name 'train' is a built-in command of mxd-lens" in warnings[1]
    assert "it is a function, not a mxd_lens.studies.Study" in warnings[2]
    assert STUDIES["probe"].summary == "sparse probing of saved layers" and "train" not in STUDIES


def test_installed_plugin_verbs_are_listed_in_the_help(entry_points, capsys):
    entry_points(("plugged-verb", "plug_ep_xyz:STUDY"))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"plugged-verb +a plugged-in study", capsys.readouterr().out)


@pytest.mark.parametrize(
    "study, message",
    [
        (Study("../escape", "x", "x:Y", "x.run:run"), "usable as a verb and a folder name"),
        (Study("a/b", "x", "x:Y", "x.run:run"), "usable as a verb and a folder name"),
        (Study("ok", "x", "x:Y", "x.run:run", folder="../escape"), "must be a plain folder name"),
        (Study("ok", "x", "x:Y", "x.run:run", folder="/tmp"), "must be a plain folder name"),
        (Study("cache", "x", "x:Y", "x.run:run"), "is a built-in command"),
    ],
)
def test_a_study_that_could_write_outside_out_or_shadow_a_command_is_refused(study, message):
    with pytest.raises(ValueError, match=message):
        register_study(study)
    assert study.name not in STUDIES
    with pytest.raises(ValueError, match="not a plain folder name"):  # nor can one built by hand
        Study("../escape", "x", "x:Y", "x.run:run").out_folder("results")

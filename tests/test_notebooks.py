"""The quickstart notebook runs top to bottom (its cells assert what they show)."""

from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
    )
    assert "add_sae loss" in outputs and "FVU" in outputs


def test_smollm2_notebook_is_committed_executed():
    """The real-model notebook is not run in CI (minutes on a CPU); its committed copy must carry the
    outputs of one complete run: every code cell executed in order, no error, the plot as a PNG."""
    nb = nbformat.read(ROOT / "notebooks" / "smollm2_mxd.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    outputs = [o for cell in code for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the frontier plot did not render"
    assert all(cell.outputs for cell in code[1:]), "a code cell has no output"


def test_notebooks_are_what_their_build_scripts_write(monkeypatch):
    """Each committed notebook's cells are exactly its build script's (so regenerating one loses no edit
    made to the other): the quickstart byte for byte, the SmolLM2 notebook up to its recorded outputs."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "notebooks"))
    build = importlib.import_module("build_quickstart")
    for script, name in (("build_quickstart", "quickstart.ipynb"), ("build_smollm2", "smollm2_mxd.ipynb")):
        built = build.notebook(importlib.import_module(script).CELLS)
        committed = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        assert [(c.cell_type, c.source) for c in committed.cells] == [
            (c.cell_type, c.source) for c in built.cells
        ], f"notebooks/{name} differs from what notebooks/{script}.py writes: edit the script and rerun it"
    quickstart = ROOT / "notebooks" / "quickstart.ipynb"
    assert nbformat.writes(build.notebook(build.CELLS)) + "\n" == quickstart.read_text()

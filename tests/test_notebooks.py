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

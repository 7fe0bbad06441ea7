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

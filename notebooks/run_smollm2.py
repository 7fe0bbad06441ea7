"""Executes notebooks/smollm2_mxd.ipynb in place (outputs saved into it), from the notebooks folder.

HF_HUB_OFFLINE=1 python notebooks/run_smollm2.py
"""

from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def main() -> None:
    path = HERE / "smollm2_mxd.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
    ).execute()
    nbformat.write(nb, path)
    print(f"executed {path}")


if __name__ == "__main__":
    main()

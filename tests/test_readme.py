"""The README's Python example runs as written, on a tiny gated model standing in for the default one."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import make_text_model

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch):
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    import mxd_lens.models

    model, _ = make_text_model(tmp_path, kind="gated")
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda *args, **kw: model)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    with torch.no_grad():
        clean = model(namespace["tokens"], return_type="loss")
        torch.testing.assert_close(namespace["loss"], clean)  # the exact MxD leaves the loss unchanged
        torch.testing.assert_close(namespace["y"], namespace["mxd"](namespace["x"]))
        torch.testing.assert_close(namespace["same"](namespace["x"]), namespace["y"])
    assert type(namespace["same"]) is type(namespace["mxd"]) and (tmp_path / "my-mxd" / "cfg.json").is_file()


def test_the_readme_demo_numbers_are_those_of_the_recorded_demo_output():
    """Every number the README quotes from `mxd-lens demo` appears in its recorded output
    (docs/results/demo/demo.txt, written by the command); re-run the demo and copy its output there
    when the demo changes. Timings are quoted separately and left out (they are not in the output)."""
    text = README.read_text()
    block = text.split("<!-- demo numbers")[1].split("<!-- end demo numbers -->")[0]
    block = re.split(r"It (?:leaves|left)", block)[0].replace(
        "−", "-"
    )  # numbers before the timing and disk note
    output = (README.parent / "docs" / "results" / "demo" / "demo.txt").read_text()
    numbers = re.findall(r"[-+]?\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+", block)
    assert len(numbers) >= 12, numbers
    for number in numbers:
        assert number in output, f"README quotes {number}, which the recorded demo output does not show"

"""`mxd-lens info` reads a saved layer from its files (mxd_lens.saved_layers), without torch, SAELens or
TransformerLens, and flags what loading it would refuse; `--help` of every verb and `check`'s argument
errors import none of them either. Checked against the layers themselves: their state dicts, and what
mxd_lens.layers.io.check_layer_folder (which loads the folder) says of the same folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_model
from safetensors.torch import save_file

from mxd_lens.cli import layer_folder_problem
from mxd_lens.layers import BUILT_IN, BatchTopKTranscoder, MxD, TopKSkipTranscoder, TopKTranscoder
from mxd_lens.layers.io import check_layer_folder
from mxd_lens.saved_layers import BUILT_IN as FILES
from mxd_lens.saved_layers import non_finite

# every verb's --help, then check's argument errors, then info: each must leave these unimported
SCRIPT = """
import contextlib, io, json, sys
from mxd_lens.cli import build_parser, main
HEAVY = ("torch", "transformer_lens", "sae_lens")
verbs = sorted(build_parser()._subparsers._group_actions[0].choices)
errors = [["check", "--k", "0"], ["check", "--m", "0"], ["check", "--k", "128"], ["check", "--k", "x"],
          ["frontier"], ["frontier", "--blocks", "3", "--init", "x"], ["demo", "--k", "0"], ["cache", "--out", "c"],
          ["eval", "x", "--eval-tokens", "0"], ["attribute"], ["train", "--out", "o"], ["info", "nowhere"]]
lines = [("help", [v, "--help"]) for v in verbs] + [("help", ["--help"])] + [("error", w) for w in errors]
lines.append(("info", ["info", *sys.argv[1:]]))
seen = []
for kind, words in lines:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(words)
        except SystemExit as stop:
            code = stop.code
    seen.append({"kind": kind, "words": words, "code": code, "out": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]})
print(json.dumps(seen))
"""


def test_info_help_and_argument_errors_import_no_torch(tmp_path):
    model = make_model("gated")
    MxD.for_model(model, 1, d_sae=4, k=2).save_model(tmp_path / "mxd")
    TopKSkipTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "skip")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert len(seen) > 15 and {"info", "check", "eval", "frontier", "demo"} <= {s["words"][0] for s in seen}
    for line in seen:
        assert line["heavy"] == [], (line["words"], line["heavy"])
        if line["kind"] == "help":
            assert line["code"] == 0 and "usage: mxd-lens" in line["out"], line["words"]
        elif line["kind"] == "error":  # refused, before anything heavy
            assert line["code"] not in (0, None), line["words"]
    by_words = {" ".join(s["words"][:3]): s for s in seen}
    for words in ("check --k 0", "check --m 0", "check --k 128"):  # the gated MxD at m = 8 has 127 experts
        assert "mxd-lens check: --" in str(by_words[words]["code"]), by_words[words]
    info = seen[-1]
    assert info["code"] == 0 and "PROBLEM" not in info["out"]
    assert "mxd (MxD)" in info["out"] and "skip_transcoder (Skip transcoder)" in info["out"]


def test_the_files_table_says_what_each_built_in_layer_writes():
    """Each built-in architecture's entry (key, label, class names, variant defaults, tensors) against the
    layer class and the state dicts of layers built at several sizes and forms."""
    import dataclasses

    from sae_lens.constants import SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME

    from mxd_lens.saved_layers import CFG_FILENAME, WEIGHTS_FILENAME

    assert (CFG_FILENAME, WEIGHTS_FILENAME) == (SAE_CFG_FILENAME, SAE_WEIGHTS_FILENAME)
    assert set(FILES) == {cls.config_class.architecture() for cls in BUILT_IN.values()}
    for key, cls in BUILT_IN.items():
        entry = FILES[cls.config_class.architecture()]
        assert (entry.key, entry.label, entry.class_name) == (key, cls.label, cls.__name__)
        assert entry.config_name == cls.config_class.__name__
        defaults = {f.name: f.default for f in dataclasses.fields(cls.config_class)}
        assert entry.variants == {name: defaults[name] for name in cls.config_class.variant_fields}
    for kind in ("gpt2", "gated"):
        model = make_model(kind)
        for cls in (MxD, TopKTranscoder, TopKSkipTranscoder, BatchTopKTranscoder):
            for d_sae in (4, 24):
                layer = cls.for_model(model, 1, d_sae=d_sae, k=2)
                cfg = json.loads(json.dumps(layer.cfg.to_dict()))
                expected = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
                assert FILES[cfg["architecture"]].tensors(cfg) == expected, (kind, cls.__name__, d_sae)


def _damaged_folders(root):
    """Layer folders each with one thing loading refuses (and two good ones), by name."""
    model = make_model("gated")
    for name in ("good_mxd", "bad_k", "shapes", "extra", "nan_bf16", "inf_f32", "cut_short", "unknown"):
        layer = (MxD if name.endswith("mxd") else TopKSkipTranscoder).for_model(model, 1, d_sae=8, k=2)
        layer.save_model(root / name)
    BatchTopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(root / "good_batchtopk")

    def edit_cfg(name, **fields):
        cfg = json.loads((root / name / "cfg.json").read_text())
        (root / name / "cfg.json").write_text(json.dumps({**cfg, **fields}))

    def edit_weights(name, change):
        path = root / name / "sae_weights.safetensors"
        from safetensors.torch import load_file

        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"architecture": "mxd_lens.skip_transcoder"})

    edit_cfg("bad_k", k=9)
    edit_cfg("shapes", d_out=12)
    edit_weights("extra", lambda t: t.update(W_extra=torch.zeros(2)))

    def nan_bf16(t):
        t.update({k: v.to(torch.bfloat16) for k, v in t.items()})
        t["W_dec"][1, 2] = float("nan")
        t["W_dec"][3, 4] = float("-inf")

    edit_weights("nan_bf16", nan_bf16)
    edit_weights("inf_f32", lambda t: t["b_enc"].__setitem__(5, float("inf")))
    weights = root / "cut_short" / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    edit_cfg("unknown", architecture="jumprelu")
    return sorted(p.name for p in root.iterdir())


def test_check_folder_says_what_loading_the_folder_says(tmp_path):
    """The same words as check_layer_folder (which loads the folder) for every folder: None for the good
    ones, the same one line for each damaged one."""
    for name in _damaged_folders(tmp_path):
        loaded = check_layer_folder(tmp_path / name)
        assert (loaded is None) == name.startswith("good"), (name, loaded)
        assert layer_folder_problem(tmp_path / name) == loaded, name


def test_non_finite_counts_nan_and_infinite_values_of_every_float_type(tmp_path):
    """Counted from the bits, against torch's isnan / isinf, in float64, 32, 16 and bfloat16."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=generator, dtype=torch.float64) * 1e3
    values[torch.randperm(1000, generator=generator)[:30]] = float("nan")
    values[torch.randperm(1000, generator=generator)[:20]] = float("inf")
    values[torch.randperm(1000, generator=generator)[:10]] = float("-inf")
    dtypes = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    tensors = {name: values.to(dtype) for name, dtype in dtypes.items()}
    tensors["finite"] = torch.zeros(5)
    tensors["ints"] = torch.arange(6)
    save_file(tensors, tmp_path / "w.safetensors")
    expected = [
        (name, int(t.isnan().sum()), int(t.isinf().sum()), t.numel())
        for name, t in sorted(tensors.items())
        if t.is_floating_point() and not t.isfinite().all()
    ]
    assert non_finite(tmp_path / "w.safetensors") == expected
    assert {name for name, *_ in expected} == set(dtypes)  # float16 overflows more of them to inf


@pytest.mark.parametrize("words", [["--k", "0"], ["--m", "2"]])
def test_check_refuses_sizes_it_cannot_build_before_building_anything(words):
    from mxd_lens.cli import main

    with pytest.raises(SystemExit, match=rf"^mxd-lens check: {words[0]} {words[1]}: "):
        main(["check", *words])

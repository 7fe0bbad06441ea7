"""Nothing lost, nothing silent (part 3): what used to be evaluated, exported, cached or reported wrong
without a word is refused or warned about, and errors name the file or folder at fault, on one line."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from conftest import D_VOCAB, make_model, make_text_model, make_tokenizer, randomise
from sae_lens import SAE
from safetensors.torch import load_file, save_file
from test_foreign import batches, foreign

import mxd_lens.models
from mxd_lens.cli import main
from mxd_lens.evaluation import evaluate
from mxd_lens.layers import BatchTopKTranscoder, MxD, TopKTranscoder
from mxd_lens.layers.io import load_any_layer, load_layer


@pytest.fixture
def text_model(tmp_path, monkeypatch):
    """A tiny model with a word-level tokenizer, served as any --model, and its text."""
    model, corpus = make_text_model(tmp_path)
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    return model, corpus


def _strict_json(text: str):
    """json.loads as strict parsers read JSON: a bare NaN or Infinity is an error."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _edit_weights(folder, edit):
    weights = folder / "sae_weights.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


# -- 1. non-finite parameters of any layer are refused, naming the folder and the tensor ----------------
def test_a_foreign_layer_with_nan_thresholds_or_one_nan_weight_is_refused_at_load_and_evaluate(
    tmp_path, text_model, capsys
):
    model, corpus = text_model
    sae = foreign(model, "jumprelu_transcoder")
    with torch.no_grad():
        sae.threshold.fill_(float("nan"))
    sae.save_model(tmp_path / "nan_threshold")
    sae = foreign(model, "jumprelu_transcoder")
    with torch.no_grad():
        sae.W_dec[3, 2] = float("nan")
    sae.save_model(tmp_path / "one_nan_weight")
    for name, tensor in (("nan_threshold", "threshold"), ("one_nan_weight", "W_dec")):
        folder = tmp_path / name
        before = (folder / "cfg.json").read_text()
        with pytest.raises(
            ValueError, match=rf"^{re.escape(str(folder))}: its {tensor} holds \d+ NaN"
        ) as info:
            load_any_layer(folder)
        assert "\n" not in str(info.value)
        with pytest.raises(SystemExit, match=rf"mxd-lens eval: {re.escape(str(folder))}: its {tensor} holds"):
            main(["eval", str(folder), "--text", str(corpus), "--split", "all", "--eval-tokens", "60",
                  "--context-size", "12"])  # fmt: skip
        assert (folder / "cfg.json").read_text() == before  # nothing recorded
    # in memory, evaluate names the layer; ours are refused alike (an infinite bias)
    with pytest.raises(ValueError, match=r"L1.jumprelu_transcoder: its W_dec holds 1 NaN and 0 infinite"):
        evaluate(model, [sae], batches(1), progress=False)
    ours = randomise(TopKTranscoder.for_model(model, 1, d_sae=8, k=2))
    with torch.no_grad():
        ours.b_dec[0] = float("inf")
    ours.save_model(tmp_path / "ours")
    with pytest.raises(ValueError, match=r"ours: its b_dec holds 0 NaN and 1 infinite of 16 values"):
        load_layer(tmp_path / "ours")


# -- 2. export refuses layers of two models ----------------------------------------------------------
def test_export_refuses_layers_of_two_models_naming_both_models_and_folders(tmp_path):
    model = make_model("gated")
    # two models a training record alone does not tell apart: one config (digest), no weights digest
    for block, name in ((0, "smollm2-base"), (1, "smollm2-instruct")):
        layer = TopKTranscoder.for_model(model, block, d_sae=8, k=2)
        layer.cfg.metadata.model_name = name
        layer.cfg.metadata.training = {"model": {"kind": "hf_folder", "config_sha256": "a" * 64}}
        layer.save_model(tmp_path / "two" / f"L{block}")
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "two"), "--out", str(tmp_path / "ct")])
    message = str(info.value)
    assert "for one model, but these layers were trained on different ones" in message
    for block, name in ((0, "smollm2-base"), (1, "smollm2-instruct")):
        assert f"{tmp_path / 'two' / f'L{block}'} (model {name!r}" in message
    assert not (tmp_path / "ct").exists()
    # the same model under two spellings of its name is one model
    for block, name in ((0, "SomeOrg/Tiny"), (1, "tiny")):
        layer = TopKTranscoder.for_model(model, block, d_sae=8, k=2)
        layer.cfg.metadata.model_name = name
        layer.save_model(tmp_path / "one" / f"L{block}")
    assert main(["export", str(tmp_path / "one"), "--out", str(tmp_path / "ct")]) == 0


# -- 3. a text of mostly unknown tokens is not cached in silence ---------------------------------------
def test_a_text_of_mostly_unknown_tokens_warns_naming_the_text_and_the_tokenizer(tmp_path, text_model):
    from mxd_lens.data import TokenRows

    rows = TokenRows(make_tokenizer(["the cat sat"]), context_size=8)
    with pytest.warns(
        UserWarning, match=r"x.txt: 14 of its first 16 tokens \(88%\) are the unknown token '<unk>'"
    ):
        list(rows.rows(["the zorp quux blah frob glorp snark wibble"] * 2, name="x.txt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text the tokenizer covers: no warning
        list(rows.rows(["the cat sat the cat"] * 4, name="y.txt"))
    model, corpus = text_model
    unknown = tmp_path / "unknown.txt"
    unknown.write_text("\n\n".join("zorp quux the blah frob glorp" for _ in range(100)))
    stream = [
        "--model",
        "tiny",
        "--context-size",
        "12",
        "--rows-per-shard",
        "4",
        "--blocks",
        "1",
        "--shards",
        "1",
    ]
    tokenizer = re.escape(str(tmp_path / "tok"))
    with pytest.warns(
        UserWarning,
        match=rf"{re.escape(str(unknown))} \(its train side\): .* unknown token '<unk>' of the tokenizer {tokenizer}",
    ):
        assert main(["cache", *stream, "--text", str(unknown), "--out", str(tmp_path / "c1")]) == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unknown token")
        assert main(["cache", *stream, "--text", str(corpus), "--out", str(tmp_path / "c2")]) == 0


# -- 4, 5. missing, mis-shaped or refused weights name the folder --------------------------------------
def test_missing_or_misshaped_weights_and_a_nan_threshold_name_the_folder_on_one_line(tmp_path):
    model = make_model("gpt2")
    folders = {}
    for arch, edits in (
        ("jumprelu_transcoder", {"missing": lambda t: t.pop("W_enc"), "misshaped": lambda t: t.update(W_enc=t["W_enc"][:, :3].contiguous())}),
        ("batchtopk", {"missing": lambda t: t.pop("threshold"), "misshaped": lambda t: t.update(threshold=t["threshold"][:3].contiguous())}),
    ):  # fmt: skip
        for kind, edit in edits.items():
            folder = tmp_path / f"{arch}-{kind}"
            layer = (
                foreign(model, arch)
                if arch != "batchtopk"
                else BatchTopKTranscoder.for_model(model, 1, d_sae=8, k=2)
            )
            layer.save_model(folder)
            _edit_weights(folder, edit)
            folders[folder] = "W_enc" if arch != "batchtopk" else "threshold"
    for folder, tensor in folders.items():
        for load in (load_any_layer, SAE.load_from_disk):
            with pytest.raises(ValueError, match=rf"^{re.escape(str(folder))}: .*{tensor}") as info:
                load(folder)
            assert "\n" not in str(info.value) and "\t" not in str(info.value)
    layer = BatchTopKTranscoder.for_model(model, 1, d_sae=8, k=2)
    with torch.no_grad():
        layer.threshold.fill_(float("nan"))
    layer.save_model(tmp_path / "nan")
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(tmp_path / 'nan'))}: the saved BatchTopK threshold must be finite",
    ):
        SAE.load_from_disk(tmp_path / "nan")


# -- 6. a pickle as the model ------------------------------------------------------------------------
class _Anything:
    """An object a weights-only unpickler refuses."""


def test_a_pickle_as_the_model_is_refused_saying_what_mxd_lens_accepts(tmp_path):
    from conftest import make_hf_folder

    from mxd_lens.models import load_model

    torch.save({"w": torch.zeros(2), "extra": _Anything()}, tmp_path / "model.pt")
    folder, hf_model, _ = make_hf_folder(tmp_path, "llama")
    (folder / "model.safetensors").unlink()
    torch.save({**hf_model.state_dict(), "extra": _Anything()}, folder / "pytorch_model.bin")
    for path, named in (
        (tmp_path / "model.pt", tmp_path / "model.pt"),
        (folder, folder / "pytorch_model.bin"),
    ):
        with pytest.raises(ValueError) as info:
            load_model(str(path))
        message = str(info.value)
        assert message.startswith(f"{named} is a pickle") and "mxd-lens does not unpickle" in message
        assert "the path of a .gguf file" in message and "weights_only" not in message and "\n" not in message


# -- 7. a non-finite cache names the shard file --------------------------------------------------------
def test_a_non_finite_cache_names_the_shard_file(tmp_path):
    from mxd_lens.activations import CachedActivations, ModelActivations, shuffled_batches, write_cache

    model = make_model("gated")
    with torch.no_grad():
        model.embed.W_E[0] = float("nan")  # token 0 gives NaN activations from its position on

    def rows():  # only shard 2 (rows 8 to 11) holds token 0
        g = torch.Generator().manual_seed(0)
        for index in range(24):
            row = torch.randint(1, D_VOCAB, (12,), generator=g)
            if 8 <= index < 12:
                row[5] = 0
            yield row

    source = ModelActivations(model, [1], rows, context_size=12, rows_per_shard=4)
    write_cache(source, tmp_path / "cache", n_shards=5, progress=False)
    for shuffle in ("global", "shard"):
        cache = CachedActivations(tmp_path / "cache", shuffle=shuffle, buffer_tokens=88, chunk_tokens=11)
        with pytest.raises(
            FloatingPointError,
            match=rf"non-finite activations at block 1 in {re.escape(str(tmp_path / 'cache'))}/shard_000002\.safetensors",
        ):
            for _ in shuffled_batches(cache, 11, seed=0):
                pass


# -- 8. an empty evaluation text is named --------------------------------------------------------------
def test_eval_of_an_empty_text_names_the_file(tmp_path, text_model):
    model, _ = text_model
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "L1")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match=rf"no usable text in {re.escape(str(tmp_path / 'empty.txt'))}"):
        main(["eval", str(tmp_path / "L1"), "--text", str(tmp_path / "empty.txt"), "--split", "all",
              "--context-size", "12", "--eval-tokens", "60"])  # fmt: skip


# -- 9. info on a cfg.json holding a list ---------------------------------------------------------------
def test_info_on_a_cfg_json_holding_a_list_names_the_file(tmp_path, capsys):
    TopKTranscoder.for_model(make_model("gpt2"), 1, d_sae=8, k=2).save_model(tmp_path / "listed")
    (tmp_path / "listed" / "cfg.json").write_text("[1, 2]")
    assert main(["info", str(tmp_path / "listed")]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM: {tmp_path / 'listed' / 'cfg.json'} holds a JSON list, not an object" in out


# -- 10. an untrained BatchTopK ----------------------------------------------------------------------
def test_an_untrained_batchtopk_is_evaluated_with_a_warning_naming_its_folder(tmp_path):
    model = make_model("gpt2")
    layer = randomise(BatchTopKTranscoder.for_model(model, 1, d_sae=8, k=2))  # threshold 0: never trained
    layer.save_model(tmp_path / "untrained")
    with pytest.warns(
        UserWarning, match=rf"{re.escape(str(tmp_path / 'untrained'))}: its BatchTopK threshold is 0"
    ):
        evaluate(
            model, {"x": load_layer(tmp_path / "untrained")}, batches(1), progress=False, jacobian_tokens=0
        )
    with torch.no_grad():
        layer.threshold.fill_(0.3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*threshold is 0")
        evaluate(model, {"x": layer}, batches(1), progress=False, jacobian_tokens=0)


# -- 11. one batch: no dangling ±, and cfg.json stays strict JSON ----------------------------------------
def test_one_batch_shows_no_dangling_se_and_records_null_not_nan(tmp_path, text_model, capsys):
    import pandas as pd

    from mxd_lens.studies.report import columns, render_table

    table = pd.DataFrame(
        [{"delta_ce": 0.5, "delta_ce_se": float("nan")}, {"delta_ce": 0.25, "delta_ce_se": 0.01}]
    )
    shown = render_table(table, columns("delta_ce", se=("delta_ce",)))
    assert re.search(r"\+0\.5000\s*\|", shown) and "+0.2500 ± 0.0100" in shown
    assert not re.search(r"±\s*\|", shown)
    model, corpus = text_model
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "L1")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                str(tmp_path / "L1"),
                "--text",
                str(corpus),
                "--split",
                "all",
                "--context-size",
                "12",
                "--eval-tokens",
                "60",
            ]
        )
        == 0
    )  # fmt: skip: one batch of 5 rows
    out = capsys.readouterr().out
    assert "±" in out and not re.search(r"±\s*\|", out)
    for name in ("cfg.json", "eval.json"):
        text = (tmp_path / "L1" / name).read_text()
        assert "NaN" not in text
        _strict_json(text)
    metrics = json.loads((tmp_path / "L1" / "cfg.json").read_text())["metadata"]["evaluation"]["metrics"]
    assert metrics["delta_ce_se"] is None and metrics["kl_se"] is None and metrics["fvu"] is not None
    assert main(["info", str(tmp_path / "L1")]) == 0  # a null metric reads back
    assert "eval: delta_ce_se | —" in re.sub(r" +", " ", capsys.readouterr().out)


# -- 12. info shows the arch with its options ---------------------------------------------------------
def test_info_tells_the_papers_mxd_from_the_recommended_one(tmp_path, capsys):
    from mxd_lens.config import RECOMMENDED_MXD

    model = make_model("gpt2")
    MxD.for_model(model, 1, d_sae=4, k=2).save_model(tmp_path / "paper")
    MxD.for_model(model, 1, d_sae=4, k=2, gate="topk", gate_standardize=0.1).save_model(
        tmp_path / "recommended"
    )
    capsys.readouterr()
    assert main(["info", str(tmp_path / "paper"), str(tmp_path / "recommended")]) == 0
    out = re.sub(r" +", " ", capsys.readouterr().out)
    assert "arch (--arch), as tables name it | mxd (MxD) |" in out
    assert (
        f"arch (--arch), as tables name it | {RECOMMENDED_MXD} (MxD (gate=topk, gate_standardize=0.1)) |"
        in out
    )


# -- 13. the demo's (frontier's) evaluations are recorded; the card shows every one ---------------------
def test_the_frontier_records_its_evaluations_and_the_card_shows_each_text(tmp_path, text_model, capsys):
    from mxd_lens.config import TrainConfig
    from mxd_lens.hub import stage
    from mxd_lens.studies.frontier import FrontierConfig
    from mxd_lens.studies.frontier.run import run_frontier

    model, corpus = text_model
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(" ".join(d.split()[::-1]) for d in corpus.read_text().split("\n\n")[:80]))
    config = FrontierConfig(text=str(corpus), blocks=[1], ks=[2], archs=["transcoder"], ood_text=str(other),
                            ood_eval_tokens=96, train_tokens=128, eval_tokens=120, context_size=12,
                            train=TrainConfig(epochs=1.0, batch_tokens=64), rows_per_shard=16, eval_fraction=0.1)  # fmt: skip
    (row,) = run_frontier(model, config, tmp_path / "out", progress=False)
    folder = tmp_path / "out" / "runs" / "L1.seed0" / "final" / "L1.transcoder.k2.m8"
    meta = _strict_json((folder / "cfg.json").read_text())["metadata"]
    first, second = meta["evaluations"]
    assert first["text"]["text"] == str(corpus) and first["text"]["split"] == "eval"
    assert second["text"]["text"] == str(other) and second["text"]["split"] == "all"
    assert first["metrics"]["kl"] == pytest.approx(row["kl"]) and second["metrics"]["kl"] == pytest.approx(
        row["ood_kl"]
    )
    capsys.readouterr()
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "none yet" not in out and "evaluation 1 on" in out and "evaluation 2 on" in out
    card = (stage(folder, "user/tiny", tmp_path / "staged") / "README.md").read_text()
    lines = [line for line in card.splitlines() if line.startswith("| `L1.transcoder.k2.m8`")]
    assert (
        len(lines) == 2 and "`corpus.txt` (eval side)" in lines[0] and "`other.txt` (all of it)" in lines[1]
    )
    assert f"{row['kl']:.4f}" in lines[0] and f"{row['ood_kl']:.4f}" in lines[1]

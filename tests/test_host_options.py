"""How every verb loads its host model (mxd_lens.config.HostOptions, mxd_lens.models.load_host): --dtype,
--prepend-bos, --bos-token / --eos-token, recorded with the model's source so a layer's record loads the
same host again; the name a layer records for its model (one load_model accepts, and the hub id beside
it); the model a study reads saved layers with, resolved from them before anything is loaded; and
probing refusing a suite of fewer than two tasks before loading anything. Tiny random models, no hub."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import WORDS, make_hf_folder, make_model
from sae_lens.registry import SAE_CLASS_REGISTRY
from sae_lens.saes.sae import SAEMetadata
from test_models import write_tiny_gguf

import mxd_lens
from mxd_lens import models, records
from mxd_lens.cli import main


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path_factory.getbasetemp() / "mxd_lens_cache"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama Hugging Face folder (word tokenizer: <bos>=0, <eos>=1, <unk>=2) and a corpus of its words."""
    root = tmp_path_factory.mktemp("host")
    path, _, _ = make_hf_folder(root, "llama")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(200)]
    (root / "corpus.txt").write_text("\n\n".join(docs))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama.gguf")


def spy_on_load_model(monkeypatch):
    """Record every load_model call (name, keyword arguments) and load for real."""
    real, calls = models.load_model, []

    def spy(name, **kwargs):
        calls.append((name, kwargs))
        return real(name, **kwargs)

    monkeypatch.setattr(models, "load_model", spy)
    return calls


# -- 4: --dtype, --prepend-bos, --bos-token, --eos-token -----------------------------------------------


def test_dtype_and_special_tokens_are_applied_and_recorded(folder):
    from mxd_lens.data import TokenRows

    model = models.load_model(str(folder), dtype="bfloat16", special_tokens={"eos_token": "<unk>"},
                              default_prepend_bos=False)  # fmt: skip
    assert model.cfg.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.bfloat16
    source = models.model_source(model)
    assert (source["dtype"], source["prepend_bos"], source["special_tokens"]) == (
        "bfloat16", False, {"eos_token": "<unk>"})  # fmt: skip
    rows = TokenRows.for_model(model, 8)  # EOS separates documents; no BOS
    assert (rows.prepend_bos, rows.separator_token_id) == (False, 2)
    # the dtype is how the model was run, not which weights: the identity stays the fp32 load's
    plain = models.load_model(str(folder))
    assert models.model_source(plain)["dtype"] == "float32"
    assert models.model_identity(source) == models.model_identity(models.model_source(plain))
    assert models.torch_dtype("torch.float16") == torch.float16 and models.torch_dtype(None) == torch.float32
    with pytest.raises(
        ValueError, match="dtype='bf16': a host model runs in one of float32, bfloat16, float16"
    ):
        models.load_model(str(folder), dtype="bf16")


def test_a_special_token_the_tokenizer_lacks_is_refused(folder):
    with pytest.raises(
        ValueError, match=r"--bos-token '<\|nope\|>' is not a token of .*give one of its tokens"
    ):
        models.load_model(str(folder), special_tokens={"bos_token": "<|nope|>"})


def test_a_half_dtype_the_host_cannot_run_is_refused_naming_the_fix(folder, monkeypatch, tmp_path):
    from transformer_lens import HookedTransformer

    forward = HookedTransformer.forward

    def no_half(self, *args, **kwargs):
        if self.cfg.dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(HookedTransformer, "forward", no_half)
    with pytest.raises(ValueError, match="cannot run in float16 on cpu: use --dtype bfloat16 or float32"):
        models.load_model(str(folder), dtype=torch.float16)
    corpus = folder.parent / "corpus.txt"
    out = tmp_path / "cache"
    with pytest.raises(SystemExit, match="cannot run in float16 on cpu: use --dtype bfloat16 or float32"):
        main(["cache", "--model", str(folder), "--dtype", "float16", "--text", str(corpus), "--blocks", "1",
              "--shards", "1", "--out", str(out)])  # fmt: skip
    assert not out.exists()


def test_an_unknown_dtype_is_refused_before_anything_loads(folder, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("nothing may be loaded"))
    for verb in (["train", "--tokens", "1024", "--out", str(tmp_path / "run")], ["eval", str(folder)],
                 ["inspect", "--layer", str(folder)]):  # fmt: skip
        with pytest.raises(SystemExit, match="--dtype bf16: choose one of float32, bfloat16, float16"):
            main([*verb, "--model", str(folder), "--dtype", "bf16"])
    with pytest.raises(SystemExit):
        main(["eval", str(folder), "--prepend-bos", "maybe"])
    assert "--prepend-bos: invalid optional_bool value: 'maybe'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_in_bfloat16_records_the_host_and_eval_loads_it_again(folder, monkeypatch, tmp_path):
    """The training record holds how the host was loaded; `eval` without --model loads it alike, and
    with --dtype it runs the model in that dtype (the metrics stay float32 and close to fp32's)."""
    calls = spy_on_load_model(monkeypatch)
    corpus = folder.parent / "corpus.txt"
    host = ["--model", str(folder), "--dtype", "bfloat16", "--prepend-bos", "true", "--bos-token", "<eos>",
            "--eos-token", "<unk>"]  # fmt: skip
    stream = ["--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16", "--blocks", "1"]
    learn = ["--arch", "transcoder", "--k", "2", "--tokens", "320", "--batch-tokens", "32", "--no-progress"]
    assert main(["train", *host, *stream, *learn, "--out", str(tmp_path / "run")]) == 0
    settings = {"dtype": "bfloat16", "default_prepend_bos": True,
                "special_tokens": {"bos_token": "<eos>", "eos_token": "<unk>"}}  # fmt: skip
    assert calls[-1] == (str(folder), settings)
    layer = tmp_path / "run" / "final" / "L1.transcoder.k2.m8"
    cfg = json.loads((layer / "cfg.json").read_text())
    meta = cfg["metadata"]
    recorded = meta["training"]["model"]
    assert (recorded["dtype"], recorded["prepend_bos"], recorded["special_tokens"]) == (
        "bfloat16", True, {"bos_token": "<eos>", "eos_token": "<unk>"})  # fmt: skip
    assert meta["model_name"] == "llama"  # the folder's name: its config names no hub id
    assert cfg["dtype"] == "float32"  # the layer itself trains in float32
    evaluate = ["eval", str(layer), "--eval-tokens", "120", "--context-size", "12", "--write", "false"]
    assert main(evaluate) == 0
    assert calls[-1] == (str(folder), settings)  # rebuilt from the record alone
    assert main([*evaluate, "--dtype", "float32", "--eos-token", "<eos>"]) == 0  # an option given wins
    assert calls[-1] == (str(folder), {**settings, "dtype": "float32",
                                       "special_tokens": {"bos_token": "<eos>", "eos_token": "<eos>"}})  # fmt: skip


def test_float32_layers_evaluate_on_a_bfloat16_host_in_float32(folder):
    """Layers trained in float32 read a bfloat16 host's activations (cast to their dtype); CE, KL and FVU
    come out float32 and close to the float32 host's; the MLP copied into an MxD stays near exact."""
    from mxd_lens.evaluation import evaluate

    torch.manual_seed(0)
    tokens = torch.randint(3, 21, (4, 12))
    full = models.load_model(str(folder))
    layers = {
        "tc": mxd_lens.TopKTranscoder.for_model(full, 1, d_sae=32, k=4),
        "mxd": mxd_lens.MxD.from_mlp(full, 1),
    }
    with torch.no_grad():
        for p in layers["tc"].parameters():
            p.normal_(0, 0.1)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        model = full if dtype == "float32" else models.load_model(str(folder), dtype=dtype)
        rows[dtype] = {row["name"]: row for row in evaluate(model, layers, [tokens], progress=False)}
    for name in layers:
        for key in ("ce_clean", "ce_spliced", "kl", "fvu"):
            assert type(rows["bfloat16"][name][key]) is float, key
        for key in ("ce_clean", "ce_spliced"):
            assert rows["bfloat16"][name][key] == pytest.approx(rows["float32"][name][key], rel=0.02), key
    assert abs(rows["bfloat16"]["mxd"]["delta_ce"]) < 0.01 and rows["bfloat16"]["mxd"]["fvu"] < 1e-3


def test_a_cache_is_stored_in_the_models_dtype_unless_told(folder, tmp_path):
    corpus = folder.parent / "corpus.txt"
    common = ["--model", str(folder), "--text", str(corpus), "--context-size", "12", "--rows-per-shard", "8",
              "--blocks", "1", "--shards", "1"]  # fmt: skip
    assert main(["cache", *common, "--dtype", "bfloat16", "--out", str(tmp_path / "a")]) == 0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["model"]["dtype"] == "bfloat16"
    assert (
        main(
            [
                "cache",
                *common,
                "--dtype",
                "bfloat16",
                "--cache-dtype",
                "float32",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["dtype"] == "float32"
    # continuing a cache with the model in another dtype would mix activations: refused
    with pytest.raises(SystemExit, match="already holds a cache made with different settings"):
        main(["cache", *common, "--cache-dtype", "float32", "--out", str(tmp_path / "b")])


# -- 5: the model's name, loadable -------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    ["smollm2-135m", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135M"],
)
def test_every_spelling_of_the_default_loads_it_and_layers_record_its_loadable_name(spelling, tiny_gguf,
                                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setattr(models, "default_model_path", lambda: tiny_gguf)  # stands in for SmolLM2's file
    model = models.load_model(spelling)
    source = models.model_source(model)
    assert (source["kind"], source["name"], source["hub_id"]) == (
        "default", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")  # fmt: skip
    assert model.cfg.model_name == "SmolLM2-135M-Instruct"  # TransformerLens's name is unchanged
    assert records.loadable_name(model) == "smollm2-135m"
    layer = mxd_lens.MxD.for_model(model, 1, d_sae=4, k=2)
    assert layer.cfg.metadata.model_name == "smollm2-135m"
    for name in ("smollm2-135m", "SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"):
        layer.cfg.metadata.model_name = name
        with mxd_lens.splice(model, layer):  # every spelling fits
            pass
    layer.cfg.metadata.model_name = "gpt2"
    with pytest.raises(ValueError, match="was trained on 'gpt2'"):
        with mxd_lens.splice(model, layer):
            pass


@pytest.mark.parametrize(
    "spelling",
    ["smollm2-135m", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135M-instruct"],
)
def test_a_foreign_layer_naming_the_default_evaluates_without_model(
    spelling, tiny_gguf, monkeypatch, tmp_path
):
    monkeypatch.setattr(models, "default_model_path", lambda: tiny_gguf)
    model = models.load_model()
    sae_cls, cfg_cls = SAE_CLASS_REGISTRY["transcoder"]
    meta = SAEMetadata(model_name=spelling, hook_name="blocks.1.mlp.hook_in",
                       hook_name_out="blocks.1.hook_mlp_out", hook_layer=1)  # fmt: skip
    d = model.cfg.d_model
    sae = sae_cls(cfg_cls(d_in=d, d_out=d, d_sae=16, apply_b_dec_to_input=False, metadata=meta))
    sae.save_model(tmp_path / "foreign")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat {i} sat on the mat and looked at the hills" for i in range(40)))
    calls = spy_on_load_model(monkeypatch)
    args = ["eval", str(tmp_path / "foreign"), "--text", str(corpus), "--split", "all", "--eval-tokens", "64",
            "--context-size", "8", "--write", "false"]  # fmt: skip
    with pytest.warns(UserWarning, match="from elsewhere"):
        assert main(args) == 0
    assert calls == [(spelling, {})]


def test_a_gguf_or_folder_records_the_hub_id_its_metadata_names(tmp_path, monkeypatch):
    import gguf

    from mxd_lens.hub import model_card

    add_name = gguf.GGUFWriter.add_name

    def with_repository(self, name):
        add_name(self, name)
        self.add_source_url("https://huggingface.co/SomeOrg/Tiny-Llama-Instruct")
        self.add_base_model_count(1)
        self.add_base_model_repo_url(0, "https://huggingface.co/SomeOrg/Tiny-Llama")

    monkeypatch.setattr(gguf.GGUFWriter, "add_name", with_repository)
    path = write_tiny_gguf(tmp_path / "tiny-llama-q4_k_m.gguf")
    model = models.load_model(str(path))
    source = models.model_source(model)
    assert (source["hub_id"], source["base_model"], source["gguf_name"]) == (
        "SomeOrg/Tiny-Llama-Instruct", "SomeOrg/Tiny-Llama", "tiny test model")  # fmt: skip
    assert model.cfg.model_name == "tiny-llama-q4_k_m"  # the file's stem, as before
    layer = mxd_lens.TopKTranscoder.for_model(model, 1, d_sae=8, k=2)
    assert layer.cfg.metadata.model_name == "SomeOrg/Tiny-Llama-Instruct"  # a name to load the host by
    with mxd_lens.splice(model, layer):
        pass
    card = model_card("user/x", [("L1", {"architecture": "transcoder", "metadata": {
        "model_name": layer.cfg.metadata.model_name, "training": {"model": source, "tokens": 64}}})])  # fmt: skip
    assert "## Host model" in card and "`SomeOrg/Tiny-Llama-Instruct`" in card
    assert "fine-tuned from `SomeOrg/Tiny-Llama`" in card and "tiny-llama-q4_k_m.gguf" in card
    assert "run in float32" in card

    # a folder saved from a hub model keeps its id in config.json's _name_or_path
    folder, _, _ = make_hf_folder(tmp_path, "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "SomeOrg/tiny-gpt2"}))
    hosted = models.load_model(str(folder))
    assert models.model_source(hosted)["hub_id"] == "SomeOrg/tiny-gpt2"
    assert records.loadable_name(hosted) == "SomeOrg/tiny-gpt2"
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": str(folder)}))  # a path: no id
    assert "hub_id" not in models.model_source(models.load_model(str(folder)))


def test_an_old_stream_record_of_the_default_reads_as_its_loadable_name():
    from mxd_lens.activations import StreamInfo

    info = StreamInfo.from_dict({"model_name": "SmolLM2-135M-Instruct", "blocks": [1], "d_in": 4, "d_out": 4,
                                 "rows_per_shard": 2, "context_size": 4, "drop_first_position": True})  # fmt: skip
    assert info.model_name == "smollm2-135m"


def test_studies_read_layers_with_the_model_they_record_resolved_before_loading(tmp_path, monkeypatch):
    """Without --model, a study loads the model its layers name (not the default); a name that cannot
    be loaded is refused, naming the fix, before any model is read or converted."""
    model = make_model("gated")
    calls = []
    monkeypatch.setattr(models, "load_model", lambda name, **kw: calls.append(name) or model)
    layer = mxd_lens.TopKTranscoder.for_model(model, 1, d_sae=8, k=2)
    layer.cfg.metadata.training = {
        "model": {"name": "models/recorded.gguf", "kind": "hf_folder"},
        "tokens": 0,
    }
    layer.save_model(tmp_path / "ours")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "recorded.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    from mxd_lens.studies.common import Where, host_model
    from mxd_lens.studies.inspect import InspectOptions
    from mxd_lens.studies.probe import ProbeOptions
    from mxd_lens.studies.steer import SteerOptions

    for options in (InspectOptions(layer=str(tmp_path / "ours")), ProbeOptions(layers=[str(tmp_path / "ours")]),
                    SteerOptions(layers=str(tmp_path))):  # fmt: skip
        assert host_model(Where(), options) is model
        assert calls[-1] == "models/recorded.gguf"
    assert host_model(Where(model="given"), InspectOptions(layer=str(tmp_path / "ours"))) is model
    assert calls[-1] == "given"

    # a foreign layer naming a model nothing here can load: refused before anything is loaded
    monkeypatch.undo()
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "default_model_path", lambda: pytest.fail("the default model was read"))
    monkeypatch.setattr(models, "_load_folder", lambda *a, **k: pytest.fail("a model was loaded"))
    sae_cls, cfg_cls = SAE_CLASS_REGISTRY["transcoder"]
    meta = SAEMetadata(model_name="no-such-org/no-such-model", hook_name="blocks.1.mlp.hook_in",
                       hook_name_out="blocks.1.hook_mlp_out", hook_layer=1)  # fmt: skip
    sae_cls(cfg_cls(d_in=16, d_out=16, d_sae=8, apply_b_dec_to_input=False, metadata=meta)).save_model(
        tmp_path / "foreign"
    )
    with pytest.raises(SystemExit, match=r"foreign/cfg.json \(metadata.model_name\) names the model "
                                         r"'no-such-org/no-such-model', which cannot be loaded here .*give --model"):  # fmt: skip
        main(
            [
                "inspect",
                "--layer",
                str(tmp_path / "foreign"),
                "--features",
                "0",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert not (tmp_path / "out").exists()


# -- 6: probing needs at least two tasks ----------------------------------------------------------------


def test_probe_refuses_a_suite_of_one_task_before_loading_anything(tmp_path, monkeypatch):
    model = make_model("gated")
    mxd_lens.TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "layer")
    data = tmp_path / "data"
    data.mkdir()
    (data / "sentiment_tweets_crowdflower.jsonl.xz").write_bytes(b"")  # one binary set: one task
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("nothing may be loaded"))
    with pytest.raises(SystemExit, match=r"--data .*data holds 1 probing task\(s\) \(tweets/positive\); probing "
                                         r"compares layers over at least 2 tasks: give --data a folder"):  # fmt: skip
        main(
            [
                "probe",
                "--layers",
                str(tmp_path / "layer"),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert not (tmp_path / "out").exists()
    (data / "sentiment_amazon_fine_foods.jsonl.xz").write_bytes(b"")  # a second binary set: two tasks
    from mxd_lens.studies.probe import ProbeOptions
    from mxd_lens.studies.probe.run import suite

    assert [t for s in suite(ProbeOptions(layers=[], data=str(data))) for t in s.tasks] == [
        "food_reviews/great", "tweets/positive"]  # fmt: skip

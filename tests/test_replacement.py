"""The replacement model: a layer at every block spliced at once, measured against a hand-written splice."""

import json

import pandas as pd
import pytest
import torch
from conftest import make_text_model

from mxd_lens.cli import main
from mxd_lens.evaluation import held_out_batches
from mxd_lens.layers.io import load_any_layer
from mxd_lens.replacement import by_block, compounding, exactness, load_replacement


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Layers of one architecture at every block of a 3-block model, trained from one stream."""
    import mxd_lens.models

    folder = tmp_path_factory.mktemp("replacement")
    model, corpus = make_text_model(folder)
    original = mxd_lens.models.load_model
    mxd_lens.models.load_model = lambda name, **kw: model
    try:
        argv = ["train", "--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16", "--blocks", "all",
                "--arch", "skip_transcoder", "--k", "4", "--tokens", "2048", "--batch-tokens", "64", "--no-progress",
                "--out", str(folder / "run")]  # fmt: skip
        assert main(argv) == 0
    finally:
        mxd_lens.models.load_model = original
    layers = {p.name: load_any_layer(p) for p in sorted((folder / "run" / "final").iterdir()) if p.is_dir()}
    return model, corpus, folder, layers


def lay_block(layer):
    return int(layer.cfg.metadata.hook_name.split(".")[1])


def _by_hand(model, layers, tokens, n):
    """Log-probs with the first n blocks' MLP outputs replaced by their layer's output on the live MLP
    input, from each layer's first trained position on: plain forward hooks, no mxd_lens splice."""
    handles, inputs = [], {}
    for layer in list(layers.values())[:n]:
        block = int(layer.cfg.metadata.hook_name.split(".")[1])
        first = (layer.cfg.metadata.seqpos_slice or [None])[0] or 0
        mlp = model.blocks[block].mlp
        handles.append(mlp.register_forward_pre_hook(lambda m, args, b=block: inputs.__setitem__(b, args[0])))

        def replace(value, hook, b=block, layer=layer, first=first):
            new = value.clone()
            new[:, first:] = layer(inputs[b])[:, first:]
            return new

        handles.append(model.blocks[block].hook_mlp_out.add_hook(replace))
    try:
        with torch.no_grad():
            return model(tokens).log_softmax(-1)
    finally:
        for handle in handles:
            handle.remove() if hasattr(handle, "remove") else None
        model.reset_hooks()


def test_compounding_and_exactness_against_a_hand_written_splice(trained):
    model, corpus, _, layers = trained
    placed = by_block(layers, model, every=True)
    assert list(placed) == [0, 1, 2]
    batches = held_out_batches(model, corpus, eval_tokens=240, context_size=12, rows_per_forward=5)
    curve = compounding(model, placed, batches, progress=False)
    assert [row["n"] for row in curve] == [1, 2, 3]
    for row in curve:
        kl = ce = count = 0.0
        for tokens in batches:
            clean = model(tokens).log_softmax(-1).detach()
            spliced = _by_hand(model, placed, tokens, row["n"])
            kl += float((clean.exp() * (clean - spliced)).sum(-1)[:, :-1].sum())
            ce += float(-spliced[:, :-1].gather(-1, tokens[:, 1:, None]).sum())
            count += tokens[:, 1:].numel()
        assert row["tokens"] == count
        assert row["kl"] == pytest.approx(kl / count, rel=1e-4, abs=1e-7)
        assert row["ce_spliced"] == pytest.approx(ce / count, rel=1e-5)
    assert curve[-1]["kl"] > curve[0]["kl"] > 0  # errors compound: more blocks spliced, further off
    exact = exactness(model, placed, batches)
    assert exact["kl"] < 1e-6 and exact["max_abs_logprob_diff"] < 1e-4


def test_compounding_with_a_block_left_clean(trained):
    """Layers at blocks 0 and 2 only: the curve's residual carried from n = 1 to n = 2 runs block 1 clean."""
    model, corpus, _, layers = trained
    placed = {b: layer for b, layer in by_block(layers, model, every=True).items() if b != 1}
    batches = held_out_batches(model, corpus, eval_tokens=120, context_size=12, rows_per_forward=5)
    curve = compounding(model, placed, batches, progress=False)
    assert [(row["n"], row["last_block"]) for row in curve] == [(1, 0), (2, 2)]
    for row in curve:
        kl = count = 0.0
        for tokens in batches:
            clean = model(tokens).log_softmax(-1).detach()
            spliced = _by_hand(model, placed, tokens, row["n"])
            kl += float((clean.exp() * (clean - spliced)).sum(-1)[:, :-1].sum())
            count += tokens[:, 1:].numel()
        assert row["kl"] == pytest.approx(kl / count, rel=1e-4, abs=1e-7)


def test_the_study_reports_the_whole_each_block_and_the_curve(trained, monkeypatch, tmp_path):
    import mxd_lens.models

    model, corpus, folder, _ = trained
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    ood = tmp_path / "ood.txt"
    ood.write_text("\n\n".join(["the birds sang over the green hills while a cat sat"] * 40))
    argv = ["replacement", str(folder / "run" / "final"), "--model", "tiny", "--ood-text", str(ood),
            "--eval-tokens", "240", "--context-size", "12", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = tmp_path / "replacement"
    whole = pd.read_csv(out / "replacement.csv")
    curve = pd.read_csv(out / "compounding.csv")
    blocks = pd.read_csv(out / "blocks.csv")
    assert list(whole["text"]) == ["held-out", "ood"] and set(whole["method"]) == {"skip_transcoder"}
    for _, row in whole.iterrows():
        part = curve[curve["text"] == row["text"]]
        # two computations of the whole replacement: evaluate's (from block 0's residual) and the curve's last
        assert part["kl"].iloc[-1] == pytest.approx(row["kl"], rel=1e-4)
        assert part["delta_ce"].iloc[-1] == pytest.approx(row["delta_ce"], rel=1e-4, abs=1e-7)
        alone = blocks[(blocks["text"] == row["text"]) & (blocks["block"] == 0)]
        assert part["kl"].iloc[0] == pytest.approx(
            float(alone["kl"].iloc[0]), rel=1e-4
        )  # n = 1: block 0 alone
        assert row["exact_kl"] < 1e-6 and row["exact_max_abs_logprob_diff"] < 1e-4  # float32 round-off
    assert sorted(blocks["block"].unique()) == [0, 1, 2] and blocks["fvu"].notna().all()
    assert (out / "compounding.png").stat().st_size > 0 and (out / "blocks.png").stat().st_size > 0
    record = json.loads((out / "replacement.json").read_text())
    assert set(record["texts"]) == {"held-out", "ood"}


def test_a_replacement_needs_one_layer_at_every_block(trained):
    model, _, _, layers = trained
    some = {name: layer for name, layer in layers.items() if not name.startswith("L1.")}
    with pytest.raises(ValueError, match=r"no layer for block\(s\) \[1\]"):
        by_block(some, model, every=True)
    first = next(iter(layers.values()))
    with pytest.raises(ValueError, match="2 layers replace block 0"):
        by_block({"a": first, "b": first}, model)


def test_graphs_study_scores_every_prompt_and_writes_pages_and_circuit_tracer_files(
    trained, monkeypatch, tmp_path
):
    import mxd_lens.models
    from mxd_lens.studies.graphs.run import run  # noqa: F401  (the verb runs it)

    model, _, folder, _ = trained
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    prompts = ["the cat sat on a mat while dogs ran", "birds sang songs of rain and the cat sat on"]
    argv = ["graphs", str(folder / "run" / "final"), "--model", "tiny", "--prompts", *prompts,
            "--context-tokens", "240", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = tmp_path / "graphs"
    table = pd.read_csv(out / "graphs.csv")
    assert list(table["prompt"]) == prompts
    assert (table["max_completeness_error"] <= 1e-4).all()
    assert table["replacement"].between(0, 1).all() and table["completeness"].between(0, 1).all()
    assert (table["nodes_80"] > 0).all() and (table["seconds"] > 0).all()
    page = (out / "graph-00.html").read_text()
    assert "<script" in page and "http" not in page.replace(
        "http://www.w3.org/2000/svg", ""
    )  # self-contained
    # the kept units' contexts: each as top_activations ranks it on the same text, alone
    from mxd_lens.analysis.inspect import text_batches, top_activations

    data = json.loads(page.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    assert data["contexts"]
    drawn = {f"{n['block']}:{n['unit']}" for n in data["nodes"] if n["kind"] == "feature"}
    assert set(data["contexts"]) <= drawn  # only this page's units
    key = sorted(data["contexts"])[0]
    block, unit = map(int, key.split(":"))
    (layer,) = [
        lay for lay in load_replacement([folder / "run" / "final"], model).values() if lay_block(lay) == block
    ]
    alone = top_activations(model, layer, text_batches(model, None, 240, 12), [unit], n=5, progress=False)
    assert data["contexts"][key] == [
        list(c) for c in zip(alone["left"], alone["token"], alone["right"], strict=True)
    ]
    ct = json.loads((out / "circuit-tracer" / "graph-01.json").read_text())
    assert set(ct) == {"metadata", "qParams", "nodes", "links"}
    ids = {n["node_id"] for n in ct["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in ct["links"])
    assert {n["feature_type"] for n in ct["nodes"]} >= {"embedding", "logit"}
    listed = json.loads((out / "circuit-tracer" / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listed["graphs"]] == ["graph-00", "graph-01"]

"""Steering: the code edit against a dense formula, exactness at alpha = 0, generation and scorers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_reference, make_model, make_text_model, randomise

import mxd_lens
from mxd_lens.analysis import steering
from mxd_lens.hooks import capture_mlp_io, spliced_layers
from mxd_lens.layers import MxD, TopKTranscoder


def dense_output(layer, x, codes):
    """The layer output from edited codes, written out: transcoder a W_dec + b; MxD (z D) * (a C) + b."""
    if isinstance(layer, MxD):
        return (layer.hidden(x) @ layer.W_out) * (codes @ layer.W_dec) + layer.b_dec
    return codes @ layer.W_dec + layer.b_dec + (x @ layer.W_skip if hasattr(layer, "W_skip") else 0)


@pytest.mark.parametrize("cls", [MxD, TopKTranscoder])
@pytest.mark.parametrize("mode", ["add", "clamp"])
def test_steer_edits_one_code_at_every_position(cls, mode, tokens):
    model = make_model("gated")
    extra = {"d_hidden": 8} if cls is MxD else {}
    layer = randomise(cls.for_model(model, 1, d_sae=24, k=4, **extra), 1)
    feature, alpha = 7, 2.5
    with capture_mlp_io(model, [1]) as io:
        model(tokens)
    x = io[1]["in"]
    codes = layer.encode(x).detach()
    if mode == "add":
        codes[..., feature] += alpha
    else:
        codes[..., feature] = alpha
    expected = dense_output(layer, x, codes)
    with mxd_lens.splice(model, layer), steering.steer(model, layer, feature, alpha, mode=mode):
        with capture_mlp_io(model, [1]) as io2:
            model(tokens)
    torch.testing.assert_close(io2[1]["out"], expected, atol=1e-5, rtol=1e-4)


def test_alpha_zero_with_error_term_is_the_clean_model(tokens):
    model = make_model("gpt2")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, d_hidden=8), 2)
    clean = model(tokens)
    with mxd_lens.splice(model, layer, error_term=True), steering.steer(model, layer, 3, 0.0):
        torch.testing.assert_close(model(tokens), clean, atol=1e-5, rtol=1e-5)
        assert spliced_layers(model) == {1: layer}
    assert spliced_layers(model) == {}
    with mxd_lens.splice(model, layer, error_term=True), steering.steer(model, layer, 3, 5.0):
        assert not torch.allclose(model(tokens), clean, atol=1e-3)


def test_steering_errors(tokens):
    model = make_model("gpt2")
    layer = MxD.for_model(model, 1, d_sae=24, k=4, d_hidden=8)
    other = MxD.for_model(model, 1, d_sae=24, k=4, d_hidden=8)
    with pytest.raises(ValueError, match="not spliced"):
        with steering.steer(model, layer, 3, 1.0):
            pass
    with mxd_lens.splice(model, other):
        with pytest.raises(ValueError, match="not spliced"):
            with steering.steer(model, layer, 3, 1.0):
                pass
        with pytest.raises(ValueError, match="at most one per block"):
            with mxd_lens.splice(model, layer):
                pass
    with mxd_lens.splice(model, layer):
        for bad in (24, -1):
            with pytest.raises(IndexError, match="out of range"):
                with steering.steer(model, layer, bad, 1.0):
                    pass
        with pytest.raises(ValueError, match="mode"):
            with steering.steer(model, layer, 1, 1.0, mode="scale"):
                pass
        for bad in (float("nan"), float("inf"), [1.0, float("-inf")]):
            with pytest.raises(ValueError, match="alpha must be finite"):
                with steering.steer(model, layer, [1, 2] if isinstance(bad, list) else 1, bad):
                    pass


def test_generation_scorers_and_sweep(tmp_path):
    from sklearn.linear_model import LogisticRegression

    model, _ = make_text_model(tmp_path)
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=16, k=4), 4)
    g1 = steering.generate(model, "the cat", n_samples=3, max_new_tokens=4, seed=5)
    g2 = steering.generate(model, "the cat", n_samples=3, max_new_tokens=4, seed=5)
    assert torch.equal(g1.tokens, g2.tokens) and g1.tokens.shape == (3, g1.prompt_len + 4)
    assert len(g1.texts) == 3
    # perplexity: exp of the mean NLL of the generated tokens, written out
    ppl = steering.PerplexityScorer(model)(g1)
    logp = model(g1.tokens).log_softmax(-1)
    for i in range(3):
        nll = [-logp[i, t - 1, g1.tokens[i, t]].item() for t in range(g1.prompt_len, g1.tokens.shape[1])]
        assert ppl[i] == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-4)
    # the probe scorer pools the clean MLP input over the generated tokens only
    rng = np.random.default_rng(0)
    probe = LogisticRegression().fit(rng.normal(size=(20, 16)), [0, 1] * 10)
    scores = steering.ProbeScorer(model, probe, block=1)(g1)
    with capture_mlp_io(model, [1]) as io:
        model(g1.tokens)
    pooled = io[1]["in"][:, g1.prompt_len :].mean(1).detach().numpy()
    np.testing.assert_allclose(scores, probe.predict_proba(pooled)[:, 1], rtol=1e-5)
    with mxd_lens.splice(model, layer), pytest.raises(RuntimeError, match="clean model"):
        steering.PerplexityScorer(model)(g1)
    # a sweep: one row per (target, multiple), scorers run on the clean model
    targets = [{"name": "tc", "arch": "transcoder", "task": "t", "layer": layer, "feature": 2, "scale": 1.0}]
    table = steering.sweep(
        model, targets, [0, 50], [steering.PerplexityScorer(model)], prompt="the cat", n_samples=2,
        max_new_tokens=3, progress=False,
    )  # fmt: skip
    assert list(table.multiple) == [0, 50] and table.perplexity.notna().all()
    assert spliced_layers(model) == {}
    steering.plot_sweep(table.assign(concept=[0.1, 0.9]), str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0


def test_encode_decode_in_inference_mode_respects_in_place_edits(tokens):
    """TL's generate runs under inference_mode, whose tensors have no version counter."""
    model = make_model("gpt2")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, d_hidden=8), 3)
    x = torch.randn(3, 5, model.cfg.d_model)
    with torch.inference_mode():
        codes = layer.encode(x)
        torch.testing.assert_close(layer.decode(codes), dense_reference(layer, x), atol=1e-5, rtol=1e-4)
        codes[..., 0] += 3.0
        edited = layer.decode(codes)
    ref = codes.clone()
    torch.testing.assert_close(edited, dense_output(layer, x, ref), atol=1e-5, rtol=1e-4)


def test_concept_probe_separates_a_planted_direction():
    rng = np.random.default_rng(0)
    negative = rng.normal(size=(200, 8))
    positive = rng.normal(size=(100, 8))
    positive[:, 3] += 5.0
    probe, accuracy = steering.concept_probe(positive, negative)
    assert accuracy >= 0.9
    fresh = rng.normal(size=(50, 8))
    assert probe.predict_proba(fresh)[:, 1].mean() < 0.2
    fresh[:, 3] += 5.0
    assert probe.predict_proba(fresh)[:, 1].mean() > 0.8
    with pytest.raises(ValueError, match="at least 5"):
        steering.concept_probe(positive[:3], negative)


@pytest.mark.parametrize("cls", [MxD, TopKTranscoder])
def test_steer_through_add_sae_equals_a_hand_written_intervention(cls, tokens):
    """A layer attached the SAELens way (HookedSAETransformer.add_sae, error term on) steers too; the
    logits equal a hook written out here: at hook_mlp_out, the clean output plus the change that the
    edited codes make to the layer's output."""
    from sae_lens import HookedSAETransformer

    hsat = make_model("gated", cls=HookedSAETransformer)
    extra = {"d_hidden": 8} if cls is MxD else {}
    layer = randomise(cls.for_model(hsat, 1, d_sae=24, k=4, **extra), 1)
    feature, alpha = 5, 3.0
    slot = {}

    def by_hand(out, hook):
        x = slot["x"]
        with torch.no_grad():
            codes = layer.encode(x).clone()
            plain = dense_output(layer, x, codes)
            codes[..., feature] += alpha
            return out + (dense_output(layer, x, codes) - plain)

    handle = hsat.blocks[1].mlp.register_forward_pre_hook(lambda m, args: slot.update(x=args[0]))
    try:
        expected = hsat.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mlp_out", by_hand)])
    finally:
        handle.remove()
    hsat.add_sae(layer, use_error_term=True)
    try:
        with steering.steer(hsat, layer, feature, alpha):
            steered = hsat(tokens)
    finally:
        hsat.reset_saes()
    torch.testing.assert_close(steered, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="add_sae"):  # neither spliced nor attached
        with steering.steer(hsat, layer, feature, alpha):
            pass


def test_steering_study_end_to_end_on_a_toy_suite(tmp_path, monkeypatch):
    """The study's glue on a one-set suite: targets, sweep, files, top contexts; at multiple 0 every
    layer generates the clean model's text (error term on), so both score the same."""
    import pandas as pd
    from test_probing import labelled_file

    from mxd_lens.analysis import tasks

    model, text = make_text_model(tmp_path)
    animals = tasks.jsonl_task_set(
        labelled_file(tmp_path / "animals.jsonl.xz"), ["cat", "dog", "bird"], per_class=20
    )
    monkeypatch.setattr(tasks, "offline_suite", lambda per_class=None, data_root=None: [animals])
    monkeypatch.setattr("mxd_lens.data.default_text", lambda: text)
    for name, layer in {
        "mxd": MxD.for_model(model, 1, d_sae=6, k=3),
        "tc": TopKTranscoder.for_model(model, 1, d_sae=16, k=3),
    }.items():
        randomise(layer, 3, scale=0.05)
        layer.save_model(tmp_path / "final" / name)
    from mxd_lens.studies import run_study
    from mxd_lens.studies.steer import SteerOptions

    study = SteerOptions(layers=str(tmp_path / "final"), k=3, tasks=["animals/cat"], multiples=[0.0, 4.0],
                                   samples=2, new_tokens=3, context_size=12, context_tokens=256)  # fmt: skip
    table = run_study("steer", model, study, tmp_path / "out").table
    assert sorted(table.name) == ["mxd", "mxd", "tc", "tc"] and (table.scale > 0).all()
    assert dict(zip(table.name, table.arch, strict=True)) == {"mxd": "mxd", "tc": "transcoder"}  # keys
    zero = table[table.multiple == 0].set_index("name")
    assert zero.loc["mxd", "example"] == zero.loc["tc", "example"]
    assert zero.loc["mxd", "concept"] == pytest.approx(zero.loc["tc", "concept"])
    for name in ("steering.csv", "steering.json", "steering.png", "contexts/mxd.html", "contexts/tc.csv"):
        assert (tmp_path / "out" / name).is_file(), name
    contexts = pd.read_csv(tmp_path / "out/contexts/tc.csv")
    assert set(contexts.feature) <= set(table[table.name == "tc"].feature)
    with pytest.raises(ValueError, match="unknown tasks"):
        run_study(
            "steer", model, SteerOptions(layers=str(tmp_path / "final"), k=3, tasks=["x/y"]), tmp_path / "bad"
        )


def test_summary_markdown_pivots_cells_and_counts_usable_features():
    import pandas as pd

    rows = []
    # rows name the architecture by its key; two MxD layers of one architecture each get their own row,
    # labelled by name, and another MxD gate is another architecture, labelled by the registry
    for name, arch, concept in [("a", "mxd", [0.0, 0.2, 0.5]), ("b", "mxd", [0.0, 0.05, 0.3]),
                                ("g", "mxd:gate=topk", [0.0, 0.0, 0.1]),
                                ("t", "transcoder", [0.0, 0.0, 0.0])]:  # fmt: skip
        for task in ["x/1", "y/2"]:
            for m, c, ppl in zip([0.0, 2.0, 8.0], concept, [40.0, 100.0, 900.0], strict=True):
                rows.append(dict(task=task, arch=arch, name=name, feature=7, multiple=m,
                                 concept=c, perplexity=ppl))  # fmt: skip
    table = pd.DataFrame(rows)
    text = steering.summary_markdown(table)
    lines = text.splitlines()
    assert lines[0] == "| task | layer (feature) | 0× | 2× | 8× |"
    assert "| x/1 | a (7) | 0.000 / 40 | 0.200 / 100 | 0.500 / 900 |" in lines
    assert "| y/2 | Transcoder (7) | 0.000 / 40 | 0.000 / 100 | 0.000 / 900 |" in lines
    # a reaches 0.2 at perplexity 100 on both tasks; b only at perplexity 900 (> 500); g and t never
    assert lines[-1].endswith("a 2/2, b 0/2, MxD (gate=topk) 0/2, Transcoder 0/2")
    assert list(steering._labels(table).unique()) == ["a", "b", "MxD (gate=topk)", "Transcoder"]
    # a steering.csv written before the arch column: `method`, the class's label, shown as it is
    old = table[table.arch != "mxd:gate=topk"].drop(columns="arch")
    old.insert(1, "method", old.name.map({"a": "MxD", "b": "MxD", "t": "Transcoder"}))
    assert list(steering._labels(old).unique()) == ["a", "b", "Transcoder"]
    assert steering.summary_markdown(old).splitlines()[-1].endswith("a 2/2, b 0/2, Transcoder 0/2")

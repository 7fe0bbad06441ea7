"""Attribution through spliced layers: the exact split of a layer's output, completeness in the frozen
model, the frozen model's response to removing one contribution, and the real model's to first order."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, randomise

import mxd_lens
from mxd_lens.attribution import attribute, contributions, frozen_target, logit_target
from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder


@pytest.mark.parametrize("cls", [MxD, TopKTranscoder, TopKSkipTranscoder, "mxd_signed"])
def test_contributions_sum_to_the_layer_output(cls):
    model = make_model("gated")
    if cls == "mxd_signed":  # MxD's plain TopK gate: signed codes
        cls = MxD
        layer = randomise(cls.for_model(model, 1, d_sae=24, k=4, gate="topk"), 3, scale=0.3)
        with torch.no_grad():
            layer.b_enc.sub_(3.0)  # many selected codes negative
        assert (contributions(layer, torch.randn(10, model.cfg.d_model)).values < 0).any()
    else:
        layer = randomise(cls.for_model(model, 1, d_sae=24, k=4), 3, scale=0.3)
    x = torch.randn(10, model.cfg.d_model)
    split = contributions(layer, x)
    with torch.no_grad():
        torch.testing.assert_close(split.total(), layer(x), rtol=1e-5, atol=1e-6)
    assert split.vectors.shape == (10, 4, model.cfg.d_model)
    if cls is MxD:  # e_{t,n} = a_n ((z D) * c_n), written out
        zD = layer.hidden(x) @ layer.W_out
        t, j = 3, 1
        n, a = split.indices[t, j], split.values[t, j]
        torch.testing.assert_close(split.vectors[t, j], a * zD[t] * layer.W_dec[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, gate", [("gpt2", "relu_topk"), ("gated", "relu_topk"), ("gated", "topk")])
@pytest.mark.parametrize("error_term", [True, False])
@pytest.mark.parametrize("first", [0, 1])
def test_parts_sum_to_the_target_and_removing_a_contribution_moves_it_by_its_attribution(
    kind, gate, error_term, first
):
    """``first``: the layer's first trained position (seqpos_slice); before it the MLP's own output is a
    "mlp (dense)" part of the spliced block, and no unit is active there."""
    model = make_model(kind)
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, gate=gate), 5, scale=0.3)
    layer.cfg.metadata.seqpos_slice = [first, None]
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    target = logit_target(token=7, minus=3)
    with mxd_lens.splice(model, layer, error_term=error_term):
        result = attribute(model, tokens, target)
        with torch.no_grad():
            real = float(target(model(tokens)))
        assert result.target == pytest.approx(real, rel=1e-5)  # linearised at the prompt: same value
        assert result.completeness <= 1e-4, (result.total, result.target)
        # the frozen model is affine in each contribution: removing one moves the target by its attribution
        top = result.top(1).iloc[0]
        split = contributions(layer, torch.as_tensor(_mlp_in(model, tokens, 1)))
        t, unit = int(top.position), int(top.unit)
        j = int((split.indices[t] == unit).nonzero())
        name = "blocks.1.hook_mlp_out"
        edited = result.frozen[name].clone()
        edited[0, t] -= split.vectors[t, j]
        moved = frozen_target(model, tokens, target, result, edit={name: edited}) - result.target
        assert moved == pytest.approx(-top.attribution, rel=1e-4, abs=1e-6)
        assert (result.units.position >= first).all()
        kept = result.parts[(result.parts.block == 1) & (result.parts.position < first)]
        assert list(kept.kind) == ["mlp (dense)"] * first
        if first:  # the MLP's own output at position 0: removing it moves the target by its attribution
            edited = result.frozen[name].clone()
            edited[0, 0] = 0
            moved = frozen_target(model, tokens, target, result, edit={name: edited}) - result.target
            assert moved == pytest.approx(-float(kept.attribution.iloc[0]), rel=1e-4, abs=1e-6)
    assert not (result.units.attribution == 0).all()


def _mlp_in(model, tokens, block):
    with torch.no_grad(), mxd_lens.capture_mlp_io(model, [block]) as io:
        model(tokens)
    return io[block]["in"][0]


def test_bad_input_is_named():
    model = make_model("gated")
    layer = MxD.for_model(model, 1, d_sae=8, k=2)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 6))
    with pytest.raises(ValueError, match="no layer is spliced"):
        attribute(model, tokens, logit_target(3))
    with mxd_lens.splice(model, layer):
        with pytest.raises(ValueError, match=f"target token {model.cfg.d_vocab} is not in the vocabulary"):
            attribute(model, tokens, logit_target(model.cfg.d_vocab))
        with pytest.raises(ValueError, match="target position 9 is out of range for a prompt of 6 tokens"):
            attribute(model, tokens, logit_target(3, position=9))
        with pytest.raises(ValueError, match="token id -1 is not in the vocabulary"):
            attribute(model, torch.tensor([[1, -1, 2]]), logit_target(3))


def test_real_model_agrees_to_first_order_once_the_final_norm_is_accounted_for():
    """In the real model a small ablation also moves what the freeze holds fixed. At the last block only
    the final RMSNorm's scale s lies downstream, so to first order the real change of removing ε·e is
    ε·(−attribution + (T − Δb_U)(r·e)/(d s²)), with r the final residual (derivative of r/s). Checked
    by finite differences (ε = 1e-3: agreement to ~1e-3 relative, the second-order term)."""
    model = make_model("gated")
    last = model.cfg.n_layers - 1
    layer = randomise(MxD.for_model(model, last, d_sae=24, k=4), 5, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    target = logit_target(token=7, minus=3)
    with mxd_lens.splice(model, layer, error_term=True):
        result = attribute(model, tokens, target)
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens, names_filter=lambda n: n in (f"blocks.{last}.hook_resid_post", "ln_final.hook_scale")
            )
        r, s = cache[f"blocks.{last}.hook_resid_post"][0, -1], cache["ln_final.hook_scale"][0, -1, 0]
        split = contributions(layer, _mlp_in(model, tokens, last))
        d_b_u = float((model.b_U[7] - model.b_U[3]).detach())
        for _, top in result.top(3).iterrows():
            t, unit = int(top.position), int(top.unit)
            e = split.vectors[t, int((split.indices[t] == unit).nonzero())]
            eps = 1e-3

            def ablate(value, hook, t=t, e=e, eps=eps):
                value = value.clone()
                value[0, t] -= eps * e
                return value

            with torch.no_grad():
                moved = float(
                    target(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{last}.hook_mlp_out", ablate)]))
                )
            predicted = -top.attribution + (result.target - d_b_u) * float(r @ e) / (
                model.cfg.d_model * float(s) ** 2
            )
            assert (moved - result.target) / eps == pytest.approx(predicted, rel=5e-3, abs=1e-4)


def _frozen_pre(model, tokens, down_layer, block, edit):
    """Downstream pre-activations in the frozen model (patterns, scales, MLP outputs as on the clean
    prompt), with ``edit`` {hook name: value} replacing MLP outputs: written here independently."""
    names = [f"blocks.{b}.hook_mlp_out" for b in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(
            tokens, names_filter=lambda n: n.endswith(("hook_pattern", "hook_scale")) or n in names
        )
        hooks_ = [(lambda n: n.endswith(("hook_pattern", "hook_scale")), lambda v, hook: cache[hook.name]),
                  (lambda n: n in names, lambda v, hook: edit.get(hook.name, cache[hook.name]))]  # fmt: skip
        with mxd_lens.capture_mlp_io(model, [block]) as io:
            model.run_with_hooks(tokens, fwd_hooks=hooks_)
        x = down_layer.process_sae_in(io[block]["in"][0])
        return x @ down_layer.W_enc + down_layer.b_enc


@pytest.mark.parametrize("down_cls", [MxD, TopKTranscoder])
def test_edges_are_the_frozen_change_of_downstream_gates(down_cls):
    from mxd_lens.attribution import edges

    model = make_model("gated")
    up = randomise(MxD.for_model(model, 0, d_sae=16, k=3), 1, scale=0.3)
    down = randomise(down_cls.for_model(model, 2, d_sae=16, k=3), 2, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    with mxd_lens.splice(model, up, down):
        assert (edges(model, tokens, 0, 2, keep=1.0).up_position == 0).any()
    up.cfg.metadata.seqpos_slice = [1, None]  # trained without position 0: no unit of it writes there
    with mxd_lens.splice(model, up, down):
        table = edges(model, tokens, 0, 2, keep=1.0)
        assert (table.up_position <= table.down_position).all() and len(table)
        assert (table.up_position >= 1).all()
        top = table.iloc[0]
        split = contributions(up, _mlp_in(model, tokens, 0))
        t1, u = int(top.up_position), int(top.up_unit)
        e = split.vectors[t1, int((split.indices[t1] == u).nonzero())]
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter="blocks.0.hook_mlp_out")
        edited = cache["blocks.0.hook_mlp_out"].clone()
        edited[0, t1] -= e
        before = _frozen_pre(model, tokens, down, 2, {})
        after = _frozen_pre(model, tokens, down, 2, {"blocks.0.hook_mlp_out": edited})
        t2, m = int(top.down_position), int(top.down_unit)
        assert float(before[t2, m]) == pytest.approx(top.down_pre, rel=1e-5)
        assert float(after[t2, m] - before[t2, m]) == pytest.approx(-top.weight, rel=1e-4, abs=1e-6)
        pruned = edges(model, tokens, 0, 2, keep=0.5)
        assert len(pruned) < len(table)
        with pytest.raises(ValueError, match="no layer is spliced at block 1"):
            edges(model, tokens, 1, 2)


def test_report_writes_the_table_graph_and_one_page(tmp_path):
    from mxd_lens.attribution import edges
    from mxd_lens.studies.attribution.run import attribution_report
    from mxd_lens.studies.report import write_result

    model = make_model("gated")
    up = randomise(MxD.for_model(model, 0, d_sae=16, k=3), 1, scale=0.3)
    down = randomise(MxD.for_model(model, 2, d_sae=16, k=3), 2, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    with mxd_lens.splice(model, up, down, error_term=True):
        result = attribute(model, tokens, logit_target(5))
        graph = {(0, 2): edges(model, tokens, 0, 2, keep=0.5)}
    top = result.top(1).iloc[0]
    report = attribution_report(result, graph, contexts={(int(top.block), int(top.unit)): "the <cat> sat"})
    written = {p.name for p in write_result(report, tmp_path)}
    assert written == {"units.csv", "parts.csv", "graph.png", "report.html"}
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "completeness" in page and "the &lt;cat&gt; sat" in page
    assert (tmp_path / "graph.png").stat().st_size > 0
    import pandas as pd

    units = pd.read_csv(tmp_path / "units.csv")
    assert units.attribution.sum() + pd.read_csv(tmp_path / "parts.csv").attribution.sum() == pytest.approx(
        result.target, rel=1e-4
    )


def test_the_study_compares_architectures_at_the_same_blocks_and_its_numbers_are_the_attributions(tmp_path):
    from conftest import make_text_model

    from mxd_lens.attribution import replacement_summary
    from mxd_lens.studies import run_study
    from mxd_lens.studies.attribution import AttributionOptions as AttributionStudy

    def run_attribution_study(model, study, out=None, progress=False):
        return run_study("attribution", model, study, out).table

    model, _ = make_text_model(tmp_path)
    saved = {}
    for cls, seed, options in ((MxD, 1, {}), (TopKTranscoder, 2, {}), (MxD, 3, {"gate": "topk"})):
        for block in (0, 1):
            layer = randomise(cls.for_model(model, block, d_sae=12, k=3, **options), seed + block, scale=0.3)
            folder = tmp_path / "final" / f"{cls.__name__}.{block}{'.topk' if options else ''}"
            layer.save_model(folder)
            if not options:
                saved[(cls, block)] = layer
    prompts = ["the cat sat on a| mat| dogs", "birds sang songs of| rain"]
    study = AttributionStudy(layers=[str(tmp_path / "final")], k=3, prompts=prompts, top=2)
    table = run_attribution_study(model, study, tmp_path / "out", progress=False)
    # one row per prompt and architecture key: two MxD gates at the same blocks are two architectures
    assert sorted(table.arch) == ["mxd", "mxd", "mxd:gate=topk", "mxd:gate=topk", "transcoder", "transcoder"]
    assert {p.name for p in (tmp_path / "out").iterdir() if p.is_dir()} >= {
        "mxd",
        "mxd-gate=topk",
        "transcoder",
    }
    assert set(table.blocks) == {"0,1"} and (table.completeness <= 1e-4).all()
    # the MxD row of the first prompt, by hand from attribute()
    with mxd_lens.splice(model, saved[(MxD, 0)], saved[(MxD, 1)], error_term=True):
        result = attribute(
            model,
            "the cat sat on a",
            logit_target(model.to_single_token(" mat"), model.to_single_token(" dogs")),
        )
    row = table[(table.arch == "mxd")].iloc[0]
    assert row.logit == "' mat' − ' dogs'" and row.target == pytest.approx(result.target)
    units = result.units.attribution
    error = result.parts[result.parts.kind == "error"].attribution.sum()
    rest = result.parts[result.parts.kind == "rest (bias, skip)"].attribution.sum()
    top2 = units.reindex(units.abs().sort_values(ascending=False).index)[:2]
    assert row.spliced == pytest.approx(units.sum() + error + rest, rel=1e-5)
    assert row.top_fraction == pytest.approx(top2.sum() / row.spliced, rel=1e-5)
    assert row.error_fraction == pytest.approx(error / row.spliced, rel=1e-5)
    errors = result.parts[result.parts.kind.isin(("error", "rest (bias, skip)"))]
    mass = units.abs().sum() + errors.attribution.abs().sum()
    assert row.top_abs_share == pytest.approx(top2.abs().sum() / mass, rel=1e-5)
    assert row.error_abs_share == pytest.approx(
        errors[errors.kind == "error"].attribution.abs().sum() / mass, rel=1e-5
    )
    assert replacement_summary(result, 2)["top_fraction"] == pytest.approx(row.top_fraction, rel=1e-5)
    assert (tmp_path / "out" / "attribution_study.csv").is_file() and (
        tmp_path / "out" / "mxd" / "report.html"
    ).is_file()
    # bad input is named
    with pytest.raises(ValueError, match="'hills green' is 2 tokens"):
        run_attribution_study(
            model, AttributionStudy(layers=study.layers, k=3, prompts=["the cat|hills green"]), progress=False
        )
    with pytest.raises(
        ValueError, match=r"missing: \{'mxd': \[2\], 'mxd:gate=topk': \[2\], 'transcoder': \[2\]\}"
    ):
        run_attribution_study(
            model, AttributionStudy(layers=study.layers, k=3, blocks=[0, 2], prompts=prompts), progress=False
        )
    saved[(MxD, 0)].save_model(tmp_path / "seed1" / "MxD.0.seed1")  # a second MxD at block 0
    with pytest.raises(ValueError, match="two mxd layers with K=3 at block 0"):
        run_attribution_study(
            model, AttributionStudy(layers=[*study.layers, str(tmp_path / "seed1")], k=3), progress=False
        )
    with pytest.raises(ValueError, match="no layer with K=7"):
        run_attribution_study(model, AttributionStudy(layers=study.layers, k=7), progress=False)


def test_the_scripts_print_and_write_what_the_library_computes(tmp_path, monkeypatch, capsys):
    """mxd-lens attribute and mxd-lens attribution over saved layers of a tiny model: the printed target
    and completeness are attribute()'s, the report and the study's files are written."""
    import re

    from conftest import make_text_model

    import mxd_lens.models
    from mxd_lens.cli import main

    def attribution_script(argv):
        return main(["attribute", *argv])

    def attribution_study(argv):
        return main(["attribution", *argv])

    model, _ = make_text_model(tmp_path)
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda *args, **kw: model)
    layers = []
    for cls, seed in ((MxD, 1), (TopKTranscoder, 2)):
        for block in (0, 1):
            layer = randomise(cls.for_model(model, block, d_sae=12, k=3), seed + block, scale=0.3)
            layer.save_model(tmp_path / "final" / f"{cls.__name__}.{block}")
            layers.append(layer)
    mxd_folders = [str(tmp_path / "final" / f"MxD.{block}") for block in (0, 1)]
    argv = ["--layers", *mxd_folders, "--prompt", "the cat sat on a", "--target", " mat", "--minus", " dogs"]
    argv += ["--context-tokens", "0", "--out", str(tmp_path / "one")]
    argv_one = argv
    assert attribution_script(argv) == 0
    printed = capsys.readouterr().out
    with mxd_lens.splice(model, *layers[:2], error_term=True):
        expected = attribute(
            model,
            "the cat sat on a",
            logit_target(model.to_single_token(" mat"), model.to_single_token(" dogs")),
        )
    found = re.search(r"target ([-+.\d]+); parts sum ([-+.\d]+); completeness ([-+.\de]+)", printed)
    assert found and float(found[1]) == pytest.approx(expected.target, abs=1e-5)
    assert float(found[3]) <= 1e-4
    assert {p.name for p in (tmp_path / "one").iterdir()} >= {
        "units.csv",
        "parts.csv",
        "graph.png",
        "report.html",
    }

    argv = ["--layers", str(tmp_path / "final"), "--k", "3", "--top", "2", "--out", str(tmp_path / "study")]
    argv += ["--prompts", "the cat sat on a| mat| dogs", "birds sang songs of| rain"]
    assert attribution_study(argv) == 0
    printed = capsys.readouterr().out
    assert "top_abs_share mean" in printed and "error_abs_share median" in printed
    assert (tmp_path / "study" / "attribution_study.csv").is_file()
    with pytest.raises(SystemExit, match="mxd-lens attribution: .*'hills green' is 2 tokens"):
        attribution_study(argv[:-2] + ["the cat|hills green"])
    # a word outside the vocabulary would silently attribute the <unk> logit: refused
    with pytest.raises(
        SystemExit, match=r"mxd-lens attribute: ' zebra' is not in this model's vocabulary .*<unk>"
    ):
        attribution_script(argv_one[:5] + ["--target", " zebra", "--out", str(tmp_path / "unk")])


def _gqa_with_value_biases():
    """A Qwen2-like block: grouped-query attention (2 KV heads for 4 query heads) whose Q/K/V biases
    are non-zero. TransformerLens stores the grouped value bias as ``_b_V`` (``b_V`` is a property)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        n_layers=3, d_model=16, n_ctx=12, d_head=4, n_heads=4, n_key_value_heads=2, d_mlp=40, d_vocab=61,
        normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
        rotary_dim=4, device="cpu",
    )  # fmt: skip
    model = HookedTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1].lstrip("_").startswith("b"):
                p.normal_(0, 0.5)
    assert any(name.endswith("._b_V") for name, _ in model.named_parameters())
    return model


def test_grouped_query_value_biases_are_sources_and_the_parts_sum_to_the_target():
    """The Qwen2 failure: the value bias `_b_V` was not selected, and completeness was 4.2 here."""
    model = _gqa_with_value_biases()
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), 5, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    with mxd_lens.splice(model, layer):
        result = attribute(model, tokens, logit_target(token=7, minus=3))
    assert result.completeness <= 1e-4, (result.total, result.target)
    value_bias = result.parts[result.parts.kind.str.endswith("._b_V")]
    assert len(value_bias) == 3 and value_bias.attribution.abs().sum() > 1e-3


def test_a_source_missed_by_name_is_an_error_not_a_wrong_answer(monkeypatch):
    """The name-free check: zeroing every embedding and MLP output leaves what the biases carry; a bias
    the name rule misses makes that disagree, and attribute raises instead of returning parts that do
    not sum to the target."""
    import mxd_lens.attribution as attribution

    model = _gqa_with_value_biases()
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), 5, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(attribution, "_BIAS_NAMES", ("b_O", "b_U", "b"))  # the old rule's blind spot
    with mxd_lens.splice(model, layer), pytest.raises(RuntimeError, match="does not recognise as a source"):
        attribute(model, tokens, logit_target(token=7))


def test_a_soft_capped_head_is_linearised_at_the_prompt_and_the_parts_still_sum():
    """Gemma-2's logits are cap * tanh(u / cap): attribution freezes that tanh at its tangent on the
    prompt, as it freezes patterns and norm scales. The target is the model's own, the parts (with the
    tangent's offset as one of them) sum to it, and removing a contribution moves the frozen target by
    exactly its attribution."""
    model = make_model("gated")
    model.cfg.output_logits_soft_cap = 2.0  # small, so the tanh bends: logits here reach about ±3
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4), 5, scale=0.3)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    target = logit_target(token=7, minus=3)
    with mxd_lens.splice(model, layer):
        result = attribute(model, tokens, target)
        with torch.no_grad():
            logits = model(tokens)
            real = float(target(logits))
        assert logits.abs().max() < 2.0 and model.cfg.output_logits_soft_cap == 2.0  # the cap was applied
        assert result.target == pytest.approx(real, rel=1e-5)
        assert result.completeness <= 1e-4, (result.total, result.target)
        assert (result.parts.kind == "logit soft-cap (linearised)").sum() == 1
        top = result.top(1).iloc[0]
        split = contributions(layer, torch.as_tensor(_mlp_in(model, tokens, 1)))
        t, unit = int(top.position), int(top.unit)
        j = int((split.indices[t] == unit).nonzero())
        edited = result.frozen["blocks.1.hook_mlp_out"].clone()
        edited[0, t] -= split.vectors[t, j]
        edit = {"blocks.1.hook_mlp_out": edited}
        moved = frozen_target(model, tokens, target, result, edit=edit) - result.target
        assert moved == pytest.approx(-top.attribution, rel=1e-4, abs=1e-6)

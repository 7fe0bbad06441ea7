"""SPD component ablation: ablate() against weights edited by hand, concept scoring on a planted
component, the effect report, the model run from a cached residual stream, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import D_VOCAB, make_model
from transformer_lens import HookedTransformer, HookedTransformerConfig

from mxd_lens.spd import Decomposition, SPDConfig, SPDTrainer, evaluate
from mxd_lens.spd.ablation import (
    ResidualModel,
    ablate,
    ablation_effect,
    check_components,
    component_norms,
    concept_scores,
    norm_matched_components,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(seed: int = 0, shape=(3, 12)) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _randomised(decomp: Decomposition, seed: int = 1) -> Decomposition:
    """Components of unequal norms (the init draws them all alike)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for part in decomp.components.values():
            part.V.mul_(torch.rand(part.V.shape[1], generator=g) * 2 + 0.1)
    return decomp


def _edit_by_hand(model: HookedTransformer, decomp: Decomposition, name: str, indices: list[int]) -> None:
    """Subtract Σ_c v_c u_c (the Wᵀ layout) from the model's own parameter."""
    part = decomp.components[name.replace(".", "-")]
    removed = sum(torch.outer(part.V[:, c], part.U[c]) for c in indices).detach()  # [d_in, d_out]
    layer, kind = int(name.split(".")[1]), name.split(".")[-1]
    block = model.blocks[layer]
    with torch.no_grad():
        if kind in ("W_in", "W_gate", "W_out"):
            getattr(block.mlp, kind).sub_(removed)
        elif kind == "W_O":
            block.attn.W_O.sub_(removed.reshape(block.attn.W_O.shape))
        else:  # W_Q: [heads, d_model, d_head], Wᵀ is [d_model, heads * d_head]
            heads, d_model, d_head = block.attn.W_Q.shape
            block.attn.W_Q.sub_(removed.reshape(d_model, heads, d_head).permute(1, 0, 2))


@pytest.mark.parametrize("kind", ["gpt2", "gated"])
def test_ablating_equals_removing_the_rank_one_term_from_the_weight(kind):
    model = make_model(kind)
    names = ["blocks.0.attn.W_Q", "blocks.1.mlp.W_in", "blocks.1.mlp.W_out", "blocks.2.attn.W_O"]
    decomp = _randomised(Decomposition(model, names, C=6, ci="token", ci_hidden=4))
    tokens = _tokens()
    for chosen in ({names[0]: [1]}, {names[1]: [0, 4], names[2]: [5]}, {names[3]: [2, 3]}):
        edited = copy.deepcopy(model)
        for name, indices in chosen.items():
            _edit_by_hand(edited, decomp, name, indices)
        with ablate(decomp, chosen) as patched:
            got = patched(tokens)
        want = edited(tokens)
        assert (want - model(tokens)).abs().max() > 1e-3  # the ablation does something
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # hooks are gone afterwards
    torch.testing.assert_close(model(tokens), make_model(kind)(tokens), atol=0, rtol=0)


def test_ablating_equals_patched_with_zero_masks_and_delta_on():
    model = make_model("gated")
    name = "blocks.1.mlp.W_gate"
    decomp = _randomised(Decomposition(model, [name], C=5, ci="token"))
    tokens = _tokens(3)
    masks = torch.ones(*tokens.shape, 5)
    masks[..., [0, 3]] = 0
    with decomp.patched({name: masks}):
        want = model(tokens)
    with ablate(decomp, {name: [3, 0]}):
        got = model(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("delta", [True, False])
def test_nothing_ablated_is_the_clean_model(delta):
    model = make_model("gpt2")
    names = ["blocks.0.mlp.W_in", "blocks.2.attn.W_V"]
    decomp = Decomposition(model, names, C=4, ci="token", delta=delta)
    tokens = _tokens(1)
    clean = model(tokens)
    for nothing in ({}, {names[0]: []}, {names[0]: [], names[1]: []}):
        with ablate(decomp, nothing):
            assert torch.equal(model(tokens), clean)


def _planted_model() -> tuple[HookedTransformer, int, int]:
    """One block, no normalisation, attention output zeroed: the MLP reads the token embedding only.
    Token A's embedding is token B's plus 3·e_0; no other token has anything along e_0."""
    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_ctx=12, d_head=4, n_heads=2, d_mlp=16, d_vocab=20, act_fn="relu",
        normalization_type=None, seed=0, device="cpu", model_name="tiny-planted",
    )  # fmt: skip
    model = HookedTransformer(cfg).eval()
    A, B = 1, 2
    with torch.no_grad():
        model.W_pos.zero_()
        model.blocks[0].attn.W_O.zero_()
        model.blocks[0].attn.b_O.zero_()
        model.W_E[:, 0] = 0
        model.W_E[A] = model.W_E[B]
        model.W_E[A, 0] = 3.0
    return model, A, B


def _plant(decomp: Decomposition, name: str, k: int) -> None:
    """Component k reads e_0 (and its CI fires on it); every other component is blind to e_0."""
    part = decomp.components[name.replace(".", "-")]
    ci = decomp.ci[f"d_in_{part.V.shape[0]}"]
    H = decomp.ci_hidden
    with torch.no_grad():
        part.V[0] = 0
        part.V[:, k] = 0
        part.V[0, k] = 1.0
        ci.W_hidden[0, 0] = 0
        ci.W_hidden[0, :, k * H : (k + 1) * H] = 0
        ci.W_hidden[0, 0, k * H] = 5.0
        ci.b_hidden[0, 0, k * H : (k + 1) * H] = 0
        ci.w_out[0, 0, k] = 0
        ci.w_out[0, 0, k, 0] = 1.0
        ci.b_out[0, 0, k] = 0


@pytest.mark.parametrize("method", ["ci", "activation"])
def test_concept_scoring_ranks_a_planted_component_first(method):
    model, A, B = _planted_model()
    name, k = "blocks.0.mlp.W_in", 5
    decomp = Decomposition(model, [name], C=8, ci="token", ci_hidden=4, seed=3)
    _plant(decomp, name, k)
    g = torch.Generator().manual_seed(0)
    concept, control = [], []
    for _ in range(3):
        rows = torch.randint(3, 20, (4, 12), generator=g)
        rows[torch.rand(rows.shape, generator=g) < 0.3] = A
        concept.append(rows)
        control.append(torch.where(rows == A, B, rows))  # the same rows with B for A: only e_0 differs
    scores = concept_scores(decomp, model, concept, control, method=method)[name]
    assert scores.top(1) == [k]
    assert scores.score[k] > 0.1
    others = torch.cat([scores.score[:k], scores.score[k + 1 :]])
    assert others.abs().max() < 1e-5
    assert scores.control[k].abs() < 1e-6
    assert scores.n_concept == scores.n_control == 3 * 4 * 11  # the BOS position is skipped
    report = scores.to_dict(k=3)
    assert report["top"][0]["component"] == k and len(report["top"]) == 3
    # the same through a model run from a cached residual stream
    start = ResidualModel(model, 0)
    on_residuals = concept_scores(decomp, start, [start.residual(t) for t in concept],
                                  [start.residual(t) for t in control], method=method)[name]  # fmt: skip
    torch.testing.assert_close(on_residuals.score, scores.score)


def test_ablation_effect_reports_target_control_and_norm_matched_random():
    model = make_model("gpt2")
    name = "blocks.2.mlp.W_out"
    decomp = _randomised(Decomposition(model, [name], C=12, ci="token"))
    target, control = [_tokens(1), _tokens(2)], [_tokens(3)]
    report = ablation_effect(model, decomp, {name: [4]}, target, control, n_random=3, pool=4, seed=0)
    assert set(report["effects"]) == {"target", "control"}
    # the numbers, recomputed here
    tokens = torch.cat(target)
    with torch.no_grad():
        clean = F.log_softmax(model(tokens), -1)[:, :-1]
        with ablate(decomp, {name: [4]}):
            ablated = F.log_softmax(model(tokens), -1)[:, :-1]
    labels = tokens[:, 1:, None]
    ce_clean, ce = (-lp.gather(-1, labels).mean() for lp in (clean, ablated))
    effect = report["effects"]["target"]
    assert effect["delta_ce"] == pytest.approx(float(ce - ce_clean), abs=1e-5)
    kl = (clean.exp() * (clean - ablated)).sum(-1).mean()
    assert effect["kl"] == pytest.approx(float(kl), abs=1e-6)
    assert effect["n_rows"] == 6 and effect["n_tokens"] == 6 * 11
    # three different stand-ins, never the ablated one, among the 4 nearest in norm
    norms = component_norms(decomp, name)
    nearest = set(torch.argsort((norms.log() - norms[4].log()).abs())[1:5].tolist())
    picks = [r["components"][name][0] for r in report["random"]]
    assert len(set(picks)) == 3 and set(picks) <= nearest
    assert set(report["random_mean"]) == {"target", "control"}
    mean = sum(r["effects"]["control"]["kl"] for r in report["random"]) / 3
    assert report["random_mean"]["control"]["kl"] == pytest.approx(mean)
    # several control sets by label
    labelled = ablation_effect(model, decomp, {name: [4]}, target, {"a": control, "b": target}, n_random=0)
    assert set(labelled["effects"]) == {"target", "a", "b"} and labelled["random"] == []
    assert labelled["effects"]["b"] == labelled["effects"]["target"]


def test_norm_matched_draws_skip_all_ablated_components():
    model = make_model("gpt2")
    name = "blocks.1.mlp.W_in"
    decomp = _randomised(Decomposition(model, [name], C=6, ci="token"))
    draws = norm_matched_components(
        decomp, {name: [0, 1]}, n=4, pool=2, generator=torch.Generator().manual_seed(0)
    )
    for draw in draws:
        assert len(draw[name]) == 2 and not set(draw[name]) & {0, 1}


def test_residual_model_trains_and_ablates_like_the_full_model(tmp_path):
    model = make_model("gated")
    start = ResidualModel(model, 1)
    tokens = _tokens(5, (4, 12))
    resid = start.residual(tokens)
    torch.testing.assert_close(start(resid), model(tokens), atol=1e-5, rtol=1e-5)
    name = "blocks.2.mlp.W_out"
    start.check_modules([name, "blocks.1.attn.W_Q"])
    with pytest.raises(ValueError, match="before block 1"):
        start.check_modules(["blocks.0.mlp.W_in"])
    with pytest.raises(ValueError, match="residual stream"):
        start(tokens)

    config = SPDConfig(C=4, steps=2, batch_size=4, ci="sequence", ci_hidden=4, layerwise_recon=1.0,
                       ci_masked_recon=1.0, log_every=1, checkpoint_every=0)  # fmt: skip
    trainer = SPDTrainer(start, [name], lambda step: resid, config, tmp_path, progress=False)
    metrics = trainer.fit()
    assert {"stochastic_recon", "subset_recon", "layerwise_recon", "ci_masked_recon"} <= set(metrics)
    report = evaluate(trainer.decomposition, resid)
    assert report["kl_unmasked"] == pytest.approx(0.0, abs=1e-6)
    decomp = trainer.decomposition
    with ablate(decomp, {name: [1]}):
        via_residual = start(resid)
        via_tokens = model(tokens)
    torch.testing.assert_close(via_residual, via_tokens, atol=1e-5, rtol=1e-5)
    a = ablation_effect(start, decomp, {name: [1]}, [(resid, tokens)], [(resid, tokens)], n_random=1)
    b = ablation_effect(model, decomp, {name: [1]}, [tokens], [tokens], n_random=1)
    assert a["effects"]["target"]["delta_ce"] == pytest.approx(b["effects"]["target"]["delta_ce"], abs=1e-5)

    bad = SPDTrainer(start, [name], lambda step: resid[:, :, 0], config, tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="float residual stream"):
        bad.fit()


def test_bad_input_is_named():
    model = make_model("gpt2")
    name = "blocks.1.mlp.W_in"
    decomp = Decomposition(model, [name], C=4, ci="token")
    with pytest.raises(ValueError, match="not decomposed here"):
        with ablate(decomp, {"blocks.0.mlp.W_in": [0]}):
            pass
    for bad in (4, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"out of range: components are 0\.\.3"):
            check_components(decomp, {name: [bad]})
    with pytest.raises(ValueError, match="must map weight names"):
        check_components(decomp, [0, 1])
    assert check_components(decomp, {name: [2, 0, 2]}) == {name: [0, 2]}
    assert check_components(decomp, {name: torch.tensor(3)}) == {name: [3]}
    with pytest.raises(ValueError, match="method="):
        concept_scores(decomp, model, [_tokens()], [_tokens()], method="gradient")
    with pytest.raises(ValueError, match="no control positions"):
        concept_scores(decomp, model, [_tokens()], [])
    with pytest.raises(ValueError, match="not the same host model"):
        ablation_effect(make_model("gpt2"), decomp, {name: [0]}, [_tokens()], [_tokens()])
    with pytest.raises(ValueError, match="must come as an"):
        start = ResidualModel(model, 1)
        ablation_effect(start, decomp, {name: [0]}, [start.residual(_tokens())], [_tokens()], n_random=0)
    with pytest.raises(ValueError, match="layer=5"):
        ResidualModel(model, 5)


def test_real_model_study_end_to_end_on_toy_data(tmp_path):
    """The study's glue on a tiny model and a toy data folder (the real one's file names): every file
    written, the chosen concept the argmax of the selection scores, the tables complete, a rerun reusing
    what was saved."""
    import json
    import lzma
    import random

    import pandas as pd
    from conftest import WORDS, make_text_model

    from mxd_lens.studies.report import write_result
    from mxd_lens.studies.spd_ablation import CONCEPTS
    from mxd_lens.studies.spd_ablation import SPDAblationOptions as RealModelStudy
    from mxd_lens.studies.spd_ablation.run import CORPUS, ablation_result, run_real_model_study

    model, _ = make_text_model(tmp_path)
    rng = random.Random(0)

    def sentence(marker=""):
        words = [rng.choice(WORDS[4:]) for _ in range(rng.randint(14, 30))]
        return " ".join(([marker] if marker else []) + words)

    (tmp_path / "data/corpus").mkdir(parents=True)
    (tmp_path / "data/probing").mkdir()
    for name in CORPUS:
        with lzma.open(tmp_path / f"data/corpus/{name}.txt.xz", "wt") as f:
            f.write("\n\n".join(sentence() for _ in range(300)))
    for file, label in CONCEPTS.values():
        with lzma.open(tmp_path / f"data/probing/{file}.jsonl.xz", "wt") as f:
            for i in range(160):
                lab = label if i % 2 else "other"
                f.write(json.dumps({"text": sentence("cat" if lab == label else "dog"), "label": lab}) + "\n")
    study = RealModelStudy(data=str(tmp_path / "data"), block=1, context_size=12, train_rows=28, C=8, steps=3,
                           batch_size=4, ci="token", ci_hidden=4, score_rows=4, eval_rows=7, n_random=2)  # fmt: skip
    out = run_real_model_study(model, study, tmp_path / "out", command="test")
    result = ablation_result(out)
    write_result(result, tmp_path / "out")
    for name in (
        "decomposition.json",
        "scores.json",
        "ablation.json",
        "by_ci.json",
        "ablation.png",
        "ablation_effects.csv",
        "by_ci.csv",
    ):
        assert (tmp_path / "out" / name).is_file(), name
    assert not (tmp_path / "out/RESULTS.md").exists()  # tables and numbers only: no written reading
    selection = out["scores"]["selection_scores"]
    assert out["ablation"]["chosen"] == max(selection, key=selection.get)
    table = [
        line
        for line in result.text.splitlines()
        if line.startswith("| ") and (" top1 [" in line or " top3 [" in line)
    ]
    assert len(table) == len(CONCEPTS) * 2 * 3  # concept x top-1/3 x text set
    # the CSV holds the numbers of ablation.json, one row per concept x top-k x text set
    rows = pd.read_csv(tmp_path / "out/ablation_effects.csv")
    assert len(rows) == len(CONCEPTS) * 2 * 3 and rows.chosen.sum() == 2 * 3
    chosen = out["ablation"]["chosen"]
    first = rows[(rows.concept == chosen) & (rows.k == 1) & (rows.set == "target")].iloc[0]
    effect = out["ablation"]["results"][chosen]["top1"]["effects"]["target"]
    assert first.delta_ce == pytest.approx(effect["delta_ce"]) and first.kl == pytest.approx(effect["kl"])
    by_ci = pd.read_csv(tmp_path / "out/by_ci.csv")
    assert len(by_ci) == 2 * 2 and set(by_ci.ci) == {"on", "off"}
    assert by_ci.n.sum() == sum(
        v["top1"][p]["n"] for v in out["by_ci"]["sets"].values() for p in ("on", "off")
    )
    again = run_real_model_study(model, study, tmp_path / "out", command="test")
    assert again["ablation"] == out["ablation"]

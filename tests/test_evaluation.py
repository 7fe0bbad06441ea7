"""Evaluation numbers against direct computations with TransformerLens hooks."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import D_VOCAB, make_model, randomise

import mxd_lens
from mxd_lens import MxD, TopKTranscoder, data
from mxd_lens.evaluation import check_disjoint, evaluate


def batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, D_VOCAB, (2, 12), generator=g) for _ in range(n)]


def mean_loss(model, data, fwd_hooks=()):
    with torch.no_grad():
        return sum(
            float(model.run_with_hooks(t, return_type="loss", fwd_hooks=list(fwd_hooks))) for t in data
        ) / len(data)


def hand_spliced(model, layers, data):
    """Mean CE and per-batch log-probs with each block's hook_mlp_out replaced by layer(x), x taken by a
    forward pre-hook on that block's MLP module: the intervention written out, without mxd_lens.splice."""
    handles, fwd_hooks = [], []
    for block, layer in layers.items():
        slot = {}
        module = model.blocks[block].mlp
        handles.append(module.register_forward_pre_hook(lambda m, args, slot=slot: slot.update(x=args[0])))
        fwd_hooks.append(
            (f"blocks.{block}.hook_mlp_out", lambda out, hook, slot=slot, layer=layer: layer(slot["x"]))
        )
    try:
        loss = mean_loss(model, data, fwd_hooks)
        with torch.no_grad():
            logp = [F.log_softmax(model.run_with_hooks(t, fwd_hooks=fwd_hooks)[:, :-1], -1) for t in data]
    finally:
        for handle in handles:
            handle.remove()
    return loss, logp


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
def test_numbers_match_direct_computation(kind):
    model = make_model(kind)
    data = batches()
    mxd = randomise(MxD.for_model(model, 1, d_sae=24, k=4))
    tc = randomise(TopKTranscoder.for_model(model, 2, d_sae=24, k=4), seed=1)
    rows = {
        r["name"]: r for r in evaluate(model, {"mxd": mxd, "tc": tc}, data, together=True, progress=False)
    }

    clean = mean_loss(model, data)
    zero = mean_loss(model, data, [("blocks.1.hook_mlp_out", lambda out, hook: out * 0)])
    with mxd_lens.capture_mlp_io(model, [1]) as io:
        outs = [(model(t), io[1]["out"].clone())[1] for t in data]
    # The model prepends BOS (TransformerLens's default), so position 0 is left out of the statistics.
    assert model.cfg.default_prepend_bos
    mean_out = torch.cat([o[:, 1:].reshape(-1, o.shape[-1]) for o in outs]).mean(0)
    mean_abl = mean_loss(model, data, [("blocks.1.hook_mlp_out", lambda out, hook: mean_out.expand_as(out))])
    spliced, spliced_logp = hand_spliced(model, {1: mxd}, data)
    both, _ = hand_spliced(model, {1: mxd, 2: tc}, data)
    tc_alone, _ = hand_spliced(model, {2: tc}, data)
    clean_logp = [F.log_softmax(model(t)[:, :-1], -1) for t in data]
    kl = sum(
        float((c.exp() * (c - s)).sum().detach()) for c, s in zip(clean_logp, spliced_logp, strict=True)
    ) / (3 * 2 * 11)

    row = rows["mxd"]
    assert row["ce_clean"] == pytest.approx(clean, rel=1e-5)
    assert row["ce_zero_ablation"] == pytest.approx(zero, rel=1e-5)
    assert row["ce_mean_ablation"] == pytest.approx(mean_abl, rel=1e-5)
    assert row["ce_spliced"] == pytest.approx(spliced, rel=1e-5)
    assert row["delta_ce"] == pytest.approx(spliced - clean, abs=1e-5)
    assert row["kl"] == pytest.approx(kl, rel=1e-4)
    assert row["ce_recovered_zero"] == pytest.approx((zero - spliced) / (zero - clean), rel=1e-4)
    assert rows["together"]["ce_spliced"] == pytest.approx(both, rel=1e-5)
    assert rows["tc"]["ce_spliced"] == pytest.approx(tc_alone, rel=1e-5)  # run from its own block
    assert rows["tc"]["block"] == 2 and rows["together"]["block"] == "1,2"

    # FVU and L0 from the captured MLP input and output of every token.
    with mxd_lens.capture_mlp_io(model, [1]) as io:
        pairs = [(model(t), io[1]["in"].clone(), io[1]["out"].clone())[1:] for t in data]
    x = torch.cat([p[0][:, 1:].reshape(-1, 16) for p in pairs])
    y = torch.cat([p[1][:, 1:].reshape(-1, 16) for p in pairs])
    with torch.no_grad():
        fvu = float((mxd(x) - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        codes = mxd.encode(x)
    assert row["fvu"] == pytest.approx(fvu, rel=1e-4)
    assert row["explained_variance"] == pytest.approx(1 - fvu, rel=1e-4)
    assert row["l0"] == pytest.approx(float((codes > 0).sum(-1).float().mean()), rel=1e-6)
    assert row["dead_fraction"] == pytest.approx(float((codes.amax(0) == 0).float().mean()))
    assert len(pd.DataFrame(rows.values())) == 3


def test_without_baselines_the_other_numbers_are_the_same():
    model = make_model("gated")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4))
    (full,) = evaluate(model, [layer], batches(), progress=False)
    (bare,) = evaluate(model, [layer], batches(), baselines=False, progress=False)
    assert "ce_zero_ablation" not in bare and "ce_recovered_mean" not in bare
    assert {k: bare[k] for k in bare} == {k: full[k] for k in bare}


def test_the_mlp_itself_recovers_everything():
    model = make_model("gated")
    (row,) = evaluate(model, [MxD.from_mlp(model, 1)], batches(2), progress=False)
    assert abs(row["delta_ce"]) < 1e-5 and abs(row["kl"]) < 1e-6 and row["fvu"] < 1e-10
    assert row["ce_recovered_zero"] == pytest.approx(1.0, abs=1e-4) and row["l0"] == 1


def test_layers_from_another_model_are_refused():
    model = make_model("gpt2")
    other = TopKTranscoder.for_model(make_model("gated"), 1, d_sae=8, k=2)
    with pytest.raises(ValueError, match="trained on 'tiny-gated', but this model is 'tiny-gpt2'"):
        evaluate(model, [other], batches(1), progress=False)
    with pytest.raises(ValueError, match="no token batches"):
        evaluate(model, [TopKTranscoder.for_model(model, 1, d_sae=8, k=2)], [], progress=False)


def test_overlapping_evaluation_text_is_refused():
    train = {"text": "corpus/", "split": "train", "eval_fraction": 0.02, "split_seed": 0}
    check_disjoint(train, {**train, "split": "eval"})  # the held-out side of the same split
    check_disjoint(train, {"text": "other.txt", "split": "train"})  # other text
    for bad in (
        {**train},
        {**train, "split": "eval", "split_seed": 1},
        {**train, "split": "eval", "eval_fraction": 0.1},
    ):
        with pytest.raises(ValueError, match="overlaps the training text"):
            check_disjoint(train, bad)
    with pytest.warns(UserWarning, match="cannot be ruled out"):
        check_disjoint(None, {**train, "split": "eval"})


def _info(text, split="train", digests=True, **kw):
    info = {"text": str(text), "split": split, "eval_fraction": 0.02, "split_seed": 0, **kw}
    return {**info, "digests": data.source_digests(text)} if digests else info


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "paths-only"])
def test_the_same_file_spelled_another_way_is_refused(tmp_path, monkeypatch, digests):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("one document\n\nanother one\n")
    (tmp_path / "other.txt").write_text("something else entirely\n")
    monkeypatch.chdir(tmp_path)
    train = _info("corpus/a.txt", digests=digests)
    for same in (
        tmp_path / "corpus" / "a.txt",
        "./corpus/../corpus/a.txt",
        "corpus",
    ):  # absolute, odd, folder
        with pytest.raises(ValueError, match="overlaps the training text"):
            check_disjoint(train, _info(same, digests=digests))
    check_disjoint(train, _info(tmp_path / "other.txt", digests=digests))  # a different file
    check_disjoint(train, _info(tmp_path / "corpus" / "a.txt", "eval", digests=digests))  # held-out side


def test_a_byte_identical_copy_is_refused_and_messages_leave_digests_out(tmp_path):
    (tmp_path / "a.txt").write_text("one document\n\nanother one\n")
    (tmp_path / "renamed.txt").write_bytes((tmp_path / "a.txt").read_bytes())
    train = _info(tmp_path / "a.txt")
    with pytest.raises(
        ValueError, match=r"holds the same content as the training text \(renamed\.txt\)"
    ) as e:
        check_disjoint(train, _info(tmp_path / "renamed.txt"))
    assert "sha256" not in str(e.value)
    with pytest.raises(ValueError, match="overlaps the training text"):
        check_disjoint(train, _info(tmp_path / "renamed.txt", "eval", split_seed=1))  # another split
    check_disjoint(train, _info(tmp_path / "renamed.txt", "eval"))  # the held-out side of the same split
    (tmp_path / "a.txt").write_text("edited since training\n")  # same path, other content: allowed, loudly
    with pytest.warns(UserWarning, match="other content"):
        check_disjoint(train, _info(tmp_path / "a.txt"))


def test_standard_errors_are_those_of_the_per_batch_values():
    """delta_ce_se / kl_se from one evaluation == sd / sqrt(n) of each batch evaluated alone."""
    import math

    model = make_model("gated")
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=16, k=3), 0, scale=0.3)
    batches = [
        torch.randint(0, D_VOCAB, (3, 10), generator=torch.Generator().manual_seed(i)) for i in range(5)
    ]
    (row,) = evaluate(model, [layer], batches, baselines=False, jacobian_tokens=0, progress=False)
    alone = [
        evaluate(model, [layer], [b], baselines=False, jacobian_tokens=0, progress=False)[0] for b in batches
    ]
    for key, se in (("delta_ce", "delta_ce_se"), ("kl", "kl_se")):
        values = [r[key] for r in alone]
        mean = sum(values) / 5
        assert row[key] == pytest.approx(mean, rel=1e-5, abs=1e-7)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
        assert row[se] == pytest.approx(sd / math.sqrt(5), rel=1e-4, abs=1e-9)
    (one,) = evaluate(model, [layer], batches[:1], baselines=False, jacobian_tokens=0, progress=False)
    assert math.isnan(one["delta_ce_se"])
    # the row of layers spliced together has its standard errors too
    second = randomise(TopKTranscoder.for_model(model, 0, d_sae=16, k=3), 1, scale=0.3)
    kw = dict(together=True, baselines=False, jacobian_tokens=0, progress=False)
    both = evaluate(model, [second, layer], batches, **kw)[-1]
    alone = [evaluate(model, [second, layer], [b], **kw)[-1] for b in batches]
    for key, se in (("delta_ce", "delta_ce_se"), ("kl", "kl_se")):
        values = [r[key] for r in alone]
        mean = sum(values) / 5
        assert both[key] == pytest.approx(mean, rel=1e-5, abs=1e-7)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
        assert both[se] == pytest.approx(sd / math.sqrt(5), rel=1e-4, abs=1e-9) and both[se] > 0


def test_each_evaluation_text_keeps_its_own_record(tmp_path, capsys, monkeypatch):
    import json

    from conftest import make_text_model

    import mxd_lens.models
    from mxd_lens.cli import main

    model, corpus = make_text_model(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(corpus.read_text().split("\n\n")[::-1]))  # same words, other documents
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=16, k=3), 0, scale=0.3)
    layer.save_model(tmp_path / "L1")
    common = ["eval", str(tmp_path / "L1"), "--model", "m", "--context-size", "12", "--split", "all"]
    with pytest.warns(UserWarning, match="records no training text"):
        assert main([*common, "--text", str(corpus), "--eval-tokens", "120"]) == 0
        assert main([*common, "--text", str(other), "--eval-tokens", "120"]) == 0
        assert main([*common, "--text", str(corpus), "--eval-tokens", "240"]) == 0
        assert main([*common, "--text", str(corpus), "--eval-tokens", "120"]) == 0  # replaces the first
    printed = capsys.readouterr().out
    with pytest.warns(UserWarning, match="records no training text"):  # positions left out: another record
        assert main([*common, "--text", str(corpus), "--eval-tokens", "120", "--skip-positions", "3"]) == 0
    assert "the first 3 positions of every row left out" in capsys.readouterr().out
    meta = json.loads((tmp_path / "L1" / "cfg.json").read_text())["metadata"]
    seen = [(r["text"]["text"], r["tokens"], r["skip_positions"]) for r in meta["evaluations"]]
    assert seen == [(str(other), 110, 0), (str(corpus), 220, 0), (str(corpus), 110, 0), (str(corpus), 80, 3)]
    assert meta["evaluation"] == meta["evaluations"][-1]
    assert "silent on 110 tokens" in printed and "ΔCE ± se" in printed and "zero-ablation ΔCE" in printed
    assert "clean CE" in printed
    capsys.readouterr()
    assert main(["info", str(tmp_path / "L1")]) == 0
    shown = capsys.readouterr().out
    assert "evaluation 1 on" in shown and "evaluation 3 on" in shown and "eval 2: delta_ce" in shown


@pytest.mark.parametrize("first", [0, 1, 4])
def test_skipped_positions_leave_exactly_those_predictions_and_activations_out(first):
    """skip_positions = N: CE and KL over the predictions at positions N.. (of tokens N+1..), FVU and L0
    over the activations at positions max(N, 1).. (BOS), each against a hand computation on the same
    batches; the counted tokens change by exactly the positions left out."""
    model = make_model("gpt2")
    data = batches()
    tc = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=3)
    (row,) = evaluate(model, {"tc": tc}, data, skip_positions=first, baselines=False, progress=False)
    _, spliced_logp = hand_spliced(model, {1: tc}, data)
    with torch.no_grad():
        clean_logp = [F.log_softmax(model(t)[:, :-1], -1) for t in data]
    targets = [t[:, 1:] for t in data]

    def ce(logps):
        pairs = zip(logps, targets, strict=True)
        return sum(float(-lp[:, first:].gather(-1, t[:, first:, None]).sum()) for lp, t in pairs)

    n = sum(t[:, first:].numel() for t in targets)
    assert row["tokens"] == n == 3 * 2 * (11 - first)  # 3 batches of 2 rows of 12 tokens
    assert row["ce_clean"] == pytest.approx(ce(clean_logp) / n, rel=1e-5)
    assert row["delta_ce"] == pytest.approx((ce(spliced_logp) - ce(clean_logp)) / n, abs=1e-5)
    kl = (
        sum(
            float((c.exp() * (c - s))[:, first:].sum()) for c, s in zip(clean_logp, spliced_logp, strict=True)
        )
        / n
    )
    assert row["kl"] == pytest.approx(kl, rel=1e-4) and row["skip_positions"] == first
    with mxd_lens.capture_mlp_io(model, [1]) as io:
        pairs = [(model(t), io[1]["in"].clone(), io[1]["out"].clone())[1:] for t in data]
    kept = max(first, 1)
    x = torch.cat([p[0][:, kept:].reshape(-1, 16) for p in pairs])
    y = torch.cat([p[1][:, kept:].reshape(-1, 16) for p in pairs])
    with torch.no_grad():
        assert row["fvu"] == pytest.approx(
            float((tc(x) - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()), rel=1e-4
        )
        assert row["l0"] == pytest.approx(float((tc.encode(x) != 0).sum(-1).float().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="skip_positions=11 leaves no prediction"):
        evaluate(model, {"tc": tc}, data, skip_positions=11, progress=False)
    with pytest.raises(ValueError, match="give a number of positions"):
        evaluate(model, {"tc": tc}, data, skip_positions=-1, progress=False)

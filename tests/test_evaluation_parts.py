"""Each part of ``evaluate`` (mxd_lens.evaluation: the spliced CE/KL, the output moments, reconstruction,
usage of units, the Jacobian cosine) against a reference written out by hand on small tensors."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import D_VOCAB, make_model, randomise

from mxd_lens import TopKTranscoder, evaluation, hooks
from mxd_lens.evaluation import (
    _Batch,
    _JacobianCos,
    _LayerRun,
    _OutputMoments,
    _Plan,
    _Reconstruction,
    _Spliced,
    _Usage,
    evaluate,
)


def _run(x, y, out, values, indices, skip, rep=None):
    return _LayerRun(rep, x, y, out, values, indices, skip)


def _codes(shape, d_sae, seed):
    """Signed codes [B, T, K] with some exact zeros (a unit chosen but silent), distinct units per token."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    values = torch.randn(shape, generator=g)
    values[torch.rand(shape, generator=g) < 0.3] = 0.0
    values[0, -1] = 0.0  # one token with no active code at all
    units = [torch.randperm(d_sae, generator=g)[:k] for _ in range(math.prod(lead))]
    return values, torch.stack(units).reshape(shape)


def test_output_moments_give_the_mean_and_the_total_sum_of_squares():
    g = torch.Generator().manual_seed(0)
    skip, targets = 1, [(0, "module_out"), (0, "out"), (2, "out")]
    ios = [
        {b: {key: torch.randn(2, 5, 3, generator=g) for key in ("out", "module_out")} for b in (0, 2)}
        for _ in range(3)
    ]
    moments = _OutputMoments(targets, skip)
    for io in ios:
        moments.update(io)
    assert moments.n == 3 * 2 * 4
    for block, key in targets:
        y = torch.cat([io[block][key][:, skip:].reshape(-1, 3) for io in ios]).double()
        sst = float(((y - y.mean(0)) ** 2).sum())
        assert moments.sst((block, key)) == pytest.approx(sst, rel=1e-10)
        if key == "out":
            torch.testing.assert_close(moments.mean(block), y.mean(0).float())


def test_reconstruction_is_the_fvu_formula_and_top1_keeps_the_largest_code_alone():
    g = torch.Generator().manual_seed(1)
    d, d_sae, skip = 3, 6, 1
    w = torch.randn(d_sae, d, generator=g)
    rep = SimpleNamespace(
        output_from_codes=lambda x, v, i: (v[..., None] * w[i]).sum(-2) + 0.5 * x,
    )
    runs, kept = [], []
    for seed in range(2):
        x, y, out = (torch.randn(2, 4, d, generator=g) for _ in range(3))
        values, indices = _codes((2, 4, 3), d_sae, seed)
        runs.append(_run(x, y, out, values, indices, skip, rep))
        kept.append((x[:, skip:], y[:, skip:], out[:, skip:], values[:, skip:], indices[:, skip:]))
    part = _Reconstruction()
    for run in runs:
        part.update(run)

    sse = sse_top1 = 0.0
    ys = []
    for x, y, out, values, indices in kept:
        for b in range(y.shape[0]):
            for t in range(y.shape[1]):
                sse += sum(float(e) ** 2 for e in out[b, t] - y[b, t])
                j = max(range(values.shape[-1]), key=lambda j: abs(float(values[b, t, j])))
                top1 = values[b, t, j] * w[indices[b, t, j]] + 0.5 * x[b, t]
                sse_top1 += sum(float(e) ** 2 for e in top1 - y[b, t])
                ys.append(y[b, t].double())
    ys = torch.stack(ys)
    sst = float(((ys - ys.mean(0)) ** 2).sum())
    result = part.result(sst)
    assert result["fvu"] == pytest.approx(sse / sst, rel=1e-6)
    assert result["top1_fvu"] == pytest.approx(sse_top1 / sst, rel=1e-6)
    assert result["explained_variance"] == pytest.approx(1 - sse / sst, rel=1e-6)

    none = _Reconstruction()  # a layer that cannot rebuild its output from chosen codes
    none.update(_run(*runs[0].kept()[:5], 0, SimpleNamespace(output_from_codes=lambda *a: None)))
    assert math.isnan(none.result(sst)["top1_fvu"])


def test_usage_counts_active_codes_units_and_effective_units_by_hand():
    d_sae, skip = 40, 2
    runs = []
    for seed in range(2):
        values, indices = _codes((3, 5, 4), d_sae, seed)
        # unit 7 first on every token (swapped there), active on all but the silent ones: always on
        indices = torch.where(indices == 7, indices[..., :1].expand_as(indices), indices)
        indices[..., 0] = 7
        values[..., 0] = torch.where(values[..., 0] == 0, 1.5, values[..., 0])
        values[0, -1] = 0.0
        unused = torch.zeros(3, 5, 2)  # x, y, out: not read
        runs.append(_run(unused, unused, unused, values, indices, skip))
    part = _Usage(d_sae)
    for run in runs:
        part.update(run)

    tokens, per_unit = [], [0] * d_sae
    for run in runs:
        values, indices = run.values[:, skip:], run.indices[:, skip:]
        for b in range(values.shape[0]):
            for t in range(values.shape[1]):
                codes = [(int(i), float(v)) for v, i in zip(values[b, t], indices[b, t], strict=True)]
                tokens.append(codes)
                for i, v in codes:
                    per_unit[i] += v != 0
    n = len(tokens)
    assert n == 2 * 3 * 3

    def effective(codes):
        weights = [abs(v) for _, v in codes if v != 0]
        if not weights:
            return 0.0
        p = [w / sum(weights) for w in weights]
        return math.exp(-sum(q * math.log(q) for q in p))

    result = part.result()
    assert result["l0"] == pytest.approx(sum(sum(v != 0 for _, v in c) for c in tokens) / n)
    assert result["l0_positive"] == pytest.approx(sum(sum(v > 0 for _, v in c) for c in tokens) / n)
    assert result["effective_units"] == pytest.approx(sum(map(effective, tokens)) / n, rel=1e-9)
    assert result["always_on"] == sum(count > n / 2 for count in per_unit)
    assert result["dead_fraction"] == pytest.approx(sum(count == 0 for count in per_unit) / d_sae)
    assert result["always_on"] >= 1 and 0 < result["dead_fraction"] < 1  # both cases are exercised


def test_spliced_ce_kl_ablations_and_standard_errors_match_torch(monkeypatch):
    """_Spliced's bookkeeping with the forwards replaced by given logits: CE by F.cross_entropy, KL by
    F.kl_div on the same logits, CE recovered and the standard errors by their formulas."""
    vocab, first, n_batches = 7, 1, 3
    g = torch.Generator().manual_seed(2)
    data = [
        {
            "tokens": torch.randint(0, vocab, (2, 6), generator=g),
            **{kind: torch.randn(2, 6, vocab, generator=g) for kind in ("clean", "splice", "zero", "mean")},
        }
        for _ in range(n_batches)
    ]
    given = iter([d[kind] for d in data for kind in ("splice", "zero")] + [d["mean"] for d in data])
    monkeypatch.setattr(evaluation, "_run_from", lambda *args, **kwargs: next(given))

    model = SimpleNamespace(cfg=SimpleNamespace(device="cpu"))
    spliced = _Spliced(model, blocks=[1], first=first, keep={1: 0})
    run = SimpleNamespace(block=1, out=None, rep=SimpleNamespace(writes="hook_mlp_out", first=0))
    for d in data:
        clean = d["clean"][:, first:-1]
        batch = _Batch(
            io={1: {"out": torch.zeros(2, 6, 4)}},
            resid={1: torch.zeros(2, 6, 4)},
            target=d["tokens"][:, first + 1 :],
            clean=(clean, torch.logsumexp(clean, -1)),
        )
        spliced.clean(batch)
        spliced.splice("a", run, batch)
        spliced.zero_ablation(batch)
    spliced.mean_ablation({1: torch.zeros(4)})

    def ce(logits, tokens):
        z = logits[:, first:-1]
        return float(
            F.cross_entropy(z.reshape(-1, vocab), tokens[:, first + 1 :].reshape(-1), reduction="sum")
        )

    def kl(clean, other):
        lp, lq = (F.log_softmax(z[:, first:-1], -1) for z in (clean, other))
        return float(F.kl_div(lq, lp, log_target=True, reduction="sum"))

    per = 2 * (6 - 1 - first)
    n = n_batches * per
    sums = {k: sum(ce(d[k], d["tokens"]) for d in data) / n for k in ("clean", "splice", "zero", "mean")}
    row = spliced.columns("splice:a", [1], baselines=True)
    assert row["tokens"] == n
    assert row["ce_clean"] == pytest.approx(sums["clean"], rel=1e-5)
    assert row["ce_spliced"] == pytest.approx(sums["splice"], rel=1e-5)
    assert row["delta_ce"] == pytest.approx(sums["splice"] - sums["clean"], rel=1e-4, abs=1e-6)
    assert row["kl"] == pytest.approx(sum(kl(d["clean"], d["splice"]) for d in data) / n, rel=1e-5)
    for kind in ("zero", "mean"):
        assert row[f"ce_{kind}_ablation"] == pytest.approx(sums[kind], rel=1e-5)
        recovered = (sums[kind] - sums["splice"]) / (sums[kind] - sums["clean"])
        assert row[f"ce_recovered_{kind}"] == pytest.approx(recovered, rel=1e-4)
    assert "ce_zero_ablation" not in spliced.columns("splice:a", [1], baselines=False)

    delta = [(ce(d["splice"], d["tokens"]) - ce(d["clean"], d["tokens"])) / per for d in data]
    kls = [kl(d["clean"], d["splice"]) / per for d in data]
    se = spliced.standard_errors("a")
    assert se["delta_ce_se"] == pytest.approx(statistics.stdev(delta) / math.sqrt(n_batches), rel=1e-4)
    assert se["kl_se"] == pytest.approx(statistics.stdev(kls) / math.sqrt(n_batches), rel=1e-4)


def test_jacobian_cosine_is_that_of_the_full_jacobians_over_the_first_tokens():
    model = make_model("gpt2")
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=5)
    rep = hooks.replacement(layer)
    g = torch.Generator().manual_seed(3)
    part = _JacobianCos(model, tokens=7, directions=None, generator=torch.Generator().manual_seed(0))
    xs = []
    for _ in range(2):  # 2 x 4 counted tokens per batch: the first batch gives 4, the second 3
        with hooks.capture_mlp_io(model, [1]) as io, torch.no_grad():
            model(torch.randint(0, D_VOCAB, (2, 3), generator=g))
        run = _LayerRun.of(rep, io, skip=1)
        xs.append(io[1]["in"][:, 1:].reshape(-1, 16))
        part.update(run)
    assert [t.numel() for t in part.cos] == [4, 3]

    mlp = model.blocks[1].mlp
    cos = []
    for x in torch.cat(xs)[:7]:
        jf = torch.autograd.functional.jacobian(lambda v: layer(v[None])[0], x).double()
        jg = torch.autograd.functional.jacobian(lambda v: mlp(v[None, None])[0, 0], x).double()
        cos.append(float((jf * jg).sum() / (jf.norm() * jg.norm())))
    assert part.result()["jacobian_cos"] == pytest.approx(sum(cos) / 7, rel=1e-5)
    assert _JacobianCos(model, 0, None, g).result() == {"jacobian_cos": None}


def test_the_plan_counts_positions_and_names_every_target():
    model = make_model("gpt2")  # prepends BOS
    a = TopKTranscoder.for_model(model, 2, d_sae=8, k=2)
    b = TopKTranscoder.for_model(model, 1, d_sae=8, k=2, writes="mlp")
    reps = {"a": hooks.replacement(a), "b": hooks.replacement(b)}
    plan = _Plan.of(model, reps, None, 0)
    assert (plan.blocks, plan.module_out, plan.resid) == ([1, 2], [1], [])
    assert plan.targets == [(1, "module_out"), (1, "out"), (2, "out")]
    assert (plan.first, plan.skip) == (0, 1)
    assert (_Plan.of(model, reps, None, 3).skip, _Plan.of(model, reps, False, 0).skip) == (3, 0)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="give a number of positions"):
            _Plan.of(model, reps, None, bad)


def test_rows_keep_their_columns_in_order():
    model = make_model("gpt2")
    a = randomise(TopKTranscoder.for_model(model, 1, d_sae=8, k=2))
    b = randomise(TopKTranscoder.for_model(model, 2, d_sae=8, k=2), seed=1)
    tokens = [torch.randint(0, D_VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))]
    rows = evaluate(model, {"a": a, "b": b}, tokens, together=True, jacobian_tokens=0, progress=False)
    ce = ["ce_clean", "ce_spliced", "delta_ce", "kl", "tokens"]
    layer = ["name", "architecture", "block", "k", "d_sae", "params", *ce, "ce_zero_ablation",
             "ce_recovered_zero", "ce_mean_ablation", "ce_recovered_mean", "fvu", "l0", "l0_positive",
             "always_on", "effective_units", "top1_fvu", "dead_fraction", "train_dead_fraction",
             "jacobian_cos", "delta_ce_se", "kl_se", "explained_variance", "skip_positions", "spliced_from"]  # fmt: skip
    assert [list(r) for r in rows[:2]] == [layer, layer]
    assert list(rows[2]) == [
        "name",
        "architecture",
        "block",
        "k",
        "d_sae",
        "params",
        *ce,
        "delta_ce_se",
        "kl_se",
        "skip_positions",
        "spliced_from",
    ]
    assert (rows[2]["architecture"], rows[2]["block"]) == ("a+b", "1,2")

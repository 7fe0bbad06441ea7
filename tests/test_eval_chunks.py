"""The vocabulary-sized work of ``evaluate`` (CE, KL, the ablations' CE) is done in blocks of tokens
(issue 30); whatever the block size, its numbers are the dense formulas over whole batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import D_VOCAB, make_model, randomise

import mxd_lens
from mxd_lens import TopKTranscoder, evaluation
from mxd_lens.evaluation import _token_chunks, evaluate

ROWS, CONTEXT = 3, 12  # 11 predictions per row


def batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, D_VOCAB, (ROWS, CONTEXT), generator=g) for _ in range(n)]


@pytest.mark.parametrize(
    ("n_batch", "n_pos", "vocab", "budget"),
    [(3, 11, 61, 61 * 4), (3, 11, 61, 61 * 25), (3, 11, 61, 10), (2, 5, 7, 10**6), (1, 1, 262_144, 1 << 22)],
)
def test_chunks_cover_every_token_once_within_the_budget(n_batch, n_pos, vocab, budget):
    seen = torch.zeros(n_batch, n_pos, dtype=torch.long)
    for rows, pos in _token_chunks(n_batch, n_pos, vocab, budget):
        seen[rows, pos] += 1
        assert seen[rows, pos].numel() * vocab <= max(budget, vocab)  # at least one token per block
    assert bool((seen == 1).all())


def dense(model, layer, block, data, first):
    """CE sums of clean, spliced, zero- and mean-ablated forwards and KL(clean ‖ spliced), each over the
    predictions at positions ``first``.., from whole-batch log-softmax (no mxd_lens code)."""
    out_hook, skip = f"blocks.{block}.hook_mlp_out", max(first, 1)  # the model prepends BOS
    slot = {}
    handle = model.blocks[block].mlp.register_forward_pre_hook(lambda m, args: slot.update(x=args[0]))
    outs = []
    try:
        with torch.no_grad():
            runs = {"clean": [], "spliced": [], "zero": []}
            for t in data:
                runs["clean"].append(
                    model.run_with_hooks(t, fwd_hooks=[(out_hook, lambda o, hook: outs.append(o.clone()))])
                )
                runs["spliced"].append(
                    model.run_with_hooks(t, fwd_hooks=[(out_hook, lambda o, hook: layer(slot["x"]))])
                )
                runs["zero"].append(model.run_with_hooks(t, fwd_hooks=[(out_hook, lambda o, hook: o * 0)]))
            mean = torch.cat([o[:, skip:].reshape(-1, o.shape[-1]) for o in outs]).double().mean(0).float()
            runs["mean"] = [
                model.run_with_hooks(t, fwd_hooks=[(out_hook, lambda o, hook: mean.expand_as(o))])
                for t in data
            ]
    finally:
        handle.remove()
    logp = {k: [torch.log_softmax(z[:, first:-1], -1) for z in v] for k, v in runs.items()}
    targets = [t[:, first + 1 :] for t in data]
    sums = {
        k: sum(float(-lp.gather(-1, t[..., None]).sum()) for lp, t in zip(v, targets, strict=True))
        for k, v in logp.items()
    }
    sums["kl"] = sum(
        float(F.kl_div(s, c, log_target=True, reduction="sum"))
        for c, s in zip(logp["clean"], logp["spliced"], strict=True)
    )
    return sums, sum(t.numel() for t in targets)


@pytest.mark.parametrize("first", [0, 2])
def test_chunked_numbers_equal_the_dense_formulas(monkeypatch, first):
    """Blocks of one token, of 4 tokens (11 = 4 + 4 + 3: a ragged last block per row), of whole rows (2 of
    3 rows, then 1) and the default (everything at once): the same CE, KL and ablated CE as whole-batch
    log-softmax, and the same tokens counted with ``skip_positions``."""
    model = make_model("gpt2")
    data = batches()
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=2)
    want, n = dense(model, layer, 1, data, first)
    assert n == len(data) * ROWS * (CONTEXT - 1 - first)

    made = []
    chunks = evaluation._token_chunks

    def spy(*args, **kwargs):
        made.append(chunks(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(evaluation, "_token_chunks", spy)
    rows = {}
    for budget in (D_VOCAB, 4 * D_VOCAB, 2 * (CONTEXT - 1 - first) * D_VOCAB, evaluation._CHUNK_ELEMENTS):
        monkeypatch.setattr(evaluation, "_CHUNK_ELEMENTS", budget)
        made.clear()
        (row,) = evaluate(model, {"tc": layer}, data, skip_positions=first, progress=False)
        rows[budget] = row
        sizes = {tuple(s[1].stop - s[1].start for s in c) for c in made}
        if budget == 4 * D_VOCAB:  # several blocks per row, the last one ragged
            assert sizes == {(4, 4, 3 - first) * ROWS}
        assert row["tokens"] == n
        assert row["ce_clean"] == pytest.approx(want["clean"] / n, rel=1e-6)
        assert row["ce_spliced"] == pytest.approx(want["spliced"] / n, rel=1e-6)
        assert row["ce_zero_ablation"] == pytest.approx(want["zero"] / n, rel=1e-6)
        assert row["ce_mean_ablation"] == pytest.approx(want["mean"] / n, rel=1e-5)
        assert row["kl"] == pytest.approx(want["kl"] / n, rel=1e-5, abs=1e-9)
        assert row["delta_ce"] == pytest.approx((want["spliced"] - want["clean"]) / n, abs=1e-6)
    assert len({len(c) for c in made}) == 1  # the default: one block per batch
    for row in rows.values():
        for key in ("ce_clean", "ce_spliced", "kl", "ce_zero_ablation", "ce_mean_ablation", "fvu"):
            assert row[key] == pytest.approx(rows[D_VOCAB][key], rel=1e-6, abs=1e-9)


def test_a_vocabulary_larger_than_the_budget_still_goes_one_token_at_a_time(monkeypatch):
    model = make_model("gated")
    data = batches(1)
    layer = randomise(mxd_lens.MxD.for_model(model, 0, d_sae=24, k=4))
    (whole,) = evaluate(model, [layer], data, progress=False)
    monkeypatch.setattr(evaluation, "_CHUNK_ELEMENTS", D_VOCAB // 2)
    (tokenwise,) = evaluate(model, [layer], data, progress=False)
    for key in ("ce_clean", "ce_spliced", "kl", "ce_zero_ablation", "ce_mean_ablation"):
        assert tokenwise[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-9)

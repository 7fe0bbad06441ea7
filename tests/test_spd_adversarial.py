"""Adversarial (PGD) masks for a decomposition (mxd_lens.spd.adversarial): they stay in the range the
CI allows, they find masks worse than random ones, and where the CI allows nothing they change nothing."""

from __future__ import annotations

import pytest
import torch
from test_spd import _induction_like_model

from mxd_lens.spd import Decomposition
from mxd_lens.spd.adversarial import adversarial_metrics, pgd_masks
from mxd_lens.spd.losses import kl_divergence
from mxd_lens.spd.sites import decomposable_weights


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = _induction_like_model()
    decomposition = Decomposition(model, decomposable_weights(model), C=6)
    with torch.no_grad():  # a CI that lets some components be ablated and keeps others
        for p in decomposition.ci.parameters():
            p.normal_(0, 0.5)
    tokens = torch.randint(0, 20, (6, 16), generator=torch.Generator().manual_seed(3))
    target, inputs = decomposition.run_clean(model, tokens)
    g = {name: gi.detach() for name, (gi, _) in decomposition.ci_from_inputs(inputs).items()}
    return decomposition, tokens, target, g


def masked_kl(decomposition, tokens, target, masks, delta):
    with torch.no_grad(), decomposition.patched(masks, delta):
        return float(kl_divergence(target, decomposition.model(tokens)))


def test_pgd_masks_stay_in_range_and_beat_random_masks(setup):
    decomposition, tokens, target, g = setup
    assert 0 < sum(float(((gi > 0) & (gi < 1)).float().mean()) for gi in g.values())  # room to move
    masks, delta = pgd_masks(decomposition, tokens, g, target, n_steps=15, step_size=0.1,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
    for name in decomposition.names:
        assert (masks[name] >= g[name] - 1e-6).all() and (masks[name] <= 1 + 1e-6).all()
        assert (delta[name] >= 0).all() and (delta[name] <= 1).all()
    adversarial = masked_kl(decomposition, tokens, target, masks, delta)
    gen = torch.Generator().manual_seed(1)
    random = [
        masked_kl(decomposition, tokens, target,
                  {n: gi + (1 - gi) * torch.rand(gi.shape, generator=gen) for n, gi in g.items()},
                  {n: torch.rand(gi.shape[:-1], generator=gen) for n, gi in g.items()})
        for _ in range(20)
    ]  # fmt: skip
    assert adversarial > max(random)
    # zero steps leave the start: all-ones sources are the unmasked model (m = 1, m_delta = 1)
    ones, ones_delta = pgd_masks(decomposition, tokens, g, target, n_steps=0, init="ones")
    assert all(torch.equal(m, torch.ones_like(m)) for m in ones.values())


def test_where_the_ci_allows_nothing_the_adversary_changes_nothing(setup):
    decomposition, tokens, target, g = setup
    full = {name: torch.ones_like(gi) for name, gi in g.items()}  # g = 1: m = 1 whatever the source
    decomposition.delta = False  # and no delta term to play with
    masks, delta = pgd_masks(decomposition, tokens, full, target, n_steps=5)
    assert all(torch.equal(m, torch.ones_like(m)) for m in masks.values())
    assert masked_kl(decomposition, tokens, target, masks, delta) == pytest.approx(
        masked_kl(decomposition, tokens, target, full, None), abs=1e-7
    )


def test_adversarial_metrics_report_every_kind_and_module(setup):
    decomposition, tokens, _, _ = setup
    labels = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(4))
    report = adversarial_metrics(decomposition, tokens, labels, n_steps=5, chunk=4)
    assert report["pgd"]["n_steps"] == 5
    for kind in ("stochastic", "adversarial", "ci_masked"):
        assert set(report[kind]["per_module"]) == set(decomposition.names)
        assert 0 <= report[kind]["all"]["accuracy"] <= 1
    assert report["adversarial"]["all"]["kl_all"] > report["stochastic"]["all"]["kl_all"]
    with pytest.raises(ValueError, match="init='best'"):
        pgd_masks(decomposition, tokens, {}, tokens, init="best")

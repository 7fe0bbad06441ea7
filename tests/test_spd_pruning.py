"""What switching components off would cost (mxd_lens.spd.pruning), against independent computations:
contributions against the dense product x V U, the minimality change against its closed form, and a
component that contributes nothing costing no reconstruction at all."""

from __future__ import annotations

import pytest
import torch
from test_spd import _config, _induction_like_model

from mxd_lens.spd import Decomposition
from mxd_lens.spd.pruning import contributions, pruning_cost, pruning_table, training_objective
from mxd_lens.spd.sites import decomposable_weights

NAME = "blocks.0.attn.W_K"


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = _induction_like_model()
    decomposition = Decomposition(model, decomposable_weights(model), C=6, ci="token")
    with torch.no_grad():  # a CI with components on and off, some above 1 (z > 1)
        for p in decomposition.ci.parameters():
            p.normal_(0, 1.0)
    tokens = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(3))
    where = tokens == tokens[0, 5]
    config = _config(C=6, ci="token", subset_recon=1.0, minimality=1e-2, p_start=0.5, p_end=0.5)
    return decomposition, tokens, where, config


def _rows(decomposition, tokens, where):
    part = decomposition._components(NAME)
    _, inputs = decomposition.run_clean(decomposition.model, tokens)
    g, g_upper = decomposition.ci_from_inputs(inputs)[NAME]
    return part, inputs[NAME][where], g[where], g_upper[where]


def test_contributions_match_a_loop_over_positions(setup):
    decomposition, tokens, where, _ = setup
    info = contributions(decomposition, tokens, NAME, where, threshold=0.1)
    part, x, g, _ = _rows(decomposition, tokens, where)
    n = len(x)
    assert info["n_positions"] == n == int(where.sum()) and n >= 2
    ratios, counts = [], []
    for i in range(n):  # brute force, one position and one component at a time
        on = [c for c in range(decomposition.C) if g[i, c] > 0.1]
        pieces = [float(x[i] @ part.V[:, c]) * part.U[c] for c in on]
        counts.append(len(on))
        if on:
            ratios.append(sum(piece.norm() for piece in pieces) / torch.stack(pieces).sum(0).norm())
    assert info["n_active"] == pytest.approx(sum(counts) / n)
    assert info["cancellation"] == pytest.approx(float(sum(ratios) / len(ratios)), rel=1e-5)
    assert info["cancellation"] >= 1 - 1e-6
    listed = [row["component"] for row in info["components"]]
    assert sorted(listed) == [c for c in range(decomposition.C) if (g[:, c] > 0.1).any()]
    for row in info["components"]:
        c = row["component"]
        each = [float(torch.outer(x[i] @ part.V[:, c : c + 1], part.U[c]).norm()) for i in range(n)]
        assert row["contribution"] == pytest.approx(sum(each) / n, rel=1e-5)
        assert row["ci"] == pytest.approx(float(g[:, c].mean()), rel=1e-6)
        assert row["active"] == pytest.approx(float((g[:, c] > 0.1).float().mean()))
        assert row["z"] is None or row["z"] > 1
    means = [row["contribution"] for row in info["components"]]
    assert means == sorted(means, reverse=True)


def test_keeping_every_component_costs_nothing(setup):
    decomposition, tokens, where, config = setup
    out = pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[decomposition.C], draws=3)
    (row,) = out["keep"]
    assert row["recon_delta"] == 0 and row["minimality_delta"] == 0 and row["total_delta"] == 0


def test_pruning_matches_a_loop_that_keeps_each_positions_largest_contributor(setup):
    decomposition, tokens, where, config = setup
    out = pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[1], draws=3, seed=5)
    part, x, _, _ = _rows(decomposition, tokens, where)
    target, inputs = decomposition.run_clean(decomposition.model, tokens)
    ci = decomposition.ci_from_inputs(inputs)
    g, g_upper = (t.clone() for t in ci[NAME])
    for i, (b, q) in enumerate(where.nonzero().tolist()):  # drop all but the largest active piece
        on = [c for c in range(decomposition.C) if g[b, q, c] > 0.1]
        norms = {c: float((float(x[i] @ part.V[:, c]) * part.U[c]).norm()) for c in on}
        for c in sorted(on, key=norms.get, reverse=True)[1:]:
            g[b, q, c] = g_upper[b, q, c] = 0.0
    p = config.p_at(0)
    base = training_objective(decomposition, tokens, target, ci, config, p, [5, 6, 7])
    pruned = training_objective(
        decomposition, tokens, target, {**ci, NAME: (g, g_upper)}, config, p, [5, 6, 7]
    )
    (row,) = out["keep"]
    assert row["recon_delta"] == pytest.approx(float((pruned[0] - base[0]).mean()), rel=1e-6, abs=1e-12)
    assert row["minimality_delta"] == pytest.approx(float(pruned[1] - base[1]), rel=1e-6)
    assert row["recon_delta"] != 0  # the dropped components contribute: masking them changes the loss


def test_minimality_change_has_its_closed_form_and_silent_components_cost_no_reconstruction(setup):
    decomposition, tokens, where, config = setup
    _, _, g, g_upper = _rows(decomposition, tokens, where)
    with torch.no_grad():
        decomposition._components(NAME).U.zero_()  # nothing contributes: no mask can change any output
    out = pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[0], draws=3)
    (row,) = out["keep"]
    assert row["recon_delta"] == 0 and row["recon_delta_se"] == 0
    # closed form: coefficient × Σ over the dropped (all active) CIs of (g_u + ε)^p − ε^p, over all
    # batch × positions (the minimality loss is a mean over positions)
    p, eps, on = config.p_at(0), 1e-12, g > 0.1
    saved = (((g_upper + eps) ** p - eps**p) * on).sum() / where.numel()
    assert float(saved) > 0
    assert row["minimality_delta"] == pytest.approx(-config.minimality * float(saved), rel=1e-4)
    assert row["total_delta"] == pytest.approx(row["minimality_delta"], rel=1e-9)


def test_table_names_modules_and_positions(setup):
    decomposition, tokens, where, config = setup
    out = pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[2, 0], draws=2)
    table = pruning_table([{**out, "where": "token 7"}], label="where")
    assert "K0" in table and "token 7" in table and table.count("\n") == 3


def test_bad_input_is_refused_by_name(setup):
    decomposition, tokens, where, config = setup
    with pytest.raises(ValueError, match="bool mask"):
        pruning_cost(decomposition, tokens, config, 0, NAME, where.long(), keep=[1])
    with pytest.raises(ValueError, match="selects no position"):
        pruning_cost(decomposition, tokens, config, 0, NAME, torch.zeros_like(where), keep=[1])
    with pytest.raises(ValueError, match="each k must be an int"):
        pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[-1])
    with pytest.raises(ValueError, match="not decomposed here"):
        pruning_cost(decomposition, tokens, config, 0, "blocks.9.attn.W_K", where, keep=[1])
    with pytest.raises(ValueError, match="draws"):
        pruning_cost(decomposition, tokens, config, 0, NAME, where, keep=[1], draws=1)

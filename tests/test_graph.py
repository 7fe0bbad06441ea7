"""Attribution graphs through a layer at every block: each target's in-edges sum to its input, the logit
rows agree with the single-target attribution, the feature rows with the expert-to-expert edges, and
the scores with a dense (I - A)^-1 computation."""

from __future__ import annotations

import pytest
import torch
from conftest import D_VOCAB, make_model, randomise

import mxd_lens
from mxd_lens.attribution import attribute, edges
from mxd_lens.graph import build_graph, influence, normalized, prune, scores
from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder


def _layers(model, cls, first=1, **options):
    layers = []
    for block in range(model.cfg.n_layers):
        layer = randomise(cls.for_model(model, block, d_sae=24, k=4, **options), 10 + block, scale=0.3)
        layer.cfg.metadata.seqpos_slice = [first, None]
        layers.append(layer)
    return layers


TOKENS = torch.randint(0, D_VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["gpt2", "gated", "parallel"])
@pytest.mark.parametrize("cls", [MxD, TopKTranscoder, TopKSkipTranscoder])
def test_every_target_is_the_sum_of_its_in_edges_and_bias(kind, cls):
    model = make_model(kind)
    graph = build_graph(model, _layers(model, cls), TOKENS)
    assert graph.n_features == model.cfg.n_layers * (TOKENS.shape[1] - 1) * 4  # K units, BOS left out
    assert graph.completeness_errors().max() <= 1e-4
    # no edge runs backwards: a block's units read nothing from its own or later blocks' nodes
    blocks = torch.tensor(graph.features["block"].to_list())
    feat = graph.adjacency[: graph.n_features, : graph.n_features]
    assert not feat[blocks[:, None] <= blocks[None, :]].any()


def test_logit_rows_agree_with_the_single_target_attribution():
    model = make_model("gated")
    layers = _layers(model, MxD)
    graph = build_graph(model, layers, TOKENS)
    for i, token in enumerate(graph.logit_tokens[:2]):
        row = graph.adjacency[graph.n_nodes - graph.n_logits + i]

        def demeaned(logits, token=token):
            last = logits[0, -1]
            return last[token] - last.mean()

        with mxd_lens.splice(model, *layers, error_term=True):
            ref = attribute(model, TOKENS, demeaned)
        assert ref.target == pytest.approx(float(graph.inputs[graph.n_nodes - graph.n_logits + i]), rel=1e-5)
        for _, unit in ref.units.iterrows():
            col = graph.features.index[
                (graph.features["block"] == unit.block)
                & (graph.features["position"] == unit.position)
                & (graph.features["unit"] == unit.unit)
            ]
            assert float(row[col[0]]) == pytest.approx(unit.attribution, rel=1e-4, abs=1e-6)
        embeds = ref.parts[ref.parts["kind"] == "embed"].sort_values("position")["attribution"].to_numpy()
        start = graph.n_features + graph.n_errors
        torch.testing.assert_close(
            row[start : start + graph.n_pos].double(), torch.tensor(embeds), rtol=1e-4, atol=1e-6
        )


def test_feature_rows_agree_with_the_expert_to_expert_edges():
    model = make_model("gpt2")
    layers = _layers(model, MxD)
    graph = build_graph(model, layers, TOKENS)
    with mxd_lens.splice(model, *layers, error_term=True):
        ref = edges(model, TOKENS, upstream=0, downstream=2, keep=1.0)
    f = graph.features
    index = {
        (b, t, u): i for i, (b, t, u) in enumerate(zip(f["block"], f["position"], f["unit"], strict=True))
    }
    assert len(ref) > 10
    for _, e in ref.iterrows():
        target = index[(2, int(e.down_position), int(e.down_unit))]
        source = index[(0, int(e.up_position), int(e.up_unit))]
        assert float(graph.adjacency[target, source]) == pytest.approx(e.weight, rel=1e-4, abs=1e-6)
        assert float(graph.inputs[target]) == pytest.approx(e.down_pre, rel=1e-5, abs=1e-6)


def test_scores_and_pruning_against_a_dense_influence():
    model = make_model("gated")
    graph = build_graph(model, _layers(model, TopKTranscoder), TOKENS)
    a = normalized(graph.adjacency).double()
    w = graph.logit_weights().double()
    dense = w @ (torch.linalg.inv(torch.eye(len(a), dtype=a.dtype) - a) - torch.eye(len(a), dtype=a.dtype))
    torch.testing.assert_close(
        influence(graph.adjacency, graph.logit_weights()).double(), dense, rtol=1e-4, atol=1e-8
    )
    s = scores(graph)
    e0, e1 = graph.n_features, graph.n_features + graph.n_errors
    token, err = dense[e1 : e1 + graph.n_pos].sum(), dense[e0:e1].sum()
    assert s["replacement"] == pytest.approx(float(token / (token + err)), rel=1e-4)
    assert 0 < s["completeness"] <= 1 and 0 < s["nodes_80"] <= e1
    kept = prune(graph, 0.8, 0.98)
    assert kept.nodes[-graph.n_pos - graph.n_logits :].all()  # tokens and logits stay
    assert not kept.edges[~kept.nodes].any() and not kept.edges[:, ~kept.nodes].any()
    # a graph whose layers are exact (error nodes all zero) is complete: every node explained by features
    exact = [MxD.from_mlp(model, b) for b in range(model.cfg.n_layers)]
    for layer in exact:
        layer.cfg.metadata.seqpos_slice = [None]
    whole = build_graph(model, exact, TOKENS)
    assert whole.n_features > 0
    errors = whole.adjacency[:, whole.n_features : whole.n_features + whole.n_errors]
    assert errors.abs().max() < 1e-4
    assert scores(whole)["replacement"] == pytest.approx(1.0, abs=1e-4)


def test_a_layer_whose_encoder_is_not_affine_is_refused_by_name(monkeypatch):
    """The backward starts at each layer's input seeded with its units' encoder columns, which holds only
    where the pre-activations are x W + b: a per-token normalisation before the encoder is refused."""
    model = make_model("gpt2")
    layers = _layers(model, TopKTranscoder)
    plain = layers[1].process_sae_in
    monkeypatch.setattr(layers[1], "process_sae_in", lambda x: plain(x) / x.norm(dim=-1, keepdim=True))
    with pytest.raises(ValueError, match=r"block 1: the layer's pre-activations are not affine in its input"):
        build_graph(model, layers, TOKENS)


def test_a_page_draws_the_strongest_kept_edges_up_to_its_cap():
    from mxd_lens.graph_files import edge_records, page_data

    model = make_model("gated")
    graph = build_graph(model, _layers(model, MxD), TOKENS)
    kept = prune(graph, 0.8, 0.98)
    every = edge_records(graph, kept)
    assert len(every) > 3
    data = page_data(graph, kept, max_edges=3)
    assert data["edges"] == every[:3] and data["edges_kept"] == len(every)
    strongest = sorted((abs(w) for *_, w in every), reverse=True)[:3]
    assert [abs(w) for *_, w in data["edges"]] == strongest
    # a node cap: the most influential feature and error nodes (smallest cumulative influence), every token
    # and logit, and only the edges among what is drawn
    inner = int(kept.nodes[: graph.n_features + graph.n_errors].sum())
    capped = page_data(graph, kept, max_nodes=2)
    assert capped["nodes_kept"] == inner > 2
    drawn = [n for n in capped["nodes"] if n["kind"] in ("feature", "error")]
    ranked = sorted(
        float(kept.cumulative[i]) for i in kept.nodes[: graph.n_features + graph.n_errors].nonzero().flatten()
    )
    assert sorted(n["influence"] for n in drawn) == ranked[:2]
    assert sum(n["kind"] in ("token", "logit") for n in capped["nodes"]) == graph.n_pos + graph.n_logits
    ids = {n["index"] for n in capped["nodes"]}
    assert capped["edges"] == [e for e in every if e[0] in ids and e[1] in ids]

"""Top-activating contexts against a brute-force ranking of densely encoded codes, and the HTML page."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import D_VOCAB, make_model, make_text_model, randomise

from mxd_lens import MxD, TopKTranscoder, capture_mlp_io
from mxd_lens.analysis.inspect import _batch_top, to_html, top_activations, top_activations_of_layers


def stream(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, D_VOCAB, shape, generator=g) for shape in shapes]


def brute_force(model, layer, batches, features, n, skip_bos):
    """Every code of every token from the full forward and the dense ``encode``, sorted by
    (|activation| descending, row, position); non-zero activations only."""
    entries = {f: [] for f in features}
    row0 = 0
    for tokens in batches:
        with torch.no_grad(), capture_mlp_io(model, [1]) as io:
            model(tokens)
            codes = layer.encode(io[1]["in"])
        for r in range(tokens.shape[0]):
            for p in range(int(skip_bos), tokens.shape[1]):
                for f in features:
                    if codes[r, p, f] != 0:
                        entries[f].append((-abs(float(codes[r, p, f])), row0 + r, p, float(codes[r, p, f])))
        row0 += tokens.shape[0]
    return {f: sorted(e)[:n] for f, e in entries.items()}


@pytest.mark.parametrize("kind", ["gpt2", "parallel"])
@pytest.mark.parametrize("arch", [MxD, TopKTranscoder, "mxd_signed"])
@pytest.mark.parametrize("n, skip_bos", [(5, True), (40, True), (200, False)])
def test_streaming_top_n_equals_brute_force(kind, arch, n, skip_bos):
    model = make_model(kind)
    if arch == "mxd_signed":  # MxD's plain TopK gate: signed codes, ranked by magnitude
        layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4, gate="topk"))
        with torch.no_grad():
            layer.b_enc.sub_(3.0)  # many selected codes negative
    else:
        layer = randomise(arch.for_model(model, 1, d_sae=24, k=4))
    batches = stream([(3, 12), (1, 12), (4, 12), (2, 7)])
    features = [0, 3, 7, 11, 23] if n < 200 else list(range(24))

    # Only blocks 0 and 1 may run.
    handle = model.blocks[2].register_forward_pre_hook(lambda *a: pytest.fail("block 2 ran"))
    try:
        df = top_activations(model, layer, iter(batches), features, n=n, skip_bos=skip_bos, progress=False)
    finally:
        handle.remove()
    expected = brute_force(model, layer, batches, features, n, skip_bos)

    assert list(df.columns) == ["feature", "rank", "activation", "token", "left", "right", "row", "position"]
    assert df["feature"].drop_duplicates().tolist() == [f for f in features if expected[f]]
    for f in features:
        got = df[df["feature"] == f]
        assert got["rank"].tolist() == list(range(1, len(expected[f]) + 1))
        assert got["activation"].tolist() == pytest.approx([e[3] for e in expected[f]], rel=1e-5, abs=1e-6)
        assert list(zip(got["row"], got["position"], strict=True)) == [e[1:3] for e in expected[f]]
    if arch == "mxd_signed" and n == 200:
        assert (df["activation"] < 0).any()
    # No tokenizer: token ids stand in for text.
    rows = [row.tolist() for tokens in batches for row in tokens]
    assert df["token"].tolist() == [str(rows[r][p]) for r, p in zip(df["row"], df["position"], strict=True)]
    first = df.iloc[0]
    window = rows[first["row"]][max(0, first["position"] - 8) : first["position"] + 5]
    assert (first["left"] + first["token"] + first["right"]).split() == [str(t) for t in window]
    assert (df["position"] == 0).any() != skip_bos
    assert df.attrs == {"features": features, "block": 1, "tokens": 10 * 12 - 2 * 5 - (10 if skip_bos else 0)}


@pytest.mark.parametrize("kind", ["gpt2", "gated"])
def test_several_layers_from_one_forward_equal_each_alone(kind):
    """Layers at blocks 0 and 1 ranked from one forward per batch == each ranked on its own, and no
    block above the deepest runs."""
    model = make_model(kind)
    first = randomise(TopKTranscoder.for_model(model, 0, d_sae=24, k=4), 0)
    second = randomise(MxD.for_model(model, 1, d_sae=24, k=4), 1)
    batches = stream([(3, 12), (2, 12)], seed=4)
    handle = model.blocks[2].register_forward_pre_hook(lambda *a: pytest.fail("block 2 ran"))
    calls = []
    counter = model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        both = top_activations_of_layers(
            model, [(second, [1, 5]), (first, [0, 2, 9])], batches, n=6, progress=False
        )
    finally:
        handle.remove()
        counter.remove()
    assert len(calls) == len(batches)  # one forward per batch for both layers
    for df, (layer, features) in zip(both, [(second, [1, 5]), (first, [0, 2, 9])], strict=True):
        alone = top_activations(model, layer, batches, features, n=6, progress=False)
        pd.testing.assert_frame_equal(df, alone)
        assert df.attrs == alone.attrs


def test_equal_activations_rank_by_first_occurrence():
    model = make_model("gated")
    layer = randomise(MxD.for_model(model, 0, d_sae=16, k=4))
    row = stream([(1, 12)], seed=3)[0]
    # The same row alone in each batch: bit-identical activations, so every rank is a tie across rows.
    df = top_activations(model, layer, [row] * 5, [2, 9], n=4, progress=False)
    for _, got in df.groupby("feature"):
        assert got["row"].tolist() == [0, 1, 2, 3] and got["position"].nunique() == 1
        assert got["activation"].nunique() == 1
    # Within a batch: the earliest of equal values, also when the tie straddles the cut.
    acts = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    top, flat = _batch_top(acts, 2)
    assert flat[0].tolist() == [1, 3] and top[0].tolist() == [2.0, 2.0]
    assert top[1].tolist() == [3.0, -torch.inf] and flat[1, 0] == 2


WORDS = [
    "the cat sat on a mat while dogs ran over green".split(),
    "hills and birds sang songs of rain the cat sat on".split(),
]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    model, _ = make_text_model(tmp_path_factory.mktemp("text"))
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=16, k=4), seed=2)
    bos = model.tokenizer.bos_token_id
    rows = [
        torch.tensor([[bos, *model.tokenizer(" ".join(w), add_special_tokens=False)["input_ids"]]])
        for w in WORDS
    ]
    df = top_activations(model, layer, rows, range(16), n=50, context=(3, 2), progress=False)
    return model, df


def test_context_strings_on_known_text(text_run):
    _, df = text_run
    assert len(df) > 0 and {1, 11} <= set(df["position"]) and set(df["row"]) == {0, 1}
    for r in df.itertuples():
        words = ["<bos>", *WORDS[r.row]]
        before, after = words[max(0, r.position - 3) : r.position], words[r.position + 1 : r.position + 3]
        assert r.left == " ".join(before)
        assert r.token == " " + words[r.position]  # the joining space goes with the token
        assert r.right == "".join(" " + w for w in after)
    assert df[df["position"] == 1]["left"].eq("<bos>").all()
    assert df[df["position"] == 11]["right"].eq("").all()


def test_html_page_escapes_and_highlights(tmp_path, text_run):
    df = pd.DataFrame(
        {
            "feature": [4, 4, 9],
            "rank": [1, 2, 1],
            "activation": [2.0, 0.5, 1.25],
            "token": ["<script>alert('x')</script>", " cat", " & co"],
            "left": ['say "hi"\n', "the", ""],
            "right": [" ok", "</td>", " ."],
            "row": [0, 3, 1],
            "position": [5, 2, 7],
        }
    )
    df.attrs.update(features=[4, 7, 9], layer=1, tokens=1000)
    path = tmp_path / "page.html"
    page = to_html(df, "Block 1 <experts>", path=path)
    assert path.read_text(encoding="utf-8") == page and list(tmp_path.iterdir()) == [path]
    assert "<script" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "say &quot;hi&quot;↵" in page and "&lt;/td&gt;" in page and "&amp; co" in page
    assert "<title>Block 1 &lt;experts&gt;</title>" in page
    assert 'id="feature-4"' in page and 'id="feature-9"' in page and "never active: 7" in page
    # Background opacity is the activation over the feature's largest.
    assert page.count("rgba(255, 140, 0, 1.000)") == 2 and "rgba(255, 140, 0, 0.250)" in page

    model, real = text_run
    page = to_html(real, "tiny", path=tmp_path / "real.html")
    assert page.count("<section") == real["feature"].nunique() and page.count("<mark") == len(real)


def test_clear_errors():
    model = make_model("gpt2")
    layer = randomise(MxD.for_model(model, 1, d_sae=24, k=4))
    batches = stream([(2, 12)])
    with pytest.raises(ValueError, match="d_sae=24"):
        top_activations(model, layer, batches, [3, 24], progress=False)
    with pytest.raises(ValueError, match="more than once"):
        top_activations(model, layer, batches, [3, 3], progress=False)
    with pytest.raises(ValueError, match="features is empty"):
        top_activations(model, layer, batches, [], progress=False)
    with pytest.raises(ValueError, match="no batch"):
        top_activations(model, layer, [], [3], progress=False)
    with pytest.raises(ValueError, match="n=0"):
        top_activations(model, layer, batches, [3], n=0, progress=False)
    with pytest.raises(ValueError, match="context"):
        top_activations(model, layer, batches, [3], context=(-1, 2), progress=False)
    with pytest.raises(TypeError, match="batch 0"):
        top_activations(model, layer, [torch.rand(2, 12)], [3], progress=False)
    with pytest.raises(ValueError, match="lacks columns"):
        to_html(pd.DataFrame({"feature": [1]}), "x")

    other = randomise(MxD.for_model(make_model("gpt2"), 2, d_sae=24, k=4))
    other.cfg.metadata.model_name = "gpt2-small"
    with pytest.raises(ValueError, match="trained on 'gpt2-small'"):
        top_activations(model, other, batches, [3], progress=False)
    other.cfg.metadata.model_name = None
    other.cfg.metadata.hook_name_out = "blocks.7.hook_mlp_out"
    with pytest.raises(ValueError, match="block 7 does not exist"):
        top_activations(model, other, batches, [3], progress=False)

"""The activation stream: exact (x, y) pairs, one forward for many layers, the disk cache, shuffling."""

from __future__ import annotations

import pytest
import torch
from conftest import D_VOCAB, make_model

import mxd_lens
from mxd_lens.activations import CachedActivations, ModelActivations, shuffled_batches, write_cache


def random_rows(seed: int = 0, context: int = 12):
    def rows():
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, D_VOCAB, (context,), generator=g)

    return rows


def finite_rows(n: int, seed: int = 0, context: int = 12):
    def rows():
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            yield torch.randint(0, D_VOCAB, (context,), generator=g)

    return rows


def test_blocks_hold_each_layers_exact_mlp_io_without_bos():
    model = make_model("parallel")
    source = ModelActivations(model, [2, 0], random_rows(), context_size=12, rows_per_block=6, forward_rows=4)
    block = next(source.blocks())
    tokens = torch.stack([row for _, row in zip(range(6), random_rows()(), strict=False)])
    with mxd_lens.capture_mlp_io(model, [0, 2]) as io:
        model(tokens)
    for layer in (0, 2):
        x, y = block[layer]
        assert x.shape == y.shape == (6 * 11, 16)
        torch.testing.assert_close(x, io[layer]["in"][:, 1:].reshape(-1, 16), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y, io[layer]["out"][:, 1:].reshape(-1, 16), rtol=1e-6, atol=1e-6)


def test_forward_stops_after_the_last_layer_needed():
    model = make_model("gpt2")
    ran = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *a, i=i: ran.append(i))
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_block=2)
    next(source.blocks())
    assert sorted(set(ran)) == [0, 1]


def test_blocks_restart_deterministically_and_end_with_the_rows():
    model = make_model("gpt2")
    source = ModelActivations(model, [0], finite_rows(14), context_size=12, rows_per_block=4)
    blocks = list(source.blocks())
    assert len(blocks) == 3  # 14 rows: three whole blocks, two rows dropped
    later = list(source.blocks(start=2))
    assert len(later) == 1 and torch.equal(later[0][0][0], blocks[2][0][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cache_round_trip(tmp_path, dtype):
    model = make_model("gated")
    source = ModelActivations(model, [0, 2], random_rows(), context_size=12, rows_per_block=4)
    write_cache(source, tmp_path, n_blocks=3, dtype=dtype, progress=False)
    cached = CachedActivations(tmp_path, expect={"model_name": "tiny-gated", "d_in": 16})
    assert cached.n_blocks == 3 and cached.info == source.info
    tol = dict(rtol=0, atol=0) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    for live, stored in zip(source.blocks(), cached.blocks(), strict=False):
        for layer in (0, 2):
            torch.testing.assert_close(stored[layer][0], live[layer][0], **tol)
            torch.testing.assert_close(stored[layer][1], live[layer][1], **tol)


def test_interrupted_cache_continues_to_the_same_result(tmp_path):
    model = make_model("gpt2")
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_block=4)
    write_cache(source, tmp_path / "whole", n_blocks=5, progress=False)
    write_cache(source, tmp_path / "parts", n_blocks=2, progress=False)
    (tmp_path / "parts" / "block_000002.tmp").write_bytes(b"half a shard")  # a killed write
    write_cache(source, tmp_path / "parts", n_blocks=5, progress=False)
    for a, b in zip(
        CachedActivations(tmp_path / "whole").blocks(),
        CachedActivations(tmp_path / "parts").blocks(),
        strict=True,
    ):
        assert torch.equal(a[1][0], b[1][0]) and torch.equal(a[1][1], b[1][1])


def test_cache_from_another_setup_is_refused(tmp_path):
    model = make_model("gpt2")
    write_cache(
        ModelActivations(model, [1], random_rows(), context_size=12, rows_per_block=4),
        tmp_path,
        1,
        progress=False,
    )
    with pytest.raises(ValueError, match="different settings"):
        write_cache(
            ModelActivations(model, [0], random_rows(), context_size=12, rows_per_block=4),
            tmp_path,
            2,
            progress=False,
        )
    with pytest.raises(ValueError, match="caches layers \\[1\\], not \\[0\\]"):
        CachedActivations(tmp_path, layers=[0])
    with pytest.raises(ValueError, match="model_name='tiny-gpt2', but this run asks for 'gpt2'"):
        CachedActivations(tmp_path, expect={"model_name": "gpt2"})
    with pytest.raises(ValueError, match="d_in=16, but this run asks for 768"):
        CachedActivations(tmp_path, expect={"d_in": 768})
    with pytest.raises(FileNotFoundError, match="not an activation cache"):
        CachedActivations(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        write_cache(
            ModelActivations(model, [1], random_rows(), context_size=12, rows_per_block=4),
            tmp_path / "x",
            1,
            dtype="int8",
        )


def _take(stream, n):
    return [b for _, b in zip(range(n), stream, strict=False)]


def _rows_as_set(x: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(map(tuple, x.tolist()))


def test_live_batches_permute_pairs_together_and_run_across_blocks():
    model = make_model("gpt2")
    source = ModelActivations(
        model, [1], random_rows(), context_size=12, rows_per_block=8
    )  # 88 tokens a block
    mlp = model.blocks[1].mlp
    batches = _take(shuffled_batches(source, batch_tokens=20, seed=3), 13)  # 260 tokens: ~3 blocks
    for acts in batches:
        x, y = acts[1]
        assert x.shape == (20, 16)
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), y, rtol=1e-5, atol=1e-5)  # each pair still belongs together
    blocks = list(zip(range(2), source.blocks(), strict=False))
    seen = torch.cat([b[1][0] for b in batches])
    for i, (_, block) in enumerate(blocks):  # tokens 88 i .. 88 (i + 1) are block i, permuted; none dropped
        part = seen[88 * i : 88 * (i + 1)]
        assert not torch.equal(part, block[1][0]) and _rows_as_set(part) == _rows_as_set(block[1][0])
    other = next(iter(shuffled_batches(source, 20, seed=4)))[1][0]
    assert not torch.equal(other, batches[0][1][0])
    # Resuming at any batch gives the batches of the unbroken stream, bit for bit.
    for step in (1, 4, 8, 12):
        resumed = next(iter(shuffled_batches(source, 20, seed=3, start=20 * step)))
        assert torch.equal(resumed[1][0], batches[step][1][0]) and torch.equal(
            resumed[1][1], batches[step][1][1]
        )


def _cache(tmp_path, blocks=5, rows=4, context=12):
    model = make_model("gated")
    source = ModelActivations(model, [0, 1], random_rows(), context_size=context, rows_per_block=rows)
    write_cache(source, tmp_path / "cache", n_blocks=blocks, progress=False)
    return source, tmp_path / "cache"


def test_global_shuffle_visits_every_token_once_per_epoch_in_a_new_order(tmp_path):
    _, path = _cache(tmp_path)  # 5 blocks x 44 tokens = 220 tokens
    cache = CachedActivations(path, buffer_tokens=40, chunk_tokens=10)  # windows of 4 chunks, across blocks
    everything = torch.cat([b[1][0] for b in cache.blocks()])
    assert cache.epoch_tokens == 220
    batches = _take(shuffled_batches(cache, batch_tokens=22, seed=0), 30)  # three epochs
    x = torch.cat([b[1][0] for b in batches])
    epochs = [x[220 * e : 220 * (e + 1)] for e in range(3)]
    for epoch in epochs:
        assert _rows_as_set(epoch) == _rows_as_set(everything)  # each token exactly once
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    # The first window mixes several blocks (a global shuffle, not a per-block one).
    block_of = {row: i for i, b in enumerate(cache.blocks()) for row in map(tuple, b[1][0].tolist())}
    assert len({block_of[row] for row in map(tuple, epochs[0][:40].tolist())}) >= 3
    # Layers stay paired: y of layer 1 matches the x rows of layer 1 in the blocks.
    pairs = {
        tuple(a): tuple(b)
        for blk in cache.blocks()
        for a, b in zip(blk[1][0].tolist(), blk[1][1].tolist(), strict=True)
    }
    assert all(
        pairs[tuple(a)] == tuple(b)
        for a, b in zip(x[:100].tolist(), torch.cat([b[1][1] for b in batches])[:100].tolist(), strict=True)
    )
    # Resume anywhere, mid-window and mid-epoch: the same batches.
    for step in (3, 7, 11, 25):
        resumed = _take(shuffled_batches(cache, 22, seed=0, start=22 * step), 2)
        for a, b in zip(resumed, batches[step : step + 2], strict=True):
            assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][1], b[1][1])


def test_block_shuffle_of_a_cache_is_the_live_stream(tmp_path):
    source, path = _cache(tmp_path, blocks=3)
    live = torch.cat([b[0][0] for b in _take(shuffled_batches(source, 11, seed=5), 12)])
    cached = torch.cat(
        [b[0][0] for b in _take(shuffled_batches(CachedActivations(path, shuffle="block"), 11, seed=5), 12)]
    )
    assert torch.equal(live, cached)
    with pytest.raises(ValueError, match="shuffle='random'"):
        CachedActivations(path, shuffle="random")
    assert CachedActivations(path, max_blocks=2).epoch_tokens == 88


def test_non_finite_activations_stop_the_stream():
    model = make_model("gpt2")
    with torch.no_grad():
        model.blocks[0].mlp.W_out[0, 0] = float("nan")
    source = ModelActivations(model, [0], random_rows(), context_size=12, rows_per_block=4)
    with pytest.raises(FloatingPointError, match="non-finite activations at layer 0 in block 0"):
        next(iter(shuffled_batches(source, 8, seed=0)))
    with pytest.raises(ValueError, match="batch_tokens=0"):
        next(iter(shuffled_batches(source, 0, seed=0)))

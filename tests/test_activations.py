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


def test_shuffled_batches_permute_inputs_and_targets_together():
    model = make_model("gpt2")
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_block=8)
    mlp = model.blocks[1].mlp
    seen = []
    for (block, batch), acts in shuffled_batches(source, batch_tokens=20, seed=3):
        if block == 2:
            break
        x, y = acts[1]
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), y, rtol=1e-5, atol=1e-5)  # each pair still belongs together
        seen.append((block, batch))
        if (block, batch) == (0, 0):
            first = x
    assert seen == [(b, i) for b in (0, 1) for i in range(88 // 20)]
    block0 = next(source.blocks())[1][0]
    assert not torch.equal(first, block0[:20])  # shuffled
    assert all((first[:, None] == block0[None]).all(-1).any(-1))  # drawn from block 0
    again = next(iter(shuffled_batches(source, 20, seed=3, start=(0, 0))))[1][1][0]
    other = next(iter(shuffled_batches(source, 20, seed=4, start=(0, 0))))[1][1][0]
    assert torch.equal(again, first) and not torch.equal(other, first)
    resumed = next(iter(shuffled_batches(source, 20, seed=3, start=(1, 2))))
    assert resumed[0] == (1, 2)


def test_non_finite_activations_stop_the_stream():
    model = make_model("gpt2")
    with torch.no_grad():
        model.blocks[0].mlp.W_out[0, 0] = float("nan")
    source = ModelActivations(model, [0], random_rows(), context_size=12, rows_per_block=4)
    with pytest.raises(FloatingPointError, match="non-finite activations at layer 0 in block 0"):
        next(iter(shuffled_batches(source, 8, seed=0)))
    with pytest.raises(ValueError, match="batch_tokens=100 must be in 1..44"):
        next(iter(shuffled_batches(source, 100, seed=0)))

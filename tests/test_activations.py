"""The activation stream: exact (x, y) pairs, one forward for many blocks, the disk cache, shuffling."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import D_VOCAB, make_model

import mxd_lens
from mxd_lens.activations import (
    CachedActivations,
    CacheError,
    CacheLockedError,
    ModelActivations,
    cache_lock,
    shuffled_batches,
    write_cache,
)


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


def test_shards_hold_each_blocks_exact_mlp_io_without_bos():
    model = make_model("parallel")
    source = ModelActivations(
        model, [2, 0], random_rows(), context_size=12, rows_per_shard=6, rows_per_forward=4
    )
    shard = next(source.shards())
    tokens = torch.stack([row for _, row in zip(range(6), random_rows()(), strict=False)])
    with mxd_lens.capture_mlp_io(model, [0, 2]) as io:
        model(tokens)
    for block in (0, 2):
        x, y = shard[block]
        assert x.shape == y.shape == (6 * 11, 16)
        torch.testing.assert_close(x, io[block]["in"][:, 1:].reshape(-1, 16), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y, io[block]["out"][:, 1:].reshape(-1, 16), rtol=1e-6, atol=1e-6)


def test_forward_stops_after_the_last_block_needed():
    model = make_model("gpt2")
    ran = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *a, i=i: ran.append(i))
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=2)
    next(source.shards())
    assert sorted(set(ran)) == [0, 1]


def test_shards_restart_deterministically_and_end_with_the_rows():
    model = make_model("gpt2")
    source = ModelActivations(model, [0], finite_rows(14), context_size=12, rows_per_shard=4)
    shards = list(source.shards())
    assert len(shards) == 3  # 14 rows: three whole shards, two rows dropped
    later = list(source.shards(start=2))
    assert len(later) == 1 and torch.equal(later[0][0][0], shards[2][0][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cache_round_trip(tmp_path, dtype):
    model = make_model("gated")
    source = ModelActivations(model, [0, 2], random_rows(), context_size=12, rows_per_shard=4)
    write_cache(source, tmp_path, n_shards=3, dtype=dtype, progress=False)
    cached = CachedActivations(tmp_path, expect={"model_name": "tiny-gated", "d_in": 16})
    assert cached.n_shards == 3 and cached.info == source.info
    tol = dict(rtol=0, atol=0) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    for live, stored in zip(source.shards(), cached.shards(), strict=False):
        for block in (0, 2):
            torch.testing.assert_close(stored[block][0], live[block][0], **tol)
            torch.testing.assert_close(stored[block][1], live[block][1], **tol)


def test_interrupted_cache_continues_to_the_same_result(tmp_path):
    model = make_model("gpt2")
    source = ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=4)
    write_cache(source, tmp_path / "whole", n_shards=5, progress=False)
    write_cache(source, tmp_path / "parts", n_shards=2, progress=False)
    (tmp_path / "parts" / "block_000002.tmp").write_bytes(b"half a shard")  # a killed write (old name)
    write_cache(source, tmp_path / "parts", n_shards=5, progress=False)
    for a, b in zip(
        CachedActivations(tmp_path / "whole").shards(),
        CachedActivations(tmp_path / "parts").shards(),
        strict=True,
    ):
        assert torch.equal(a[1][0], b[1][0]) and torch.equal(a[1][1], b[1][1])


def test_cache_from_another_setup_is_refused(tmp_path):
    model = make_model("gpt2")
    write_cache(
        ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=4),
        tmp_path,
        1,
        progress=False,
    )
    with pytest.raises(ValueError, match="different settings"):
        write_cache(
            ModelActivations(model, [0], random_rows(), context_size=12, rows_per_shard=4),
            tmp_path,
            2,
            progress=False,
        )
    with pytest.raises(ValueError, match="caches blocks \\[1\\], not \\[0\\]"):
        CachedActivations(tmp_path, blocks=[0])
    with pytest.raises(ValueError, match="model_name='tiny-gpt2', but this run asks for 'gpt2'"):
        CachedActivations(tmp_path, expect={"model_name": "gpt2"})
    with pytest.raises(ValueError, match="d_in=16, but this run asks for 768"):
        CachedActivations(tmp_path, expect={"d_in": 768})
    with pytest.raises(FileNotFoundError, match="not an activation cache"):
        CachedActivations(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        write_cache(
            ModelActivations(model, [1], random_rows(), context_size=12, rows_per_shard=4),
            tmp_path / "x",
            1,
            dtype="int8",
        )


def _take(stream, n):
    return [b for _, b in zip(range(n), stream, strict=False)]


def _rows_as_set(x: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(map(tuple, x.tolist()))


def test_live_batches_permute_pairs_together_and_run_across_shards():
    model = make_model("gpt2")
    source = ModelActivations(
        model, [1], random_rows(), context_size=12, rows_per_shard=8
    )  # 88 tokens a shard
    mlp = model.blocks[1].mlp
    batches = _take(shuffled_batches(source, batch_tokens=20, seed=3), 13)  # 260 tokens: ~3 shards
    for acts in batches:
        x, y = acts[1]
        assert x.shape == (20, 16)
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), y, rtol=1e-5, atol=1e-5)  # each pair still belongs together
    shards = list(zip(range(2), source.shards(), strict=False))
    seen = torch.cat([b[1][0] for b in batches])
    for i, (_, shard) in enumerate(shards):  # tokens 88 i .. 88 (i + 1) are shard i, permuted; none dropped
        part = seen[88 * i : 88 * (i + 1)]
        assert not torch.equal(part, shard[1][0]) and _rows_as_set(part) == _rows_as_set(shard[1][0])
    other = next(iter(shuffled_batches(source, 20, seed=4)))[1][0]
    assert not torch.equal(other, batches[0][1][0])
    # Resuming at any batch gives the batches of the unbroken stream, bit for bit.
    for step in (1, 4, 8, 12):
        resumed = next(iter(shuffled_batches(source, 20, seed=3, start=20 * step)))
        assert torch.equal(resumed[1][0], batches[step][1][0]) and torch.equal(
            resumed[1][1], batches[step][1][1]
        )


def _cache(tmp_path, shards=5, rows=4, context=12):
    model = make_model("gated")
    source = ModelActivations(model, [0, 1], random_rows(), context_size=context, rows_per_shard=rows)
    write_cache(source, tmp_path / "cache", n_shards=shards, progress=False)
    return source, tmp_path / "cache"


def test_global_shuffle_visits_every_token_once_per_epoch_in_a_new_order(tmp_path):
    _, path = _cache(tmp_path)  # 5 shards x 44 tokens = 220 tokens
    cache = CachedActivations(path, buffer_tokens=40, chunk_tokens=10)  # windows of 4 chunks, across shards
    everything = torch.cat([b[1][0] for b in cache.shards()])
    assert cache.epoch_tokens == 220
    batches = _take(shuffled_batches(cache, batch_tokens=22, seed=0), 30)  # three epochs
    x = torch.cat([b[1][0] for b in batches])
    epochs = [x[220 * e : 220 * (e + 1)] for e in range(3)]
    for epoch in epochs:
        assert _rows_as_set(epoch) == _rows_as_set(everything)  # each token exactly once
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    # The first window mixes several shards (a global shuffle, not a per-shard one).
    shard_of = {row: i for i, s in enumerate(cache.shards()) for row in map(tuple, s[1][0].tolist())}
    assert len({shard_of[row] for row in map(tuple, epochs[0][:40].tolist())}) >= 3
    # Blocks stay paired: y of block 1 matches the x rows of block 1 in the shards.
    pairs = {
        tuple(a): tuple(b)
        for shard in cache.shards()
        for a, b in zip(shard[1][0].tolist(), shard[1][1].tolist(), strict=True)
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


def test_shard_shuffle_of_a_cache_is_the_live_stream(tmp_path):
    source, path = _cache(tmp_path, shards=3)
    live = torch.cat([b[0][0] for b in _take(shuffled_batches(source, 11, seed=5), 12)])
    cached = torch.cat(
        [b[0][0] for b in _take(shuffled_batches(CachedActivations(path, shuffle="shard"), 11, seed=5), 12)]
    )
    assert torch.equal(live, cached)
    with pytest.raises(ValueError, match="shuffle='random'"):
        CachedActivations(path, shuffle="random")
    with pytest.raises(ValueError, match="shuffle='block'"):  # its old name
        CachedActivations(path, shuffle="block")
    assert CachedActivations(path, max_shards=2).epoch_tokens == 88


def test_non_finite_activations_stop_the_stream():
    model = make_model("gpt2")
    with torch.no_grad():
        model.blocks[0].mlp.W_out[0, 0] = float("nan")
    source = ModelActivations(model, [0], random_rows(), context_size=12, rows_per_shard=4)
    with pytest.raises(FloatingPointError, match="non-finite activations at block 0 in shard 0"):
        next(iter(shuffled_batches(source, 8, seed=0)))
    with pytest.raises(ValueError, match="batch_tokens=0"):
        next(iter(shuffled_batches(source, 0, seed=0)))


# -- cache integrity ---------------------------------------------------------------------------------


def _integrity_source():
    # 8 rows x 11 tokens x 16 floats x 2 blocks x (x, y): 22.5 kB shards, room to overwrite 4 kB inside
    return ModelActivations(make_model("gpt2"), [0, 1], random_rows(), context_size=12, rows_per_shard=8)


def _same_shards(a: CachedActivations, b: CachedActivations) -> None:
    assert a.n_shards == b.n_shards
    for x, y in zip(a.shards(), b.shards(), strict=True):
        for block in (0, 1):
            assert torch.equal(x[block][0], y[block][0]) and torch.equal(x[block][1], y[block][1])


@pytest.fixture
def caches(tmp_path):
    """An untouched cache of 4 shards (``orig``) and the same written again (``c``) to damage."""
    source = _integrity_source()
    write_cache(source, tmp_path / "orig", n_shards=4, progress=False)
    write_cache(source, tmp_path / "c", n_shards=4, progress=False)
    return source, tmp_path / "orig", tmp_path / "c"


def test_cache_files_get_the_mode_open_would_give_and_no_temporary_is_left(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        write_cache(_integrity_source(), tmp_path, n_shards=2, progress=False)
    finally:
        os.umask(old)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        ".lock",
        "manifest.json",
        "shard_000000.safetensors",
        "shard_000001.safetensors",
        "shards.jsonl",
    ]
    for name in names:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


def test_a_missing_middle_shard_is_an_error_naming_it_and_a_rerun_restores_it(caches):
    source, orig, path = caches
    (path / "shard_000001.safetensors").unlink()
    with pytest.raises(
        CacheError,
        match=r"shard_000001\.safetensors is missing \(recorded as written, later shards are present\)",
    ):
        CachedActivations(path)  # not a cache of 1 shard
    (path / "shard_000003.safetensors").unlink()  # the last one, recorded as written
    with pytest.raises(CacheError, match=r"(?s)shard_000001.*shard_000003\.safetensors is missing.*re-run"):
        CachedActivations(path)
    write_cache(source, path, n_shards=4, progress=False)
    _same_shards(CachedActivations(orig), CachedActivations(path))


def test_a_truncated_shard_is_a_cache_error_naming_it_and_a_rerun_restores_it(caches):
    source, orig, path = caches
    shard = path / "shard_000002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CacheError, match=r"shard_000002\.safetensors has 11,\d+ bytes, but 22,\d+ were written"
    ):
        CachedActivations(path)
    shard.write_bytes(data)
    cache = CachedActivations(path)
    shard.write_bytes(data[:-100])  # cut short after the cache was opened: found when read
    with pytest.raises(CacheError, match=r"shard_000002\.safetensors .*truncated.*re-run `mxd-lens cache`"):
        cache.read(2, 0, 10)
    with pytest.raises(CacheError, match="shard_000002"):
        list(cache.shards())
    with pytest.warns(UserWarning, match=r"shard_000002\.safetensors has .* bytes.*; recomputing it"):
        write_cache(source, path, n_shards=4, progress=False)
    _same_shards(CachedActivations(orig), CachedActivations(path))


def test_overwritten_bytes_inside_a_shard_are_caught_by_its_checksum(caches):
    source, orig, path = caches
    shard = path / "shard_000001.safetensors"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle - 2048 : middle + 2048] = bytes(b ^ 0x5A for b in data[middle - 2048 : middle + 2048])
    shard.write_bytes(bytes(data))  # same size, still a valid safetensors file: only the checksum knows
    cache = CachedActivations(path)
    cache.read(0)  # the other shards read fine
    with pytest.raises(CacheError, match=r"shard_000001\.safetensors does not match the checksum.*re-run"):
        cache.read(1, 0, 5)
    with pytest.raises(CacheError, match="shard_000001"):  # training reads it: stops, naming the shard
        _take(shuffled_batches(CachedActivations(path), 88, seed=0), 4)  # one epoch
    problems = cache.verify()
    assert len(problems) == 1 and "shard_000001.safetensors does not match the checksum" in problems[0]
    with pytest.warns(
        UserWarning, match=r"shard_000001\.safetensors does not match the checksum.*recomputing"
    ):
        write_cache(source, path, n_shards=4, progress=False)
    repaired = CachedActivations(path)
    assert repaired.verify() == []
    _same_shards(CachedActivations(orig), repaired)


def test_a_shard_is_checksummed_once_per_process(caches, monkeypatch):
    import mxd_lens.activations as activations

    _, _, path = caches
    calls = []
    digest = activations._digest
    monkeypatch.setattr(activations, "_digest", lambda p: calls.append(p.name) or digest(p))
    cache = CachedActivations(path)
    for _ in range(3):
        cache.read(2, 0, 4)
        list(cache.shards(start=3))
    assert calls == ["shard_000002.safetensors", "shard_000003.safetensors"]


def test_a_cache_written_before_checksums_opens_with_a_warning_and_a_rerun_records_them(caches):
    source, orig, path = caches
    (path / "shards.jsonl").unlink()
    with pytest.warns(UserWarning, match="4 shard.*no checksum record.*written before records"):
        cache = CachedActivations(path)
    _same_shards(CachedActivations(orig), cache)
    shard = path / "shard_000003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    with (
        pytest.warns(UserWarning),
        pytest.raises(
            CacheError, match=r"shard_000003\.safetensors is not a readable safetensors file \(truncated"
        ),
    ):
        CachedActivations(path).read(3)
    with (
        pytest.warns(UserWarning, match="before shards had checksums: its 3 shards"),
        pytest.warns(UserWarning, match=r"shard_000003\.safetensors is not a readable .*; recomputing it"),
    ):
        write_cache(source, path, n_shards=4, progress=False)  # shard 3 recomputed, 0..2 recorded
    assert (path / "shards.jsonl").read_text().count("\n") == 4
    _same_shards(CachedActivations(orig), CachedActivations(path))


def test_a_shard_renamed_but_not_yet_recorded_is_kept(caches):
    """A kill between a shard's rename and its record: the shard is whole; a re-run records it."""
    source, orig, path = caches
    records = path / "shards.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(lines[:3]) + lines[3][:20])  # and the last append cut short
    with pytest.warns(UserWarning, match="1 shard.*an interrupted write"):
        CachedActivations(path)
    before = (path / "shard_000003.safetensors").stat().st_ino
    write_cache(source, path, n_shards=4, progress=False)
    assert (path / "shard_000003.safetensors").stat().st_ino == before  # kept, not recomputed
    assert records.read_text() == "".join(lines)
    records.write_text("".join(lines[:1]) + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(CacheError, match=r"shards\.jsonl: line 2 is not a shard record"):
        CachedActivations(path)


def test_a_second_writer_is_refused_naming_the_folder_and_the_holder(caches):
    import subprocess
    import sys

    source, _, path = caches
    with cache_lock(path):
        with pytest.raises(
            CacheLockedError, match=rf"{path} is being written by another process \(pid {os.getpid()}"
        ):
            write_cache(source, path, n_shards=5, progress=False)
    holder = subprocess.Popen(  # another process holding the lock, as a writer does
        [sys.executable, "-c", "import fcntl, os, sys; f = open(sys.argv[1], 'r+'); fcntl.flock(f, fcntl.LOCK_EX); "
         "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True); sys.stdin.read()",
         str(path / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockedError, match=rf"pid {holder.pid}\b"):
            write_cache(source, path, n_shards=5, progress=False)
        # a reader is refused too: the folder holds only the shards written so far
        with pytest.raises(CacheLockedError, match=rf"still being written .*pid {holder.pid}\b.*wait for it"):
            CachedActivations(path)
    finally:
        holder.communicate("")
    write_cache(source, path, n_shards=5, progress=False)  # released: the writer continues
    assert CachedActivations(path).n_shards == 5


def test_cli_verify_reports_a_damaged_cache_and_writes_nothing(caches, capsys):
    from mxd_lens.cli import main

    _, _, path = caches
    assert main(["cache", "--verify", "--out", str(path)]) == 0
    assert "4 shards, 352 tokens, every shard intact" in capsys.readouterr().out
    assert main(["cache", "--verify", "--shards", "6", "--out", str(path)]) == 1
    assert "holds 4 of the 6 shards asked for" in capsys.readouterr().out
    shard = path / "shard_000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-4096:] = bytes(4096)
    shard.write_bytes(bytes(data))
    listing = sorted((p.name, p.stat().st_mtime_ns) for p in path.iterdir())
    assert main(["cache", "--verify", "--out", str(path)]) == 1
    out = capsys.readouterr().out
    assert "shard_000002.safetensors does not match the checksum" in out and "re-run `mxd-lens cache`" in out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in path.iterdir()) == listing
    shard.unlink()
    assert main(["cache", "--verify", "--out", str(path)]) == 1
    assert "shard_000002.safetensors is missing" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--blocks .* and --shards .* are required"):
        main(["cache", "--out", str(path)])


OLD_STREAM_KEYS = {"blocks": "layers", "rows_per_shard": "rows_per_block"}  # today's key: its old name


def _as_written_before_shards_were_named_shards(path) -> None:
    """Give a cache the names an older version wrote: block_*.safetensors files and records, and
    the manifest's stream record with ``layers`` for ``blocks`` and ``rows_per_block`` for
    ``rows_per_shard``."""
    for shard in path.glob("shard_*.safetensors"):
        shard.rename(path / shard.name.replace("shard_", "block_"))
    records = path / "shards.jsonl"
    records.write_text(records.read_text().replace('"shard_0', '"block_0'))
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(OLD_STREAM_KEYS) <= set(manifest["stream"])
    manifest["stream"] = {OLD_STREAM_KEYS.get(k, k): v for k, v in manifest["stream"].items()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_with_the_old_key_names_reads_and_extends(tmp_path):
    """A manifest.json written before the renames (``layers``, ``rows_per_block`` in its stream
    record) reads as today's, and writing more into it is not refused as other settings."""
    source = _integrity_source()
    write_cache(source, tmp_path, n_shards=2, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["stream"] = {OLD_STREAM_KEYS.get(k, k): v for k, v in manifest["stream"].items()}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    old = CachedActivations(tmp_path)
    assert old.info == source.info and old.info.rows_per_shard == 8
    assert old.epoch_tokens == 2 * source.info.tokens_per_shard
    write_cache(source, tmp_path, n_shards=3, progress=False)
    assert CachedActivations(tmp_path).n_shards == 3
    assert (
        "rows_per_block" in json.loads((tmp_path / "manifest.json").read_text())["stream"]
    )  # left as it was


def test_a_cache_written_before_the_rename_reads_and_extends_under_its_old_names(tmp_path):
    new = CachedActivations(write_cache(_integrity_source(), tmp_path / "new", n_shards=4, progress=False))
    write_cache(_integrity_source(), tmp_path / "old", n_shards=2, progress=False)
    _as_written_before_shards_were_named_shards(tmp_path / "old")
    assert not list((tmp_path / "old").glob("shard_*"))
    # Extending it keeps its names (checking, not recomputing, the two shards already there).
    old = CachedActivations(write_cache(_integrity_source(), tmp_path / "old", n_shards=4, progress=False))
    assert sorted(p.name for p in (tmp_path / "old").glob("*.safetensors")) == [
        f"block_{i:06d}.safetensors" for i in range(4)
    ]
    assert old.n_shards == new.n_shards == 4 and not old.unrecorded and old.verify(progress=False) == []
    _same_shards(old, new)

"""(MLP input, MLP output) pairs at several transformer blocks from one model forward, an on-disk cache
of them, and the shuffled batches a trainer consumes.

The output is what the layers trained on the stream will write (``StreamInfo.hook_names``, copied into
each layer's metadata): ``hook_mlp_out``, or on hosts whose blocks normalise the MLP's output
(Gemma-2/3, OLMo-2/3) the MLP module's own output, ``blocks.L.mlp.hook_out`` (``mxd_lens.hooks``).

The stream is cut into **shards**: a fixed number (``rows_per_shard``) of token rows whose activations
are computed together (one model forward per ``rows_per_forward`` rows, stopping after the last block
needed). An on-disk cache stores each shard as one safetensors file, ``shard_000000.safetensors`` on (a
cache written before they were named shards holds ``block_000000.safetensors`` ...: read and extended
as it is). "Block" always means a transformer block.

Batches come from **windows**, each permuted by a generator seeded by (seed, epoch, window) and cut
into batches that run on across window (and epoch) ends, so no token is dropped:

- from a live model, a window is one shard, in stream order (the text is read once);
- from a cache, every epoch is a fresh seeded permutation of all (shard, chunk) pieces of the cache,
  ``chunk_tokens`` consecutive tokens each, grouped into windows of ``buffer_tokens``: a **global**
  shuffle with a bounded buffer, each token visited exactly once per epoch, epochs without end
  (``shuffle="shard"`` reads a cache the way the live stream reads the model).

A batch is therefore fixed by its token offset in the stream alone: a resumed run restarts at
``tokens_seen`` (re-reading one window) with no buffer to checkpoint, bit for bit.

A cache checks itself: ``shards.jsonl`` records each shard's size and checksum when it is written.
Opening a cache checks that every shard is there with its size (cheap); the first read of a shard
in a process checks its checksum; anything wrong raises :class:`CacheError` naming the file. Running
``write_cache`` (``mxd-lens cache``) again with the same arguments recomputes exactly the shards that
are missing or damaged.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mxd_lens import hooks
from mxd_lens.config import WIDTH_MULTIPLIER, StreamConfig
from mxd_lens.fileio import _umask, atomic_write, atomic_write_text, file_digest
from mxd_lens.hooks import Writes
from mxd_lens.records import canonical_model_name, is_named, loadable_name

MANIFEST = "manifest.json"
SHARDS = (
    "shards.jsonl"  # one {"shard", "bytes", "blake2b_256"} record per line; the last one per shard counts
)
LOCK = ".lock"  # held (flock) by the one process writing the cache; holds its pid
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPAIR = (
    "re-run `mxd-lens cache` with the same arguments into this folder: "
    "it recomputes only what is missing or damaged"
)


class CacheError(ValueError):
    """An activation cache is damaged: a shard is missing, truncated, changed on disk or unreadable."""


class CacheLockedError(RuntimeError):
    """Another process is writing this activation cache."""


@dataclass
class StreamInfo:
    """What a stream holds; a cache records it and a run checks it against what it asks for."""

    model_name: str
    blocks: list[int]  # the transformer blocks whose MLP input and output the stream holds
    d_in: int
    d_out: int
    rows_per_shard: int  # token rows per shard
    context_size: int
    drop_first_position: bool
    d_hidden: int = 0
    activation: str = "relu"
    gated: bool = False
    hook_names: dict[str, list[str]] = field(default_factory=dict)  # block -> [read hook, write hook]

    def writes(self, block: int) -> Writes:
        """Where a layer trained on block ``block``'s targets writes (``hooks.Writes``): what its
        recorded output hook names; ``hook_mlp_out`` for a stream that records none (the only site
        before the MLP module's output was one)."""
        names = self.hook_names.get(str(block))
        parsed = hooks.parse_out_hook(names[1]) if names and len(names) > 1 else None
        return parsed[1] if parsed else "hook_mlp_out"

    @property
    def default_width_multiplier(self) -> int:
        """The width multiplier m (a transcoder of m * d_in latents, an MxD of as many parameters) that a
        run on this stream uses when none is given: ``matching.default_width_multiplier``, 8, or more on
        hosts whose MLP is too wide for a width-8 match."""
        from mxd_lens.matching import default_width_multiplier

        d_hidden = self.d_hidden or 4 * self.d_out  # a stream recorded before d_hidden was: GPT-2's ratio
        return default_width_multiplier(
            self.d_in, self.d_out, d_hidden, glu=self.gated, floor=WIDTH_MULTIPLIER
        )

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> StreamInfo:
        """A stream's record as a cache manifest holds it, also one written under the old key names
        (``upgrade_stream_record``)."""
        return cls(**upgrade_stream_record(saved))

    @property
    def tokens_per_shard(self) -> int:
        return self.rows_per_shard * (self.context_size - int(self.drop_first_position))


# Old-data reader: the keys a stream record (a cache manifest's or a checkpoint's ``stream``) had in
# caches and checkpoints written before the renames, and their names now.
OLD_STREAM_KEYS = {"layers": "blocks", "rows_per_block": "rows_per_shard"}


def upgrade_stream_record(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved stream record (a manifest's or a checkpoint's ``stream``) with today's key names
    (old-data reader: ``layers`` was renamed ``blocks``, ``rows_per_block`` ``rows_per_shard``) and the
    default model by the name streams record now (``smollm2-135m``, not its ``SmolLM2-135M-Instruct``)."""
    old = [k for k in OLD_STREAM_KEYS if k in saved and OLD_STREAM_KEYS[k] not in saved]
    if old:
        saved = {(OLD_STREAM_KEYS[k] if k in old else k): v for k, v in saved.items()}
    name = saved.get("model_name")
    if isinstance(name, str) and canonical_model_name(name) != name:
        saved = {**saved, "model_name": canonical_model_name(name)}
    return saved


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """A cache's manifest.json, checked field by field (its stream with today's key names,
    ``upgrade_stream_record``): a damaged or hand-edited manifest is a :class:`CacheError` naming the file
    and the field, not a TypeError where a field is first used. A missing file: FileNotFoundError."""
    from mxd_lens.fileio import read_json

    path = Path(folder) / MANIFEST
    try:
        manifest = read_json(path)
    except ValueError as err:
        raise CacheError(f"{err}; {_MANIFEST_FIX.format(folder=Path(folder))}") from None
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise CacheError(f"{path}: {problem}; {_MANIFEST_FIX.format(folder=Path(folder))}")
    return {**manifest, "stream": upgrade_stream_record(manifest["stream"])}


_MANIFEST_FIX = "it was damaged or edited: restore it, or delete {folder} and cache again (mxd-lens cache)"


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a manifest's fields (None: nothing)."""
    import builtins
    import dataclasses

    if not isinstance(manifest, dict):
        return f"holds a JSON {type(manifest).__name__}, not an object"
    if manifest.get("dtype") not in CACHE_DTYPES:
        return f"dtype is {manifest.get('dtype')!r}, not one of {sorted(CACHE_DTYPES)}"
    stream = manifest.get("stream")
    if not isinstance(stream, dict):
        return f"stream is {stream!r}, not an object"
    stream = upgrade_stream_record(stream)
    fields = {f.name: f for f in dataclasses.fields(StreamInfo)}
    for name in stream.keys() - fields.keys():
        return f"stream.{name} is not a field of a stream (written by a newer mxd-lens?)"
    for name, f in fields.items():
        if name not in stream:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return f"stream.{name} is missing"
            continue
        value, kind = stream[name], getattr(builtins, str(f.type).split("[")[0])
        if name == "blocks":
            if not (isinstance(value, list) and value and all(_natural(b) for b in value)):
                return f"stream.blocks is {value!r}, not a list of block numbers"
        elif name in ("d_in", "d_out", "rows_per_shard", "context_size", "d_hidden"):
            if not (_natural(value) and (value > 0 or name == "d_hidden")):
                return f"stream.{name} is {value!r}, not a {'' if name == 'd_hidden' else 'positive '}integer"
        elif not isinstance(value, kind):
            return f"stream.{name} is {value!r}, not a {kind.__name__}"
    return None


def _natural(value: Any) -> bool:
    """Whether ``value`` is an integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


Shard = dict[int, tuple[torch.Tensor, torch.Tensor]]  # block -> (x [n, d_in], y [n, d_out])


class ModelActivations:
    """Shards of (MLP input, MLP output) at ``blocks``, computed by running ``model`` on token rows.

    ``rows`` is a zero-argument callable returning a fresh, deterministic iterator of [context_size]
    token rows (so a resumed run can start again and skip). ``drop_first_position`` drops position 0
    of every row (the BOS token, whose MLP output is an outlier that a replacement need not learn).
    ``writes`` is where the layers trained on it will write, so which output is the target:
    "hook_mlp_out" or "mlp" (the MLP module's own output); by default the MLP module on hosts whose
    blocks normalise the MLP output (Gemma-2/3, OLMo-2/3), else hook_mlp_out (``hooks.default_writes``).
    """

    def __init__(
        self,
        model: Any,
        blocks: Sequence[int],
        rows: Callable[[], Iterator[torch.Tensor]],
        context_size: int,
        rows_per_shard: int = StreamConfig.rows_per_shard,
        rows_per_forward: int = StreamConfig.rows_per_forward,
        drop_first_position: bool = True,
        writes: Writes | None = None,
    ):
        if not blocks:
            raise ValueError("ModelActivations needs at least one block")
        for block in blocks:
            hooks.check_block(model, block)
        if not 2 <= context_size <= model.cfg.n_ctx:
            raise ValueError(
                f"context_size={context_size} must be in 2..{model.cfg.n_ctx} (the model's n_ctx)"
            )
        if rows_per_shard <= 0 or rows_per_forward <= 0:
            raise ValueError(
                f"rows_per_shard={rows_per_shard} and rows_per_forward={rows_per_forward} must be positive"
            )
        self.model, self.blocks, self.rows = model, sorted(set(blocks)), rows
        self.writes: Writes = hooks.default_writes(model) if writes is None else writes
        hooks.out_hook(0, self.writes)  # a clear error for another value
        self.text_info: dict[str, Any] | None = None  # set by from_text: where the rows come from
        from mxd_lens.models import model_source

        self.model_source = model_source(model)  # where the model came from (load_model's record)
        self.rows_per_forward = min(rows_per_forward, rows_per_shard)
        self.info = StreamInfo(
            model_name=loadable_name(model),  # what the layers trained on it record: a name to load it by
            blocks=self.blocks,
            d_in=model.cfg.d_model,
            d_out=model.cfg.d_model,
            rows_per_shard=rows_per_shard,
            context_size=context_size,
            drop_first_position=drop_first_position,
            d_hidden=model.cfg.d_mlp,
            activation=model.cfg.act_fn,
            gated=bool(model.cfg.gated_mlp),
            hook_names={str(L): [hooks.mlp_in_hook(L), hooks.out_hook(L, self.writes)] for L in self.blocks},
        )

    @classmethod
    def from_text(
        cls,
        model: Any,
        blocks: Sequence[int],
        text: str,
        context_size: int = StreamConfig.context_size,
        eval_fraction: float = StreamConfig.eval_fraction,
        split_seed: int = StreamConfig.split_seed,
        **kwargs: Any,
    ) -> ModelActivations:
        """The stream of the 'train' side of ``text``'s document split, tokenized as ``model`` expects
        (BOS, and position 0 dropped when it is one). ``self.text_info`` records where it came from."""
        from mxd_lens import data

        token_rows = data.TokenRows.for_model(model, context_size)

        def rows() -> Iterator[torch.Tensor]:
            texts = data.split_texts(data.iter_texts(text), "train", eval_fraction, split_seed)
            return token_rows.rows(texts, name=f"{data.text_name(text)} (its train side)")

        kwargs.setdefault("drop_first_position", token_rows.prepend_bos)
        stream = cls(model, blocks, rows, context_size=context_size, **kwargs)
        local = data.resolve_text(text)
        stream.text_info = {
            "text": data.text_name(text),
            # a relative path also by its absolute one, so `mxd-lens eval` finds it from another folder
            **(
                {"path": str(local.resolve())}
                if local.exists() and not local.is_absolute() and data.text_name(text) == str(text)
                else {}
            ),  # fmt: skip
            "split": "train",
            "eval_fraction": eval_fraction,
            "split_seed": split_seed,
            "digests": data.source_digests(text),
        }
        return stream

    @classmethod
    def from_config(cls, model: Any, blocks: Sequence[int], config: StreamConfig) -> ModelActivations:
        """``from_text`` with ``config``'s text and settings (``config.model`` names ``model``; it is
        not loaded here)."""
        if not config.text:
            raise ValueError("a live stream needs a text (StreamConfig.text / --text)")
        return cls.from_text(
            model,
            blocks,
            config.text,
            config.context_size,
            eval_fraction=config.eval_fraction,
            split_seed=config.split_seed,
            rows_per_shard=config.rows_per_shard,
            rows_per_forward=config.rows_per_forward,
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> Shard:
        """Activations of a [rows, context] token batch, flattened to tokens."""
        if tokens.shape[-1] != self.info.context_size:
            raise ValueError(
                f"token rows have length {tokens.shape[-1]}, expected context_size={self.info.context_size}"
            )
        module_out = self.blocks if self.writes == "mlp" else ()
        with hooks.capture_mlp_io(self.model, self.blocks, module_out=module_out) as io:
            self.model(tokens.to(self.model.cfg.device), stop_at_layer=self.blocks[-1] + 1)
        start = int(self.info.drop_first_position)
        target = hooks.output_key(self.writes)
        out: Shard = {}
        for block in self.blocks:
            x, y = (io[block][key][:, start:].reshape(-1, io[block][key].shape[-1]) for key in ("in", target))
            out[block] = (x.float().cpu(), y.float().cpu())
        return out

    def shards(self, start: int = 0) -> Iterator[Shard]:
        """Shards ``start``, ``start + 1``, ...; ends when the rows run out (a partial shard is dropped)."""
        rows = self.rows()
        skip = start * self.info.rows_per_shard
        for _ in range(skip):
            if next(rows, None) is None:
                return
        while True:
            chunk = list(itertools.islice(rows, self.info.rows_per_shard))
            if len(chunk) < self.info.rows_per_shard:
                return
            parts = [
                self.forward(torch.stack(chunk[i : i + self.rows_per_forward]))
                for i in range(0, len(chunk), self.rows_per_forward)
            ]
            yield {
                L: (torch.cat([p[L][0] for p in parts]), torch.cat([p[L][1] for p in parts]))
                for L in self.blocks
            }

    epoch_tokens: int | None = None  # a live stream's length is not known up front; it is read once

    def windows(self, seed: int, start: int = 0) -> Iterator[Window]:
        """The live stream's windows: its shards in order, each permuted, from the one holding ``start``."""
        per_shard = self.info.tokens_per_shard
        first = start // per_shard
        for index, shard in enumerate(self.shards(start=first), start=first):
            _check_finite(shard, f"shard {index}")
            yield index * per_shard, _permuted(shard, _generator(seed, 0, index))


SHARD_PREFIX = "shard_"
OLD_SHARD_PREFIX = "block_"  # old-data reader: the shards' file names before the rename (read and extended)


def _shard_name(index: int, prefix: str = SHARD_PREFIX) -> str:
    return f"{prefix}{index:06d}.safetensors"


def _shard_index(name: str, prefix: str = SHARD_PREFIX) -> int | None:
    stem = name.removeprefix(prefix).removesuffix(".safetensors")
    if name.startswith(prefix) and name.endswith(".safetensors") and stem.isdigit():
        return int(stem)
    return None


def _present_shards(path: Path, prefix: str = SHARD_PREFIX) -> set[int]:
    return {i for f in path.glob(f"{prefix}*.safetensors") if (i := _shard_index(f.name, prefix)) is not None}


def _shard_prefix(path: Path) -> str:
    """How the cache at ``path`` names its shards: ``shard_*``, or ``block_*`` in a cache written
    before the rename (its files, or its checksum records, say so)."""
    if _present_shards(path, SHARD_PREFIX):
        return SHARD_PREFIX
    records = _read_records(path, strict=False) or {}
    if _present_shards(path, OLD_SHARD_PREFIX) or any(n.startswith(OLD_SHARD_PREFIX) for n in records):
        return OLD_SHARD_PREFIX
    return SHARD_PREFIX


def _digest(path: Path) -> str:
    return file_digest(path, "blake2b", digest_size=32)


def _record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "blake2b_256": _digest(path)}


def _read_records(path: Path, strict: bool = True) -> dict[str, dict[str, Any]] | None:
    """``{shard name: record}`` from ``shards.jsonl``; None for a cache written before it existed.

    A last line cut short (a killed append) is ignored; any other bad line is a :class:`CacheError`
    (``strict``) or skipped, its shard then treated as unrecorded (``write_cache`` re-checks those)."""
    file = path / SHARDS
    if not file.is_file():
        return None
    text = file.read_text()
    lines = text.split("\n")
    records: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            name, record = entry["shard"], {"bytes": int(entry["bytes"]), "blake2b_256": entry["blake2b_256"]}
        except (ValueError, KeyError, TypeError) as err:
            if number == len(lines) or not strict:  # the unterminated last line: an interrupted append
                continue
            raise CacheError(f"{file}: line {number} is not a shard record ({err}); {REPAIR}") from None
        records[name] = record
    return records


def _write_records(path: Path, records: dict[str, dict[str, Any]]) -> None:
    lines = [json.dumps({"shard": name, **records[name]}) + "\n" for name in sorted(records)]
    atomic_write_text(path / SHARDS, "".join(lines))


def _append_record(path: Path, name: str, record: dict[str, Any]) -> None:
    with open(path / SHARDS, "a") as f:  # one short write: a kill leaves at most one partial last line
        f.write(json.dumps({"shard": name, **record}) + "\n")


def _shard_problem(path: Path, record: dict[str, Any] | None, info: StreamInfo, dtype: str) -> str | None:
    """What is wrong with one shard (None: nothing). With its record: size and checksum (reads the
    file once); without one (a cache from before checksums): it loads, with the right tensors."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if record is not None:
        if size != record["bytes"]:
            return f"has {size:,} bytes, but {record['bytes']:,} were written (truncated or overwritten?)"
        if _digest(path) != record["blake2b_256"]:
            return "does not match the checksum recorded when it was written (its bytes changed on disk)"
        return None
    want = {
        f"{key}.{L}": (info.tokens_per_shard, d)
        for L in info.blocks
        for key, d in (("x", info.d_in), ("y", info.d_out))
    }
    try:
        with safe_open(path, framework="pt") as shard:
            if set(shard.keys()) != set(want):
                return f"holds tensors {sorted(shard.keys())}, not {sorted(want)}"
            for name, shape in want.items():
                tensor = shard.get_tensor(name)
                if tuple(tensor.shape) != shape or tensor.dtype != CACHE_DTYPES[dtype]:
                    return f"holds {name} as {tensor.dtype} {tuple(tensor.shape)}, not {dtype} {shape}"
    except Exception as err:  # safetensors raises its own error type for a bad header or short file
        return f"is not a readable safetensors file (truncated or damaged?): {err}"
    return None


def _writer_pid(path: Path) -> str | None:
    """The pid named in ``path/.lock`` while another process holds the writer's lock; None when no
    one writes ``path`` now (a shared lock cannot be taken while the writer holds its exclusive one)."""
    import fcntl

    lock = path / LOCK
    if not lock.is_file():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # unreadable lock file: nothing to learn from it
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock.read_text().strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextmanager
def cache_lock(path: str | Path) -> Iterator[None]:
    """Hold the writer's lock on the cache folder ``path`` (a ``filelock.FileLock`` on ``path/.lock``,
    which names the holder's pid); raise :class:`CacheLockedError` at once if another process holds it."""
    from filelock import FileLock, Timeout

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lock_file = path / LOCK
    lock = FileLock(lock_file, timeout=0, mode=0o666 & ~_umask())  # as open() would make it
    try:
        lock.acquire()
    except Timeout:
        holder = lock_file.read_text().strip() if lock_file.is_file() else ""
        raise CacheLockedError(
            f"{path} is being written by another process (pid {holder or 'unknown'}, per {lock_file}); "
            "wait for it to finish, or write to another folder"
        ) from None
    try:
        lock_file.write_text(f"{os.getpid()}\n")
        yield
    finally:
        lock_file.write_text("")
        lock.release()


def write_cache(
    source: ModelActivations,
    path: str | Path,
    n_shards: int,
    dtype: str = "float32",
    progress: bool = True,
    text_info: dict[str, Any] | None = None,
) -> Path:
    """Write the first ``n_shards`` shards of ``source`` to ``path``: ``manifest.json``, one file per
    shard and ``shards.jsonl``, each shard's size and checksum.

    Each shard is written to a temporary name and renamed, so a killed run leaves only whole shards.
    Running again with the same arguments checks the shards already there and recomputes those that
    are missing or damaged (a shard without a record, as from a killed run or a cache written before
    records, is kept if it loads with the right tensors). Writing into a cache made for another model,
    blocks or shard size is refused, and so is a second process writing the same folder at once.
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} not supported; choose one of {sorted(CACHE_DTYPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    manifest = {
        "stream": asdict(source.info),
        "dtype": dtype,
        "text": text_info,
        "format": "mxd_lens.activation_cache.v1",
        "model": getattr(source, "model_source", None),
    }
    with cache_lock(path):
        # Left by a killed run (no one else writes here while we hold the lock); block_*.tmp and
        # manifest.json.tmp are the fixed temporary names of older versions.
        for stale in [*path.glob(".*.tmp"), *path.glob("block_*.tmp"), path / f"{MANIFEST}.tmp"]:
            stale.unlink(missing_ok=True)
        manifest_path = path / MANIFEST
        if manifest_path.exists():
            existing = read_manifest(path)
            if "model" not in existing:  # written before the model's source was recorded: not a difference
                manifest.pop("model")
            elif isinstance(manifest["model"], dict) and isinstance(existing["model"], dict):
                # how the model was loaded, recorded since --dtype: older caches were made in float32
                old = existing["model"]
                manifest["model"] = {
                    k: v
                    for k, v in manifest["model"].items()
                    if k in old or k not in HOST_KEYS or k == "dtype"
                }
                if "dtype" not in old and manifest["model"].get("dtype") == "float32":
                    manifest["model"].pop("dtype", None)
            if _comparable(existing) != _comparable(manifest):
                there, asked = existing["stream"].get("hook_names") or {}, manifest["stream"]["hook_names"]
                moved = sorted(
                    f"{there[b][-1]} there, {asked[b][-1]} asked"
                    for b in there.keys() & asked.keys()
                    if there[b][-1:] != asked[b][-1:]
                )
                why = (
                    f"its targets are another output of the MLP ({'; '.join(moved)}: on Gemma-2/3 and "
                    "OLMo-2/3 layers now replace the MLP module, blocks.L.mlp.hook_out, see mxd_lens.hooks); "
                    if moved
                    else ""
                )
                raise ValueError(
                    f"{path} already holds a cache made with different settings:\n  there: {existing}\n  asked: {manifest}\n"
                    f"{why}write to a new folder, or delete this one"
                )
        else:
            _write_records(path, {})
            atomic_write_text(manifest_path, json.dumps(manifest, indent=2))
        found = _read_records(path, strict=False)
        records = dict(found or {})
        todo, adopted = [], []
        prefix = _shard_prefix(path)  # an older cache is extended under its own names
        present = _present_shards(path, prefix)
        checking = [i for i in range(n_shards) if i in present]
        for index in tqdm(
            checking, desc="checking cache", unit="shard", disable=not progress or not checking
        ):
            name = _shard_name(index, prefix)
            record = records.get(name)
            problem = _shard_problem(path / name, record, source.info, dtype)
            if problem is not None:
                warnings.warn(f"{path / name} {problem}; recomputing it", stacklevel=2)
                records.pop(name, None)
                todo.append(index)
            elif record is None:
                records[name] = _record(path / name)
                adopted.append(name)
        if adopted and found is None:
            warnings.warn(
                f"{path} was written before shards had checksums: its {len(adopted)} shards load with the "
                "right tensors and are recorded now, but what they held before cannot be checked",
                stacklevel=2,
            )
        todo = sorted(todo + [i for i in range(n_shards) if i not in present])
        _write_records(path, records)  # compacted: no partial line for the appends below to follow
        bar = tqdm(
            total=n_shards,
            initial=n_shards - len(todo),
            desc="caching activations",
            unit="shard",
            disable=not progress or not todo,
        )
        for run in _runs(todo):
            for index, shard in zip(run, source.shards(start=run[0]), strict=False):
                tensors = {}
                for block, (x, y) in shard.items():
                    tensors[f"x.{block}"] = x.to(CACHE_DTYPES[dtype]).contiguous()
                    tensors[f"y.{block}"] = y.to(CACHE_DTYPES[dtype]).contiguous()
                name, record = _shard_name(index, prefix), {}

                def write(
                    tmp: str, tensors: dict[str, torch.Tensor] = tensors, record: dict = record
                ) -> None:
                    save_file(tensors, tmp)
                    record.update(_record(Path(tmp)))

                atomic_write(path / name, write)
                records[name] = record
                _append_record(path, name, record)
                bar.update(1)
        bar.close()
        _write_records(path, records)
    written = sum(1 for i in range(n_shards) if (path / _shard_name(i, prefix)).exists())
    if written < n_shards:
        raise ValueError(
            f"the text ran out after {written} of {n_shards} shards; the cache at {path} holds {written}"
        )
    return path


HOST_KEYS = ("dtype", "prepend_bos", "special_tokens")  # how a model source says the model was loaded


def _comparable(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest as far as it decides the shards' content: the text by its digests and split, not by
    how its path was spelled (relative, absolute, a package resource name); the model by its identity."""
    from mxd_lens.models import model_identity

    text, model = manifest.get("text"), manifest.get("model")
    if isinstance(text, dict) and "digests" in text:
        text = {k: v for k, v in text.items() if k not in ("text", "path")}
    if isinstance(model, dict) and "kind" in model:  # which weights (not where they were read from), run how
        model = {**model_identity(model), **{k: model[k] for k in HOST_KEYS if k in model}}
    return {**manifest, "text": text, "model": model}


def _runs(indices: list[int]) -> list[list[int]]:
    """Sorted indices as runs of consecutive ones: [1, 2, 5] -> [[1, 2], [5]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class CachedActivations:
    """Shards read back from a cache written by :func:`write_cache` (no model needed).

    ``expect`` (e.g. ``{"model_name": ..., "d_in": ...}``) and ``blocks`` (the transformer blocks to
    read; default: all the cache holds) are checked against the manifest, with an error naming what
    differs. The cache holds shards 0 .. the last one on disk or recorded (at most ``max_shards``); one
    of them missing, or of another size than was written, is a
    :class:`CacheError` here, and a shard's checksum is checked the first time it is read.
    """

    def __init__(
        self,
        path: str | Path,
        blocks: Sequence[int] | None = None,
        expect: dict[str, Any] | None = None,
        *,
        max_shards: int | None = None,
        shuffle: str = "global",
        buffer_tokens: int = 65_536,
        chunk_tokens: int = 2_048,
    ):
        if shuffle not in ("global", "shard"):
            raise ValueError(f"shuffle={shuffle!r}: choose 'global' (across the cache) or 'shard'")
        if buffer_tokens <= 0 or chunk_tokens <= 0:
            raise ValueError(
                f"buffer_tokens={buffer_tokens} and chunk_tokens={chunk_tokens} must be positive"
            )
        if max_shards is not None and max_shards <= 0:
            raise ValueError(f"max_shards={max_shards} must be positive")
        self.shuffle, self.buffer_tokens, self.chunk_tokens = shuffle, buffer_tokens, chunk_tokens
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{self.path} is not an activation cache (no {MANIFEST}); write one with `mxd-lens cache`"
            )
        if (writer := _writer_pid(self.path)) is not None:
            raise CacheLockedError(
                f"{self.path} is still being written by `mxd-lens cache` (pid {writer}, per {self.path / LOCK}): "
                "it holds only the shards written so far; wait for it to finish, then start again"
            )
        manifest = read_manifest(self.path)
        self.info = StreamInfo.from_dict(manifest["stream"])
        self.dtype = manifest["dtype"]
        self.text_info = manifest.get("text")  # where the cached text came from, for overlap checks
        self.model_source = manifest.get("model")  # where the model came from (None: an older cache)
        cached = set(self.info.blocks)
        self.blocks = sorted(set(blocks)) if blocks is not None else list(self.info.blocks)
        if not set(self.blocks) <= cached:
            raise ValueError(
                f"{self.path} caches blocks {sorted(cached)}, not {sorted(set(self.blocks) - cached)}"
            )
        for key, value in (expect or {}).items():
            if getattr(self.info, key) != value:
                raise ValueError(
                    f"{self.path} was cached with {key}={getattr(self.info, key)!r}, but this run asks for {value!r}"
                )
        self.records = _read_records(self.path)  # None: written before shards had checksums
        self.shard_prefix = _shard_prefix(self.path)
        present = _present_shards(self.path, self.shard_prefix)
        known = present | {
            i for name in self.records or {} if (i := _shard_index(name, self.shard_prefix)) is not None
        }
        self.n_shards = max(known, default=-1) + 1
        if max_shards is not None:
            self.n_shards = min(self.n_shards, max_shards)
        if self.n_shards == 0:
            raise ValueError(f"{self.path} holds no complete shard yet")
        problems = []
        for index in range(self.n_shards):
            name = self.shard_name(index)
            record = (self.records or {}).get(name)
            if index not in present:
                why = ["recorded as written"] if record else []
                why += ["later shards are present"] if max(present, default=-1) > index else []
                problems.append(f"{self.path / name} is missing ({', '.join(why)})")
            elif record is not None and (size := (self.path / name).stat().st_size) != record["bytes"]:
                problems.append(
                    f"{self.path / name} has {size:,} bytes, but {record['bytes']:,} were written "
                    "(truncated or overwritten?)"
                )
        if problems:
            shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
            raise CacheError(f"{self.path} is damaged:\n  " + "\n  ".join(shown) + f"\n{REPAIR}")
        self.unrecorded = [i for i in range(self.n_shards) if self.shard_name(i) not in (self.records or {})]
        if self.unrecorded:
            warnings.warn(
                f"{self.path}: {len(self.unrecorded)} shard(s) have no checksum record "
                f"({'a cache written before records' if self.records is None else 'an interrupted write'}), "
                f"so only that they load can be checked; to record them, {REPAIR}",
                stacklevel=2,
            )
        self._verified: set[int] = set()

    def shard_name(self, index: int) -> str:
        """The file name of shard ``index`` in this cache."""
        return _shard_name(index, self.shard_prefix)

    @property
    def epoch_tokens(self) -> int:
        """Tokens in one pass over the cache."""
        return self.n_shards * self.info.tokens_per_shard

    def _problem(self, index: int) -> str | None:
        record = (self.records or {}).get(self.shard_name(index))
        return _shard_problem(self.path / self.shard_name(index), record, self.info, self.dtype)

    def _load(self, index: int, lo: int = 0, hi: int | None = None) -> Shard:
        """Tokens ``lo:hi`` of shard ``index``, its file checked the first time it is read here."""
        shard_path = self.path / self.shard_name(index)
        if index not in self._verified:
            problem = self._problem(index)
            if problem is not None:
                raise CacheError(f"{shard_path} {problem}; {REPAIR}")
            self._verified.add(index)
        try:
            with safe_open(shard_path, framework="pt") as shard:
                if lo == 0 and hi is None:
                    return {
                        L: (shard.get_tensor(f"x.{L}").float(), shard.get_tensor(f"y.{L}").float())
                        for L in self.blocks
                    }
                return {
                    L: tuple(shard.get_slice(f"{key}.{L}")[lo:hi].float() for key in ("x", "y"))  # type: ignore[misc]
                    for L in self.blocks
                }
        except Exception as err:  # changed since it was checked: safetensors' own error, a short file...
            raise CacheError(f"{shard_path} could not be read ({err}); {REPAIR}") from err

    def read(self, shard: int, lo: int = 0, hi: int | None = None) -> Shard:
        """Tokens ``lo:hi`` of one shard (only those bytes are read from its file, after the whole
        file's checksum is checked on its first read)."""
        return self._load(shard, lo, hi)

    def verify(self, progress: bool = False) -> list[str]:
        """Check every shard against its record (size and checksum: reads the whole cache); the
        problems found, one line each naming the shard (empty: the cache is whole)."""
        problems = []
        for index in tqdm(range(self.n_shards), desc="verifying cache", unit="shard", disable=not progress):
            problem = self._problem(index)
            if problem is None:
                self._verified.add(index)
            else:
                self._verified.discard(index)
                problems.append(f"{self.path / self.shard_name(index)} {problem}")
        return problems

    def windows(self, seed: int, start: int = 0) -> Iterator[Window]:
        """Windows of every epoch, without end, from the one holding stream offset ``start``.

        ``global``: each epoch permutes the (shard, chunk) pieces with a generator seeded by
        (seed, epoch), groups them into windows of about ``buffer_tokens`` tokens and permutes each
        window's tokens by (seed, epoch, window). ``shard``: the shards in order, each a window, as a
        live stream reads them (epoch 0 of a cache equals the live stream it was written from).
        """
        per_shard = self.info.tokens_per_shard
        if self.shuffle == "shard":
            pieces = [[(s, 0, per_shard)] for s in range(self.n_shards)]
            plans = lambda epoch: pieces  # noqa: E731  (the same windows every epoch)
        else:
            chunks = [
                (s, lo, min(lo + self.chunk_tokens, per_shard))
                for s in range(self.n_shards)
                for lo in range(0, per_shard, self.chunk_tokens)
            ]
            per_window = max(1, self.buffer_tokens // self.chunk_tokens)

            def plans(epoch: int) -> list[list[tuple[int, int, int]]]:
                order = torch.randperm(len(chunks), generator=_generator(seed, epoch, -1)).tolist()
                return [
                    [chunks[i] for i in order[w : w + per_window]] for w in range(0, len(order), per_window)
                ]

        epoch = start // self.epoch_tokens
        epoch_start = epoch * self.epoch_tokens
        while True:
            plan, position = plans(epoch), epoch_start
            for w, pieces_w in enumerate(plan):
                size = sum(hi - lo for _, lo, hi in pieces_w)
                if position + size <= start:  # wholly before the resume point: never read
                    position += size
                    continue
                parts = [self.read(s, lo, hi) for s, lo, hi in pieces_w]
                for (s, lo, hi), part in zip(pieces_w, parts, strict=True):  # naming the file at fault
                    _check_finite(part, f"{self.path / self.shard_name(s)} (its tokens {lo:,} to {hi:,})")
                window = {
                    L: (torch.cat([p[L][0] for p in parts]), torch.cat([p[L][1] for p in parts]))
                    for L in self.blocks
                }
                yield position, _permuted(window, _generator(seed, epoch, w))
                position += size
            epoch += 1
            epoch_start += self.epoch_tokens

    def shards(self, start: int = 0) -> Iterator[Shard]:
        """Shards ``start``, ``start + 1``, ... to the cache's last, whole and in order."""
        for index in range(start, self.n_shards):
            yield self._load(index)


Window = tuple[int, Shard]  # (stream offset of the window's first token, its permuted tokens)


def open_stream(
    config: StreamConfig,
    cache: str | Path | None = None,
    blocks: Sequence[int] | None = None,
    shuffle: str = "global",
) -> tuple[ModelActivations | CachedActivations, Any]:
    """The activations a run trains on, and the host model where one is asked for: the cache at
    ``cache`` (``config.model``, if given, must be the model the cache was made with: it is loaded only
    for what needs the weights, e.g. ``init="mlp"``), or ``config.model`` run live over ``config.text``.
    Returns ``(source, model)``, model None for a cache read without one. The one place where a cache,
    a model and a stream are checked to agree; each refusal names what to give instead.

    In the order of their cost: the cache is opened (and checked) before the model is loaded, once;
    the model is then held against the cache, or run over the text."""
    from mxd_lens.config import parse_blocks
    from mxd_lens.models import load_host, model_identity

    if cache is None and not (config.model and config.text):
        raise ValueError("give --cache DIR, or --model and --text to stream from the model")
    # ``blocks``: numbers, ranges or "all" (parse_blocks); "all" of a cache is every block it holds
    cached = (
        CachedActivations(cache, blocks=parse_blocks(blocks), shuffle=shuffle) if cache is not None else None
    )
    if cached is not None and config.dtype is not None and config.dtype != cached.dtype:
        ran = (cached.model_source or {}).get("dtype", "float32")
        logging.getLogger(__name__).warning(
            "--dtype %s does not change the activations: the cache %s fixes their dtype (%s, from the model "
            "run in %s)%s; to train on %s activations, write a cache with `mxd-lens cache --dtype %s`",
            config.dtype, cache, cached.dtype, ran,
            f"; --dtype only loads --model {config.model}" if config.model else "",
            config.dtype, config.dtype,
        )  # fmt: skip
    model = load_host(config) if config.model else None
    if cached is None:
        blocks = parse_blocks(blocks, model.cfg.n_layers)
        if not blocks:
            raise ValueError("a live stream needs blocks: numbers, ranges such as 0-29, or all (--blocks)")
    if cached is not None and model is not None:
        made_with, here = model_identity(cached.model_source or {}), model_identity(model)
        if "kind" in made_with and made_with != here:
            raise ValueError(
                f"--model {config.model} is {here}, but the cache {cache} was made with {made_with}; give "
                "the cache's model or leave --model out"
            )
        if not is_named(model, cached.info.model_name):
            raise ValueError(
                f"--model {config.model} is {model.cfg.model_name!r}, but the cache {cache} was made with "
                f"{cached.info.model_name!r}; give the cache's model or leave --model out"
            )
    if cached is None:
        return ModelActivations.from_config(model, blocks or [], config), model
    return cached, model


def _permuted(shard: Shard, generator: torch.Generator) -> Shard:
    n = next(iter(shard.values()))[0].shape[0]
    order = torch.randperm(n, generator=generator)
    return {L: (x[order], y[order]) for L, (x, y) in shard.items()}


def _generator(seed: int, epoch: int, window: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_003 + window)


def _check_finite(shard: Shard, where: str) -> None:
    for block, (x, y) in shard.items():
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise FloatingPointError(f"non-finite activations at block {block} in {where}")


def shuffled_batches(
    source: ModelActivations | CachedActivations, batch_tokens: int, seed: int, start: int = 0
) -> Iterator[Shard]:
    """Batches {block: (x [batch_tokens, d_in], y [batch_tokens, d_out])} of the shuffled stream,
    beginning ``start`` tokens into it (a multiple of ``batch_tokens`` to resume at a step).

    Inputs and targets are permuted together. A live stream ends when its text does (a last partial
    batch is dropped); a cache's stream runs for as many epochs as are read from it.
    """
    if batch_tokens <= 0 or start < 0:
        raise ValueError(f"need batch_tokens={batch_tokens} > 0 and start={start} >= 0")
    parts: list[Shard] = []
    held = 0
    for offset, window in source.windows(seed, start):
        n = next(iter(window.values()))[0].shape[0]
        skip = max(0, start - offset)
        if skip >= n:
            continue
        if skip:
            window = {L: (x[skip:], y[skip:]) for L, (x, y) in window.items()}
            n -= skip
        lo = 0
        while held + (n - lo) >= batch_tokens:
            take = batch_tokens - held
            parts.append({L: (x[lo : lo + take], y[lo : lo + take]) for L, (x, y) in window.items()})
            lo += take
            yield (
                parts[0]
                if len(parts) == 1
                else {
                    L: (torch.cat([p[L][0] for p in parts]), torch.cat([p[L][1] for p in parts]))
                    for L in window
                }
            )
            parts, held = [], 0
        if lo < n:
            parts.append({L: (x[lo:], y[lo:]) for L, (x, y) in window.items()})
            held += n - lo

"""Reading a host model's weights into the dtype it will run in, one tensor at a time (issue 57).

Loading in bfloat16 used to cost more than loading in float32. transformers' ``from_pretrained(folder,
dtype=...)`` memory-maps every safetensors file and keeps the maps open until the whole model is loaded,
so every page of a float32 file read for a bfloat16 model stayed resident beside it; TransformerLens 3.9's
``load_and_process_state_dict`` then cast the whole state dict to float32 and back; and a GGUF was
converted by building the whole model in float32. Here:

- :func:`read_hf_model`: transformers' model of a folder in ``dtype``. Where the files hold another dtype,
  each safetensors tensor is read with plain file reads (no memory map) straight into a tensor of
  ``dtype``, through a 4 MiB buffer (never a float32 copy of itself); transformers still builds the model
  (its key renames, tied weights, buffers) from that state dict. Where they hold ``dtype`` already,
  ``from_pretrained`` reads them as before: its parameters are the mapped pages, no copy.
- :func:`load_unprocessed`: the TL state dict copied into the TL model key by key, without TL's float32
  round trip; the unembedding held so that TL's forward does not copy it (:func:`_unembedding_by_rows`).
- :func:`write_gguf_as_folder`: a GGUF's tensors read, dequantised, processed and renamed one at a time by
  transformers' own GGUF tensor processors and written to float32 safetensors shards of at most
  ``SHARD_BYTES``; nothing holds the whole model.

Peak resident memory of ``load_model`` is then the imports plus about twice the weights in the chosen
dtype (transformers' model and the TransformerLens model converted from it): docs/models.md has the
measurements (``benchmarks/load_memory.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # the largest buffer a tensor read into another dtype passes through
SHARD_BYTES = 2 << 30  # a converted GGUF's safetensors shards (save_pretrained's are larger)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def _read_into(f: Any, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous tensor ``out`` with the bytes of the open file ``f`` from ``offset``."""
    _fill(f, offset, memoryview(out.view(-1).view(torch.uint8).numpy()), f"a tensor at byte {offset}")


def _fill(f: Any, offset: int, view: memoryview, what: str) -> None:
    """Read ``len(view)`` bytes of the open file ``f`` from ``offset`` into ``view``; an OSError naming the
    file and ``what`` if it ends first."""
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{f.name}: ends {len(view) - done} bytes short of {what}")
        done += n


_STAGING = threading.local()


def _staging() -> torch.Tensor:
    """This thread's ``CHUNK_BYTES`` buffer for reading into another dtype, allocated once: a buffer
    allocated per tensor left holes in the heap between the tensors read (0.35 GB for a 1B model)."""
    if getattr(_STAGING, "buffer", None) is None:
        _STAGING.buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    return _STAGING.buffer


class LazyTensor:
    """One tensor of a safetensors file, read when indexed (``t[...]``, as transformers reads a
    ``safe_open`` slice), in ``dtype`` when it is a floating tensor, else in its own dtype."""

    def __init__(
        self, path: Path, shape: list[int], file_dtype: torch.dtype, offset: int, dtype: torch.dtype
    ):
        self.path, self.shape, self.file_dtype, self.offset = path, list(shape), file_dtype, offset
        self.dtype = dtype if file_dtype.is_floating_point else file_dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def read(self) -> torch.Tensor:
        """The tensor, in ``self.dtype``: read straight into it where the file holds that dtype, else a
        chunk of at most ``CHUNK_BYTES`` at a time through a buffer of the file's dtype."""
        out = torch.empty(self.shape, dtype=self.dtype)
        flat = out.view(-1)
        with open(self.path, "rb", buffering=0) as f:
            if self.file_dtype == self.dtype:
                _read_into(f, self.offset, flat)
                return out
            size = self.file_dtype.itemsize
            step = CHUNK_BYTES // size
            buffer = _staging().view(self.file_dtype)
            for start in range(0, flat.numel(), step):
                part = buffer[: min(step, flat.numel() - start)]
                _read_into(f, self.offset + start * size, part)
                flat[start : start + part.numel()].copy_(part)
        return out

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.read()
        return tensor if index is Ellipsis else tensor[index]


def safetensors_files(folder: Path) -> list[Path] | None:
    """The safetensors files of ``folder``'s weights (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names), or None where it has neither."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return None


def lazy_state_dict(files: list[Path], dtype: torch.dtype, keep: Any = None) -> dict[str, LazyTensor] | None:
    """{name: LazyTensor} over the safetensors ``files``, floating tensors to be read in ``dtype`` (in the
    file's dtype where ``keep(name)``); None if a file holds a dtype this reader does not know (FP8, ...)."""
    state: dict[str, LazyTensor] = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, info in header.items():
            file_dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if file_dtype is None:
                return None
            begin = 8 + length + info["data_offsets"][0]
            wanted = file_dtype if keep is not None and keep(name) else dtype
            state[name] = LazyTensor(path, info["shape"], file_dtype, begin, wanted)
    return state


def _kept_in_float32(model_class: type, dtype: torch.dtype) -> Any:
    """Which checkpoint keys transformers keeps in float32 for ``model_class`` in ``dtype`` (its
    ``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` for float16): read in the file's dtype
    (transformers casts them); None where there are none."""
    modules = set(getattr(model_class, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        modules |= set(getattr(model_class, "_keep_in_fp32_modules", None) or [])
    if dtype == torch.float32 or not modules:
        return None
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(m) for m in sorted(modules)) + r")(\.|$)")
    return lambda name: pattern.search(name) is not None


def read_hf_model(folder: Path, config: Any, dtype: torch.dtype) -> Any:
    """transformers' causal LM of ``folder`` (its ``config``, as AutoConfig read it), in ``dtype``, every
    safetensors tensor read into ``dtype`` without a memory map or a float32 copy (:class:`LazyTensor`).

    Read by ``from_pretrained(folder)`` itself where the files hold ``dtype`` already (its parameters are
    then the mapped files' pages, no copy, all given back when it is freed), and where the folder has no
    safetensors weights (transformers refuses pickles) or a dtype or quantization this reader does not
    handle."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    files = safetensors_files(folder)
    try:
        model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except KeyError:  # a config class transformers maps to no causal LM: its own error, below
        model_class = files = None
    state = None
    if files is not None and getattr(config, "quantization_config", None) is None:
        state = lazy_state_dict(files, dtype, _kept_in_float32(model_class, dtype))
    if state is None or all(t.file_dtype == t.dtype for t in state.values()):
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, trust_remote_code=False
        ).eval()
    with _one_thread_loading():
        model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    model.config.name_or_path = str(folder)
    return model.eval()


@contextmanager
def _one_thread_loading() -> Iterator[None]:
    """transformers reads the tensors in the calling thread (``HF_DEACTIVATE_ASYNC_LOAD``): its worker
    threads each allocate from their own malloc arena, which left about 0.3 GB more resident for a 1B
    model in bfloat16 (benchmarks/load_memory.py), for no gain in speed on a few cores."""
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


def load_unprocessed(model: Any, state_dict: dict[str, torch.Tensor]) -> None:
    """TransformerLens's ``load_and_process_state_dict`` with no processing (no folding, no centering):
    missing keys filled, then the tensors copied into ``model`` one key at a time, each dropped from
    ``state_dict`` once copied. TL 3.9's version first casts the whole state dict to float32 and back
    (``ProcessWeights.process_weights`` upcasts every tensor for its folds, even when it has none to do):
    a float32 copy of the whole model in a half dtype, for values that come back unchanged."""
    state_dict = model.fill_missing_keys(state_dict)
    for key in list(state_dict):
        value = state_dict.pop(key)
        if key == "unembed.W_U" and value.dim() == 2:
            _unembedding_by_rows(model, value)
        else:
            model.load_state_dict({key: value}, strict=False)


def _unembedding_by_rows(model: Any, W_U: torch.Tensor) -> None:
    """``model.unembed.W_U`` := ``W_U`` ([d_model, d_vocab]), held as the transposed view of a contiguous
    [d_vocab, d_model] tensor (the layout of transformers' ``lm_head.weight``). TL 3.9's ``Unembed``
    computes ``F.linear(x, W_U.T.contiguous())``: with W_U held that way ``.contiguous()`` copies nothing,
    where it otherwise copies the whole unembedding at every forward (vocabulary × d_model: 262 MB for
    the 1B benchmark model in float32, 1 GB for a 128k vocabulary at d_model 4096 in bfloat16). The
    values and the product are the same."""
    old = model.unembed.W_U
    rows = torch.empty(W_U.shape[::-1], dtype=old.dtype, device=old.device)
    rows.copy_(W_U.T)
    model.unembed.W_U = torch.nn.Parameter(rows.T, requires_grad=old.requires_grad)


# ------------------------------------------------------------------------------------------- GGUF


def _read_gguf_tensor(f: Any, tensor: Any) -> np.ndarray:
    """The raw data of a ``GGUFReader`` tensor, read from the open file ``f`` (not through the reader's
    memory map, whose pages would stay resident): same dtype and shape as ``tensor.data``."""
    out = np.empty(tensor.data.shape, dtype=tensor.data.dtype)
    if out.nbytes != tensor.n_bytes:
        raise ValueError(
            f"GGUF tensor {tensor.name}: {out.nbytes} bytes expected, the file says {tensor.n_bytes}"
        )
    _fill(f, tensor.data_offset, memoryview(out.reshape(-1).view(np.uint8)), f"tensor {tensor.name}")
    return out


class _ShardWriter:
    """Safetensors shards of at most ``limit`` bytes in ``folder``, written as tensors arrive, named and
    indexed as ``save_pretrained`` names them when ``close`` is called."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.written: list[tuple[Path, list[str], int]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self._pending_bytes() + size > self.limit:
            self._flush()
        self.pending[name] = tensor.contiguous()

    def _pending_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f".shard-{len(self.written)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        size = self._pending_bytes()
        self.written.append((path, list(self.pending), size))
        self.pending = {}

    def close(self) -> list[str]:
        if self.pending:
            self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.folder / "model.safetensors")
            return self.written[0][1]
        weight_map, total, n = {}, 0, len(self.written)
        for i, (path, names, size) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
            total += size
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2), encoding="utf-8"
        )
        return list(weight_map)


def write_gguf_as_folder(gguf_path: Path, config: Any, folder: Path, shard_bytes: int | None = None) -> bool:
    """Write ``gguf_path``'s weights to ``folder`` as float32 safetensors (shards of at most
    ``shard_bytes``, default ``SHARD_BYTES``) with ``config`` (the AutoConfig transformers reads from the GGUF), as
    ``from_pretrained(gguf_file=...)`` + ``save_pretrained`` would, one tensor at a time: each is read
    from the file, dequantised, processed (llama.cpp's Q/K row order undone, Gemma's norm offset, ...)
    and renamed by transformers' own GGUF tensor processors. False (nothing written) where this
    transformers has no such processors or the file's tensors do not cover the model's parameters (the
    caller then converts the whole model at once)."""
    import gguf
    from transformers import AutoModelForCausalLM

    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
            read_field,
        )
    except ImportError:
        return False
    reader = gguf.GGUFReader(gguf_path)
    architecture = read_field(reader, "general.architecture")[0]
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    if any(hasattr(processor, m) for m in ("_set_moe_expert_tensor", "_split_moe_expert_tensor")):
        return False  # processors that gather tensors across the file (mixtures of experts)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    writer = _ShardWriter(folder, shard_bytes or SHARD_BYTES)
    with open(gguf_path, "rb", buffering=0) as f:
        for tensor in reader.tensors:
            weights = gguf.dequantize(_read_gguf_tensor(f, tensor), tensor.tensor_type)
            direct: dict[str, Any] = {"tensors": {}}  # a processor may store one itself (GPT-2's output)
            result = processor.process(
                weights=weights, name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=direct
            )
            found = dict(direct["tensors"])
            if result.name in mapping:
                found[mapping[result.name]] = result.weights
            for name, value in found.items():
                value = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
                writer.add(name, value.to(torch.float32))
            del weights, result, found
    names = set(writer.close())
    tied = {key for key in expected - names if _tied(skeleton, key)}
    missing = expected - names - tied - _buffers(skeleton)
    if missing:
        log.info(
            "mxd_lens: %s: tensors missing after a streamed conversion: %s", gguf_path, sorted(missing)[:5]
        )
        for path in folder.glob("*.safetensors"):
            path.unlink()
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)
        return False
    # The config save_pretrained would write: the model's class, float32, no quantization.
    from transformers import GenerationConfig

    config = type(config).from_dict(config.to_dict())
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    if skeleton.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(folder)
    return True


def _tied(model: Any, key: str) -> bool:
    """Whether ``key`` is a parameter transformers ties to another (the unembedding of a tied model)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    output = model.get_output_embeddings()
    return output is not None and any(
        key == f"{name}.weight" for name, m in model.named_modules() if m is output
    )


def _buffers(model: Any) -> set[str]:
    return {name for name, _ in model.named_buffers()}

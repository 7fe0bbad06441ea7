"""Export TopK transcoders and skip transcoders to circuit-tracer's transcoder-set format.

``export_circuit_tracer(layers, out)`` writes the folder circuit-tracer's loader reads (checked
against circuit-tracer 0.5.0, ``circuit_tracer/utils/hf_utils.py`` and ``utils/caching.py``):

- ``layer_{block}.safetensors``, one per block, holding exactly the tensors of circuit-tracer's
  ``SingleLayerTranscoder`` (its loader calls ``load_state_dict`` strictly, so no other key):
  ``W_enc`` [F, d] (ours transposed: circuit-tracer encodes ``F.linear(x, W_enc, b_enc)``),
  ``W_dec`` [F, d], ``b_enc`` [F], ``b_dec`` [d], and for skip transcoders ``W_skip`` [d, d] (ours
  transposed: circuit-tracer adds ``x @ W_skip.T``). The loader finds them by that name beside
  ``config.yaml`` (it globs ``layer_*.safetensors`` and reads the block from the name), so
  ``config.yaml`` lists no paths: its ``transcoders`` list, where present, is read as paths taken
  verbatim (hub URIs, or paths relative to the working directory, not to ``config.yaml``).
- ``config.yaml`` with the keys the loader reads: ``model_kind: transcoder_set``; ``scan``, the id
  of this set (see below); ``feature_input_hook: mlp.hook_in`` and ``feature_output_hook:
  hook_mlp_out`` (what our layers read and write, relative to ``blocks.L``; ``mlp.hook_out``, the MLP
  module's output, for layers that write there: Gemma-2/3 and OLMo-2/3, ``mxd_lens.hooks``; a set
  shares one); ``model_name`` (the
  default ``--model`` of ``circuit-tracer attribute``); ``activation: topk`` and ``k``. Ours besides,
  which the loader ignores: ``exported_by: mxd-lens`` and ``blocks``.

Position 0: circuit-tracer's attribution zeroes every feature there (``encode_sparse(...,
zero_positions=slice(0, 1))`` in ``transcoder/single_layer_transcoder.py``), so the MLP's output at BOS
becomes its error node, as ``mxd_lens.splice`` keeps the MLP there for a layer trained without it
(``mxd_lens.hooks.first_position``); a layer that trained on position 0 loses its features there.

``scan`` identifies the transcoders an attribution graph was made with: circuit-tracer copies it
into ``ReplacementModel.scan`` and every graph's metadata, and its graph viewer looks the features'
examples up under it. A local set keeps ours (``mxd-lens-<model>-<architecture>-k<K>-w<width>``);
loading from a hub repository replaces it with the repository's id.

To load it in circuit-tracer, give the folder's ABSOLUTE path (a hub repository id after uploading
it also works). circuit-tracer takes a path for a cache entry, joined onto its cache folder
(``$CIRCUIT_TRACER_CACHE_DIR`` or ``~/.cache/circuit_tracer``): an absolute path stays itself, but
a relative one lands in that cache folder and, not found there, is then tried as a hub repository::

    from circuit_tracer import ReplacementModel
    from circuit_tracer.transcoder.activation_functions import TopK
    from circuit_tracer.utils.hf_utils import load_transcoder_from_hub

    transcoders, config = load_transcoder_from_hub("/abs/path/to/export")  # or "user/repo"
    for transcoder in transcoders:  # circuit-tracer 0.5.0 loads a local set with ReLU: set TopK
        transcoder.activation_function = TopK(config["k"])
    model = ReplacementModel.from_pretrained_and_transcoders(config["model_name"], transcoders)

The TopK line is needed: the released circuit-tracer 0.5.0 never reads ``activation``/``k`` and
applies a plain ReLU (every positive pre-activation, not the k largest); its later source reads them
only when loading from a hub repository. ``ReplacementModel.from_pretrained(model_name,
"/abs/path/to/export")`` and ``circuit-tracer attribute -t /abs/path/to/export`` load the set the
same way, so they run it with ReLU.

Two differences to know:

- circuit-tracer's ``TopK`` keeps the k largest pre-activations as they are; ours keeps the k
  largest after a ReLU. The two agree wherever at least k pre-activations are positive (the usual
  case for a trained layer); where fewer are, circuit-tracer also keeps some negative ones.
- ``TranscoderSet`` and ``ReplacementModel`` want a transcoder at every block 0..N-1 of the model; a
  partial set is written (each file loads alone with circuit-tracer's ``load_relu_transcoder``,
  ``load_transcoder`` after 0.5.0) with a warning.

An MxD has no fixed decoder vectors (an expert adds an input-dependent full-rank map), so it has no
transcoder-set form: its attribution is the expert-level attribution of ``mxd_lens`` (the
attribution issue), not circuit-tracer's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"  # the name circuit-tracer's loader looks for


def layer_file(block: int) -> str:
    """The file name circuit-tracer's loader reads block ``block``'s transcoder from."""
    return f"layer_{block}.safetensors"


def circuit_tracer_scan(model_name: str, layer: Any) -> str:
    """The ``scan`` id of a set of layers like ``layer`` on ``model_name``: which transcoders an
    attribution graph used (circuit-tracer keeps it in the graph; its viewer finds the features'
    examples under it). Letters, digits and ``._-`` only: no ``/``, ``//`` or ``@``, which the viewer
    would read as a hub repository, subfolder or revision."""
    from mxd_lens.layers import TopKSkipTranscoder

    kind = "topk-skip-transcoder" if isinstance(layer, TopKSkipTranscoder) else "topk-transcoder"
    raw = f"mxd-lens-{model_name or 'model'}-{kind}-k{int(layer.cfg.k)}-w{int(layer.cfg.d_sae)}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-")


def circuit_tracer_tensors(layer: Any) -> dict[str, Any]:
    """The ``SingleLayerTranscoder`` tensors of one TopK (skip) transcoder, float32, contiguous."""
    from mxd_lens.layers import BatchTopKTranscoder, MxD, TopKSkipTranscoder, TopKTranscoder

    if isinstance(layer, MxD):
        raise TypeError(
            "an MxD has no transcoder-set form: each expert adds an input-dependent full-rank map "
            "(D diag(c_n))^T z, not a fixed decoder vector, so circuit-tracer cannot represent it; "
            "export TopK transcoders or skip transcoders, and use mxd-lens's expert attribution for MxD"
        )
    if isinstance(layer, BatchTopKTranscoder):
        raise TypeError(
            "a BatchTopK transcoder runs as JumpReLU at its learned threshold, which this transcoder set "
            "(activation: topk) cannot say; export TopK transcoders or skip transcoders"
        )
    if not isinstance(layer, TopKTranscoder | TopKSkipTranscoder):
        raise TypeError(f"{type(layer).__name__} is not a TopK transcoder or skip transcoder")
    tensors = {
        "W_enc": layer.W_enc.detach().T,
        "W_dec": layer.W_dec.detach(),
        "b_enc": layer.b_enc.detach(),
        "b_dec": layer.b_dec.detach(),
    }
    if isinstance(layer, TopKSkipTranscoder):
        tensors["W_skip"] = layer.W_skip.detach().T
    return {k: v.float().contiguous().cpu() for k, v in tensors.items()}


def _check_replaceable(out: Path) -> None:
    """``out`` may be written: absent, an empty folder, or an earlier export (replaced whole)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the transcoder set")
    if not out.is_dir() or not any(out.iterdir()):
        return
    names = {p.name for p in out.iterdir()}
    earlier = (out / CONFIG_FILE).is_file() and "exported_by: mxd-lens" in (out / CONFIG_FILE).read_text()
    if not earlier or any(
        n != CONFIG_FILE and not (n.startswith("layer_") and n.endswith(".safetensors")) for n in names
    ):
        raise ValueError(
            f"--out {out} is not empty and is not an earlier mxd-lens export; give an empty or new folder"
        )


def export_circuit_tracer(layers: Sequence[str | Path] | str | Path, out: str | Path) -> Path:
    """Write ``layers`` (saved folders, or folders holding them) as a circuit-tracer transcoder set
    in ``out``: ``config.yaml`` (with ``scan``, the set's id) and ``layer_{block}.safetensors``; see
    the module docstring. They must share K, width and skip-ness, be trained on one model and replace
    distinct blocks. ``out`` must be new, empty or an earlier export, which is replaced whole (written
    beside it, then swapped in). Returns ``out`` as an ABSOLUTE path: the form circuit-tracer loads a
    local set from (a relative path is looked up in its cache folder instead), as in
    ``load_transcoder_from_hub(str(export_circuit_tracer(layers, out)))`` and then setting each
    transcoder's ``activation_function`` to ``TopK(config["k"])`` (module docstring)."""
    import yaml
    from safetensors.torch import save_file

    from mxd_lens import hook_names
    from mxd_lens.fileio import _umask, atomic_write, atomic_write_text
    from mxd_lens.hooks import block_of, writes_of
    from mxd_lens.layers.io import layer_folders, load_layer
    from mxd_lens.models import model_identity
    from mxd_lens.records import TrainingRecord, canonical_model_name

    loaded = [(folder, load_layer(folder)) for folder in layer_folders(layers)]
    by_block: dict[int, tuple[Path, Any]] = {}
    for folder, layer in loaded:
        block = block_of(layer)
        if block in by_block:
            raise ValueError(
                f"{folder} and {by_block[block][0]} both replace block {block}; export one per block"
            )
        by_block[block] = (folder, layer)
    shapes = {(type(layer).__name__, layer.cfg.k, layer.cfg.d_sae) for _, layer in by_block.values()}
    if len(shapes) > 1:
        raise ValueError(f"a transcoder set has one architecture, K and width; got {sorted(shapes)}")
    sites = {writes_of(layer) for _, layer in by_block.values()}
    if len(sites) > 1:
        raise ValueError(
            "a transcoder set has one output hook, but some of these layers write hook_mlp_out and others "
            "the MLP module's output (mlp.hook_out): export them as two sets"
        )
    # one model: the same recorded source (digests, revision) AND the same name, which tells apart two
    # models whose record alone cannot (two fine-tunes of one config, a source recording no digest)
    models: dict[str, list[str]] = {}
    for folder, layer in by_block.values():
        recorded = TrainingRecord.of(layer).model_source
        name = str(layer.cfg.metadata.model_name)
        identity = {
            "model_name": canonical_model_name(name).strip().lower().rsplit("/", 1)[-1],
            **(model_identity(recorded) if "kind" in recorded else {}),
        }
        key = json.dumps(identity, sort_keys=True)
        models.setdefault(key, []).append(
            f"{folder} (model {name!r}{', ' + key if 'kind' in recorded else ''})"
        )
    if len(models) > 1:
        listed = "; ".join(", ".join(folders) for folders in models.values())
        raise ValueError(
            f"a transcoder set is for one model, but these layers were trained on different ones: {listed}; "
            "export each model's layers as a set of its own"
        )
    out = Path(out).absolute()
    _check_replaceable(out)
    # written whole into a fresh folder, then swapped in: no earlier export's file survives beside the new set
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    for block, (_, layer) in sorted(by_block.items()):
        tensors = circuit_tracer_tensors(layer)
        atomic_write(fresh / layer_file(block), lambda tmp, t=tensors: save_file(t, tmp))
    first = next(iter(by_block.values()))[1]
    model_name = first.cfg.metadata.model_name
    # what circuit-tracer 0.5.0 reads (see the module docstring), then ours; no "transcoders" list:
    # without one the loader reads layer_{block}.safetensors beside config.yaml
    config = {
        "model_kind": "transcoder_set",
        "scan": circuit_tracer_scan(model_name, first),
        "feature_input_hook": hook_names.MLP_IN,
        "feature_output_hook": hook_names.WRITE_SUFFIXES[sites.pop()],
        "model_name": model_name,
        "activation": "topk",
        "k": int(first.cfg.k),
        "exported_by": "mxd-lens",
        "blocks": sorted(by_block),
    }
    atomic_write_text(fresh / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
    os.chmod(fresh, 0o777 & ~_umask())
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(fresh, out)
        shutil.rmtree(old)
    else:
        os.replace(fresh, out)
    missing = sorted(set(range(max(by_block) + 1)) - set(by_block))
    if missing:
        log.warning(
            "circuit-tracer's TranscoderSet and ReplacementModel need a transcoder at every block of the "
            "model; blocks %s have none, so the set does not load as a set (each layer_*.safetensors "
            "still loads alone with circuit-tracer's load_relu_transcoder, load_transcoder after 0.5.0)",
            missing,
        )
    return out

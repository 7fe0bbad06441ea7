"""Export TopK transcoders and skip transcoders to circuit-tracer's transcoder-set format.

``export_circuit_tracer(layers, out)`` writes, for each layer (one per block),
``layer_{block}.safetensors`` with circuit-tracer's ``SingleLayerTranscoder`` tensors

- ``W_enc`` [F, d] (ours transposed: circuit-tracer encodes ``F.linear(x, W_enc, b_enc)``),
- ``W_dec`` [F, d], ``b_enc`` [F], ``b_dec`` [d],
- ``W_skip`` [d, d] for skip transcoders (ours transposed: circuit-tracer adds ``x @ W_skip.T``),

and ``config.yaml`` with ``model_kind: transcoder_set``, ``feature_input_hook: mlp.hook_in``,
``feature_output_hook: hook_mlp_out`` (what our layers read and write, relative to ``blocks.L``),
``activation: topk`` and ``k`` (field names as circuit-tracer's ``load_transcoders`` reads them).
Upload the folder to a hub repository and ``ReplacementModel.from_pretrained(model, "user/repo")``
finds it; locally, ``load_transcoder_set({i: "layer_i.safetensors", ...}, ...)`` loads it.

Two differences to know:

- circuit-tracer's ``TopK`` keeps the k largest pre-activations as they are; ours keeps the k
  largest after a ReLU. The two agree wherever at least k pre-activations are positive (the usual
  case for a trained layer); where fewer are, circuit-tracer also keeps some negative ones.
- ``TranscoderSet`` wants a transcoder at every block 0..N-1; a partial set is written (each file
  loads alone with ``load_transcoder``) with a warning.

An MxD has no fixed decoder vectors (an expert adds an input-dependent full-rank map), so it has no
transcoder-set form: its attribution is the expert-level attribution of ``mxd_lens`` (the
attribution issue), not circuit-tracer's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FEATURE_INPUT_HOOK = "mlp.hook_in"
FEATURE_OUTPUT_HOOK = "hook_mlp_out"


def circuit_tracer_tensors(layer: Any) -> dict[str, Any]:
    """The ``SingleLayerTranscoder`` tensors of one TopK (skip) transcoder, float32, contiguous."""
    from mxd_lens.layers import MxD, TopKSkipTranscoder, TopKTranscoder

    if isinstance(layer, MxD):
        raise TypeError(
            "an MxD has no transcoder-set form: each expert adds an input-dependent full-rank map "
            "(D diag(c_n))^T z, not a fixed decoder vector, so circuit-tracer cannot represent it; "
            "export TopK transcoders or skip transcoders, and use mxd-lens's expert attribution for MxD"
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
    earlier = (out / "config.yaml").is_file() and "exported_by: mxd-lens" in (out / "config.yaml").read_text()
    if not earlier or any(
        n != "config.yaml" and not (n.startswith("layer_") and n.endswith(".safetensors")) for n in names
    ):
        raise ValueError(
            f"--out {out} is not empty and is not an earlier mxd-lens export; give an empty or new folder"
        )


def export_circuit_tracer(layers: Sequence[str | Path] | str | Path, out: str | Path) -> Path:
    """Write ``layers`` (saved folders, or folders holding them) as a circuit-tracer transcoder set
    in ``out``; see the module docstring. They must share K, width and skip-ness, be trained on one
    model and replace distinct blocks. ``out`` must be new, empty or an earlier export, which is
    replaced whole (written beside it, then swapped in). Returns ``out``."""
    import yaml
    from safetensors.torch import save_file

    from mxd_lens.fileio import _umask, atomic_write, atomic_write_text
    from mxd_lens.hooks import block_of
    from mxd_lens.layers.io import layer_folders, load_layer
    from mxd_lens.models import model_identity
    from mxd_lens.records import TrainingRecord

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
    models = {}
    for folder, layer in by_block.values():
        recorded = TrainingRecord.of(layer).model_source
        identity = (
            model_identity(recorded) if "kind" in recorded else {"model_name": layer.cfg.metadata.model_name}
        )
        models.setdefault(json.dumps(identity, sort_keys=True), []).append(folder.name)
    if len(models) > 1:
        listed = "; ".join(f"{', '.join(names)}: {key}" for key, names in models.items())
        raise ValueError(
            f"a transcoder set is for one model, but these layers were trained on different ones: {listed}"
        )
    out = Path(out)
    _check_replaceable(out)
    # written whole into a fresh folder, then swapped in: no earlier export's file survives beside the new set
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    for block, (_, layer) in sorted(by_block.items()):
        tensors = circuit_tracer_tensors(layer)
        atomic_write(fresh / f"layer_{block}.safetensors", lambda tmp, t=tensors: save_file(t, tmp))
    first = next(iter(by_block.values()))[1]
    config = {
        "model_kind": "transcoder_set",
        "model_name": first.cfg.metadata.model_name,
        "feature_input_hook": FEATURE_INPUT_HOOK,
        "feature_output_hook": FEATURE_OUTPUT_HOOK,
        "activation": "topk",
        "k": int(first.cfg.k),
        "exported_by": "mxd-lens",
        "blocks": sorted(by_block),
    }
    atomic_write_text(fresh / "config.yaml", yaml.safe_dump(config, sort_keys=False))
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
            "circuit-tracer's TranscoderSet needs a transcoder at every block 0..%d; blocks %s have none "
            "(each layer_*.safetensors still loads alone with circuit_tracer's load_transcoder)",
            max(by_block),
            missing,
        )
    return out

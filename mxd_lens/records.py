"""What a saved layer records about itself, as typed values: how it was trained
(``cfg.metadata.training``, :class:`TrainingRecord`), on which text (:class:`TextRecord`), and each
evaluation of it (``cfg.metadata.evaluations``, :class:`EvaluationRecord`).

``cfg.json`` stores them as plain JSON objects (so ``SAE.load_from_disk`` and other tools read them as
they always have); these classes are how the library reads them. A record saved by an older version
lacks some keys: they read as None (``tokens`` as 0 where absent); unknown keys are ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def finite_json(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, numbers, strings) with every NaN or infinite float replaced by
    None, so ``json.dumps(..., allow_nan=False)`` writes strict JSON: ``null``, not the bare ``NaN``
    that strict parsers (JavaScript's ``JSON.parse``, ``jq``, most languages' standard ones) reject."""
    import math

    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: finite_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _known(cls: type, saved: Mapping[str, Any] | None) -> dict[str, Any]:
    """The entries of ``saved`` that are fields of the dataclass ``cls``, without the None ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in (saved or {}).items() if k in names and v is not None}


@dataclass(frozen=True)
class TextRecord:
    """A text a layer was trained or evaluated on, as the stream, the trainer and the evaluation record
    it: the source as named (``mxd_lens.data.text_name``), its absolute path when local, the side of
    the per-document split and the split's settings, and the digests of its files' content."""

    text: str | None = None
    path: str | None = None  # the absolute path of a local source, found when ``text`` is relative
    split: str | None = None  # "train" or "eval"
    eval_fraction: float | None = None
    split_seed: int | None = None
    digests: dict[str, str] | None = None  # {file: "sha256:..."} (``mxd_lens.data.source_digests``)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any] | None) -> TextRecord:
        return cls(**_known(cls, saved))

    def __bool__(self) -> bool:
        """Whether anything was recorded."""
        return self.text is not None or bool(self.digests)

    @property
    def file_name(self) -> str:
        """The source's last path component (its name for a hub dataset)."""
        return Path(str(self.text)).name

    def describe(self) -> str:
        """One line for people: the source, the side and the split's settings."""
        return (f"{self.text} ({self.split} side, eval fraction {self.eval_fraction}, "
                f"split seed {self.split_seed})")  # fmt: skip

    def identity(self) -> tuple[Any, ...]:
        """What makes two records the same text and side: the content (digests; the name when there are
        none) and the split."""
        import json

        content = json.dumps(self.digests or self.text, sort_keys=True)
        return (content, self.split, self.eval_fraction, self.split_seed)


@dataclass(frozen=True)
class EvaluationRecord:
    """One evaluation of a layer spliced into its model (``mxd-lens eval``): the metrics, on which
    text and side, how many tokens at which context size, the model's source, the library version."""

    text: TextRecord = field(default_factory=TextRecord)
    tokens: int = 0
    context_size: int | None = None
    skip_positions: int = 0  # each row's first positions left out of every metric (0 before it existed)
    spliced_from: int | None = None  # the first position the layer replaced (None: recorded before it; all)
    metrics: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] | None = None
    mxd_lens_version: str | None = None

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any] | None) -> EvaluationRecord:
        values = _known(cls, saved)
        values["text"] = TextRecord.from_dict(values.get("text"))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """As ``cfg.json`` stores it (the text's unset fields left out)."""
        record = dataclasses.asdict(self)
        record["text"] = {k: v for k, v in record["text"].items() if v is not None}
        return record

    def key(self) -> tuple[Any, ...]:
        """What makes two evaluations the same measurement: the text (by content) and its side, the
        tokens, the context size and the positions left out; a new evaluation replaces an old one with
        the same key."""
        return (*self.text.identity(), self.tokens, self.context_size, self.skip_positions)

    @staticmethod
    def all_of(metadata: Mapping[str, Any] | None) -> list[EvaluationRecord]:
        """Every evaluation a layer's ``cfg.metadata`` records, oldest first: ``evaluations``, or the one
        ``evaluation`` of a layer evaluated before there could be several."""
        metadata = metadata or {}
        saved = metadata.get("evaluations") or (
            [metadata["evaluation"]] if metadata.get("evaluation") else []
        )
        return [EvaluationRecord.from_dict(record) for record in saved if record]


@dataclass
class TrainingRecord:
    """Where a layer came from and how it was trained."""

    model: dict[str, Any] | None = None  # the model's source (``mxd_lens.models.model_source``)
    config: dict[str, Any] | None = None  # the run's TrainConfig
    learner: dict[str, Any] | None = None  # the learner's LearnerSpec
    tokens: int = 0
    steps: int | None = None
    epochs: float | None = None  # passes over the cache (None: a live stream)
    normalization: dict[str, Any] | None = None  # {"input_scale", "output_scale", "folded"}
    data: dict[str, Any] | None = None  # the training text: {"text", "split", "eval_fraction", ...}
    metrics: dict[str, float] | None = None  # the last logged training metrics

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any] | None) -> TrainingRecord:
        """The record ``saved`` holds (None or {}: a layer without one); unknown keys are ignored."""
        return cls(**_known(cls, saved))

    @classmethod
    def of(cls, layer: Any) -> TrainingRecord:
        """The record in ``layer.cfg.metadata.training`` (an empty one when the layer has none)."""
        return cls.from_dict(getattr(layer.cfg.metadata, "training", None))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def model_source(self) -> dict[str, Any]:
        return self.model or {}

    @property
    def text(self) -> TextRecord:
        """The training text's record (empty, and false, when none was recorded)."""
        return TextRecord.from_dict(self.data)


def first_position(layer: Any) -> int:
    """The first position of each row where a splice writes ``layer``'s output (before it, the MLP's own
    output stays): the start of ``cfg.metadata.seqpos_slice``, SAELens's record of the positions a layer
    trained on (mxd-lens's trainer writes ``[1, None]`` when it left out position 0, BOS); for a layer
    that records none, 1 if its mxd-lens training record says the model prepended BOS (a layer saved
    before the trainer recorded ``seqpos_slice``: it left out position 0 then too), else 0. A slice with
    an end or a step is refused: a splice replaces every position from its first one on."""
    metadata = getattr(getattr(layer, "cfg", None), "metadata", None)
    seqpos = getattr(metadata, "seqpos_slice", None) if metadata is not None else None
    if seqpos is None:
        model = TrainingRecord.of(layer).model_source if metadata is not None else {}
        return int(bool(model.get("prepend_bos")))
    parts = list(seqpos) if isinstance(seqpos, (list, tuple)) else None
    ok = (
        parts is not None
        and 1 <= len(parts) <= 3
        and all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts)
    )
    start = parts[0] if ok and parts[0] is not None else 0
    if (
        not ok
        or start < 0
        or (len(parts) > 1 and parts[1] is not None)
        or (len(parts) > 2 and parts[2] not in (None, 1))
    ):
        raise ValueError(
            f"{type(layer).__name__} has metadata.seqpos_slice={seqpos!r}: a splice replaces every position "
            "from a first one on, so give [start, None] (start >= 0; [None] for every position): set "
            "layer.cfg.metadata.seqpos_slice"
        )
    return start


# The model's shape: what a layer records of the model it was trained on, and what splicing it checks.
SHAPE_FIELDS = (
    "n_layers",
    "d_model",
    "d_mlp",
    "n_heads",
    "d_vocab",
    "act_fn",
    "gated_mlp",
    "normalization_type",
)


def model_shape(model: Any) -> dict[str, Any]:
    """The architecture's sizes and kinds (``cfg`` fields), the same for one model loaded from any
    source (a .gguf, its Hugging Face folder, the hub): what splicing a layer into it needs."""
    return {key: getattr(model.cfg, key, None) for key in SHAPE_FIELDS}


# The model's names: what a layer records as its metadata.model_name, and what splicing compares it with.
# Here (a module importing none of mxd_lens), not in mxd_lens.models, so hooks reads them without the loaders.

# Every spelling of the default model load_model accepts (any case): mxd_lens.config.DEFAULT_MODEL, the
# model's name, its Hugging Face hub id (mxd_lens.config.DEFAULT_HUB_ID).
DEFAULT_MODEL_ALIASES = ("smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")


def is_default_model(name: Any) -> bool:
    """Whether ``name`` is a spelling of the default model ``load_model`` accepts (any case):
    ``smollm2-135m``, ``SmolLM2-135M-Instruct``, ``HuggingFaceTB/SmolLM2-135M-Instruct``."""
    return isinstance(name, str) and name.strip().lower() in DEFAULT_MODEL_ALIASES


def canonical_model_name(name: str) -> str:
    """``name``, or ``"smollm2-135m"`` for any spelling of the default: what layers and streams record
    since :func:`loadable_name` (streams and checkpoints written before it read back the same)."""
    return DEFAULT_MODEL_ALIASES[0] if is_default_model(name) else name


def _source(model: Any) -> dict[str, Any]:
    return dict(getattr(model, "mxd_lens_source", None) or {})


def loadable_name(model: Any) -> str:
    """The name a layer made for ``model`` records as its ``metadata.model_name``: the host's name. The
    default model's ``"smollm2-135m"``; for a TransformerLens name, that name (both load with
    ``load_model``); for a .gguf file or folder, its Hugging Face hub id when its metadata names it
    (``hub_id`` in its source, see ``mxd_lens.models.load_model``; loadable where TL knows it), else its
    ``cfg.model_name`` (the file's stem or the folder's name: a label, which ``load_model`` refuses; the
    training record keeps the path); for a model ``load_model`` did not load, its ``cfg.model_name``."""
    source = _source(model)
    if source.get("kind") == "default":
        return DEFAULT_MODEL_ALIASES[0]
    if source.get("kind") == "transformer_lens" and source.get("name"):
        return str(source["name"])
    return str(source.get("hub_id") or source.get("repo_id") or model.cfg.model_name)


def model_names(model: Any) -> set[str]:
    """Every name ``model`` goes by, lower-cased, each also without its organisation prefix: its
    ``cfg.model_name``, the name it was loaded by (the default's, a TransformerLens name), its hub id,
    and for the default model every spelling of it ``load_model`` accepts."""
    source = _source(model)
    names = {model.cfg.model_name, source.get("model_name"), source.get("hub_id"), source.get("repo_id")}
    if source.get("kind") == "default":
        names |= set(DEFAULT_MODEL_ALIASES)
    if source.get("kind") in ("default", "transformer_lens"):
        names.add(source.get("name"))
    lowered = {str(n).strip().lower() for n in names if n}
    return lowered | {n.rsplit("/", 1)[-1] for n in lowered}


def is_named(model: Any, name: str) -> bool:
    """Whether ``name`` (a layer's ``metadata.model_name``) is one of ``model``'s names
    (:func:`model_names`: compared in lower case, with or without an organisation prefix)."""
    lowered = str(name).strip().lower()
    names = model_names(model)
    return lowered in names or lowered.rsplit("/", 1)[-1] in names


def check_dense(model_or_cfg: Any) -> None:
    """Raise a clear error if a model (or its TransformerLens config) has mixture-of-experts MLPs
    (``cfg.num_experts``: TL's ``MoE``, Mixtral, OLMoE, GPT-OSS): mxd-lens layers replace one dense MLP."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    experts = getattr(cfg, "num_experts", None)
    if experts:
        name = getattr(cfg, "original_architecture", None) or getattr(cfg, "model_name", "this model")
        active = getattr(cfg, "experts_per_token", None)
        raise ValueError(
            f"{name}'s MLP is a mixture of experts (TransformerLens MoE, {experts} experts per block"
            f"{f', {active} active' if active else ''}); mxd-lens layers replace a dense MLP, so none can be "
            "built for, cached from or spliced into it: use a model with dense MLPs (cfg.num_experts unset)"
        )

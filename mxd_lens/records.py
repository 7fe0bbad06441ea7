"""The training record a saved layer carries in ``cfg.metadata.training``, as a typed value.

``cfg.json`` stores it as a plain JSON object (so ``SAE.load_from_disk`` and other tools read it as
they always have); :class:`TrainingRecord` is how the library reads and writes it. A record saved by
an older version lacks some keys: they read as None (``tokens`` and ``steps`` as 0 where absent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in (saved or {}).items() if k in known and v is not None}
        return cls(**values)

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
    def text(self) -> dict[str, Any]:
        """The training text's record ({} when none was recorded)."""
        return self.data or {}


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

"""The evaluation study's options: saved layers spliced into the model on held-out text (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mxd_lens.config import StreamConfig


@dataclass
class EvalOptions:
    """Splice each saved layer alone into the model on held-out text and measure ΔCE, KL, FVU, L0, the
    units' usage and the Jacobian cosine; the results go into each layer's cfg.json
    (metadata.evaluations, one record per text, split and tokens; metadata.evaluation: the latest) and an
    eval.json beside it, and a table is printed."""

    layers: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """layer folders, or folders holding them (a trainer's final/, the frontier's runs/*/final); a folder
    of another SAELens architecture (a transcoder trained elsewhere) loads with SAE.load_from_disk"""

    compare: list[str] = field(default_factory=list)
    """published SAELens layers to evaluate beside them on the same batches, each RELEASE/ID as
    SAE.from_pretrained takes it (e.g. gemma-scope-2-270m-pt-transcoders/transcoder/layer_9_width_16k_l0_small_affine;
    from the hub, or offline from its local cache); they are printed, not recorded"""
    text: str | None = None
    """held-out text: the 'eval' side of this text's document split (default: the text the layers were
    trained on, with their split, else the bundled English text)"""
    split: Literal["eval", "all"] = "eval"
    """'all': every document of text is held out (a text the layers never saw)"""
    eval_tokens: int = 25_600
    """held-out tokens"""
    context_size: int = StreamConfig.context_size
    """tokens per row, BOS included"""
    rows_per_forward: int = 8
    """rows per evaluation forward"""
    skip_positions: int = 0
    """leave the first N positions of every row out of CE, KL, FVU and the usage counts (e.g. 4 for Gemma
    Scope 2's instruction-tuned transcoders, not trained there); recorded with the results"""
    eval_fraction: float | None = None
    """the split's eval fraction (default: the layers' training record, else StreamConfig's)"""
    split_seed: int | None = None
    """the split's seed (default: the layers' training record, else StreamConfig's)"""
    write: bool = True
    """write the results into each layer's cfg.json and an eval.json beside it"""
    allow_other_model: bool = False
    """evaluate even when the model is not the one the layers were trained on (another file digest,
    config digest or hub revision); the record then names the model used"""

    def __post_init__(self) -> None:
        # refused at once, before the model and the layers are loaded
        if self.eval_tokens <= 0:
            raise ValueError(f"--eval-tokens {self.eval_tokens}: evaluate at least one row of tokens")
        for name in ("context_size", "rows_per_forward"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive number")

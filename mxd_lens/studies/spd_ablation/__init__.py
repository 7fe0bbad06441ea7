"""The options of the SPD ablation study on a real model (``run.py``; docs/spd.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

CONCEPTS = {  # concept: (probing set, class) of the offline probing data
    "french": ("language_id", "fr"),
    "python": ("code_language", "python"),
    "sport": ("topic_bbc_news", "sports"),
}


@dataclass
class SPDAblationOptions:
    """SPD component ablation on a real model: decompose one late weight matrix, find the component most
    specific to a concept, ablate it, and compare the damage on held-out concept text with the damage
    elsewhere and with norm-matched random components. Writes OUT/spd/ (checkpoints, metrics.json),
    OUT/decomposition.json, scores.json, ablation.json, by_ci.json (a killed run resumes from them), and
    the tables ablation_effects.csv and by_ci.csv with the figure ablation.png."""

    data: str | None = None
    """a folder with corpus/*.txt.xz and probing/*.jsonl.xz named as CORPUS and CONCEPTS name them (required)"""
    block: int = 27
    """transformer block whose weight is decomposed"""
    weight: str = "mlp.W_out"
    """weight of that block"""
    context_size: int = 64
    """tokens per row, BOS included"""
    train_rows: int = 800
    """rows cached for SPD training"""
    C: int = 576
    """components (576 = the weight's rank)"""
    init: Literal["svd", "random"] = "svd"
    """component init"""
    steps: int = 400
    """SPD steps"""
    batch_size: int = 8
    """rows per SPD step"""
    lr: float = 1e-3
    """AdamW learning rate (warm-up, then cosine)"""
    ci: Literal["sequence", "token"] = "sequence"
    """causal-importance function"""
    ci_hidden: int = 8
    """its hidden width"""
    faithfulness: float = 1e4
    """faithfulness coefficient"""
    minimality: float = 1e-3
    """importance-minimality coefficient"""
    p_end: float = 1.0
    """minimality's p at the last step (from 2)"""
    score_rows: int = 48
    """rows per side for concept scoring"""
    eval_rows: int = 48
    """rows per held-out set"""
    n_random: int = 5
    """norm-matched random components (the baseline)"""
    concepts: list[str] = field(default_factory=lambda: list(CONCEPTS))
    """concepts to score and ablate (french, python, sport)"""
    train_only: bool = False
    """stop after training (pilots)"""
    redo: bool = False
    """recompute scores and ablations even if saved"""
    cache: str | None = None
    """residual cache folder (default OUT/cache)"""
    seed: int = 0
    """seed of the row order, masks and random components"""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError(
                "give data: a folder with corpus/ (the CORPUS files) and probing/ (the CONCEPTS files) of "
                "mxd_lens.studies.spd_ablation.run"
            )
        unknown = [c for c in self.concepts if c not in CONCEPTS]
        if unknown:
            raise ValueError(f"concepts {unknown} unknown; choose from {list(CONCEPTS)}")

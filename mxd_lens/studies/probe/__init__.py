"""The probing study's options: sparse probing of saved layers' codes on a task suite (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ProbeOptions:
    """Sparse probing of saved layers on a task suite: which layer's codes name a concept in k features."""

    layers: list[str]
    """layer folders, or folders holding them (a trainer's final/, the frontier's runs/*/final)"""
    suite: Literal["offline", "saebench"] = "offline"
    """offline: the one-vs-rest tasks whose files are in --data (26 bundled; 38 over 8 datasets with the
    full offline set, docs/data.md); saebench: SAEBench's datasets (hub)"""
    data: str | None = None
    """folder of the offline suite's files (default: the sets bundled with mxd-lens; the suite runs on the
    sets whose files are there)"""
    per_class: int | None = None
    """examples per class (default: the suite's, 200)"""
    ks: list[int] = field(default_factory=lambda: [1, 2, 5])
    """probe sizes: features kept per probe"""
    context_size: int = 128
    """tokens per text, BOS included"""
    batch_size: int = 16
    """texts per model forward"""
    seed: int = 0
    """seed of the train/validation/test split"""
    protocols: list[str] = field(default_factory=lambda: ["saebench"])
    """saebench (top k by train mean difference; k in ks), paper (k = 1, best of 100 by *test* F1: selected
    on test, as the reference code does), paper_val (the same, selected on validation)"""
    neurons: bool = False
    """also probe the host MLP's hidden neurons, like codes (a baseline)"""


@dataclass
class MergeOptions:
    """One probing report from several probing studies of the same suite (e.g. the K = 32 layers probed in
    one session and the K = 16 and 64 layers in another), written as ``mxd-lens probe`` writes one. Rows
    both studies hold (the dense ceiling) must be equal, or the merge is refused."""

    folders: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """probing folders (each holds the probing.csv that mxd-lens probe wrote)"""

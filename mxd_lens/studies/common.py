"""What every study's verb shares: where the model comes from, where results go, how many threads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mxd_lens.config import DEFAULT_MODEL


@dataclass
class Where:
    """The model and where to write."""

    model: str | None = None
    """model name or path (default: the study's; smollm2-135m for most, the layers' training model for eval)"""
    tl_name: str | None = None
    """for a .gguf file or folder: the TransformerLens official name whose architecture to build with"""
    out: str = "results"
    """output folder (each study writes its own folder in it: OUT/probing, OUT/steering, ...)"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


@dataclass
class DemoWhere(Where):
    """The model and where to write."""

    out: str | None = None
    """output folder (default results/demo; results/demo-quick with --quick)"""


@dataclass
class Output:
    """Where to write (for studies that build their own model)."""

    out: str = "results"
    """output folder"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


@dataclass
class ModelOnly:
    """The model the layers replace MLPs of."""

    model: str | None = None
    """model name or path (default: the model the layers' training record names, else smollm2-135m)"""
    tl_name: str | None = None
    """for a .gguf file or folder: the TransformerLens official name whose architecture to build with
    (default: the one the training record names, if any)"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


def host_model(where: Where, options: Any) -> Any:
    """The HookedTransformer ``--model`` names (the default model when it names none)."""
    from mxd_lens.models import load_model

    return load_model(where.model or DEFAULT_MODEL, tl_name=where.tl_name)

"""The inspection study's options: top-activating contexts of chosen features of a saved layer (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class InspectOptions:
    """Top-activating contexts of chosen experts / latents of one saved layer."""

    layer: str
    """a saved layer folder"""
    features: list[int] = field(default_factory=list)
    """feature indices (experts for MxD, latents for transcoders)"""
    from_steering: str | None = None
    """a steering.csv: also take the features the steering study chose for this layer"""
    text: list[str] | None = None
    """texts to read, an equal share of tokens from each (default: the bundled English text)"""
    tokens: int = 100_000
    """tokens to read in all"""
    context_size: int = 128
    """tokens per row, BOS first"""
    n: int = 20
    """contexts per feature"""

"""The steering study's options: steer with each task's top probing feature, scored offline (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mxd_lens.config import DEFAULT_TASKS, NEUTRAL_PROMPT


@dataclass
class SteerOptions:
    """Steer with the top probing feature of several tasks, for each layer at one K, and score each
    generation offline: concept strength (a dense probe for the task's class against every other text
    of the suite, reading the clean model's MLP input pooled over the generated tokens) and fluency
    (the clean model's perplexity of the generated tokens)."""

    layers: str
    """folder of saved layers (a trainer's final/, the frontier's runs/*/final)"""
    k: int = 32
    """use the layers with this K"""
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    """offline-suite tasks, as set/class"""
    data: str | None = None
    """folder of the offline suite's files (default: the sets bundled with mxd-lens; the suite runs on the
    sets whose files are there)"""
    per_class: int | None = None
    """examples per class (default: the suite's; as in the probing run)"""
    probing: str | None = None
    """a pooled-activation cache to reuse (probing's OUT/pooled; default OUT/pooled)"""
    multiples: list[float] = field(default_factory=lambda: [0.0, 2.0, 8.0, 32.0, 128.0])
    """alpha in units of the feature's largest activation on the task's positive training texts"""
    samples: int = 10
    """generations per setting"""
    new_tokens: int = 32
    """tokens per generation"""
    prompt: str = NEUTRAL_PROMPT
    """the prompt every generation continues"""
    seed: int = 0
    """sampling seed"""
    context_size: int = 128
    """tokens per text read (the suite's texts, the top contexts), BOS included; as in probing"""
    context_tokens: int = 100_000
    """tokens of the bundled English text searched for each steered feature's top contexts (0: none)"""

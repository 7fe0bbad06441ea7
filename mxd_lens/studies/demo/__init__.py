"""The demo's options: a preset of the frontier study at one block and K (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mxd_lens.config import StreamConfig


@dataclass
class DemoOptions:
    """The main job: on the default model and text, cache one mid block's MLP activations, train a
    parameter-matched MxD (the recommended gate, config.RECOMMENDED_MXD: plain TopK, standardised) and
    TopK transcoder at the same K from that one stream, splice both into the model on held-out text and
    on text none of them trained on, print the comparison and save the plot and the weights (OUT/demo;
    OUT/demo-quick with --quick). A preset of the frontier study."""

    quick: bool = False
    """a smoke run of about a minute (few tokens)"""
    text: str | None = None
    """text source (default: the bundled English text)"""
    ood_text: str | None = None
    """out-of-domain text, every document held out (default: the bundled Debian fortunes; 'none': skip)"""
    block: int = 15
    """transformer block whose MLP to replace"""
    k: int = 32
    """active experts / latents per token"""
    width_multiplier: int | None = None
    """transcoder width m x d_model; MxD gets the experts that match its parameters (default: 8, more on
    hosts whose MLP is too wide for a width-8 match: matching.default_width_multiplier)"""
    train_tokens: int | None = field(default=None, metadata={"alias": ["--cache-tokens"]})
    """tokens of text to cache (default 262,144; 8,192 with --quick), rounded up to whole shards;
    training tokens = epochs x this"""
    epochs: float = 2.0
    """training tokens = epochs x --cache-tokens (the cache holds whole shards, a little more, so the
    epochs over it the output reports are a little fewer)"""
    eval_tokens: int | None = None
    """held-out tokens (default 12,800; 1,024 with --quick)"""
    context_size: int = StreamConfig.context_size
    """tokens per row"""
    batch_tokens: int | None = None
    """tokens per training step (default 512; 256 with --quick)"""

    def __post_init__(self) -> None:
        # refused at once, before the model is loaded and the cache written (minutes)
        for name in ("k", "context_size", "train_tokens", "eval_tokens", "batch_tokens", "width_multiplier"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: give a positive number")
        if self.block < 0:
            raise ValueError(f"--block {self.block}: blocks are numbered from 0")
        if not self.epochs > 0:
            raise ValueError(f"--epochs {self.epochs}: give a number > 0")

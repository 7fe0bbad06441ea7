"""The replacement-model study's options: a layer at every block spliced at once (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mxd_lens.config import StreamConfig


@dataclass
class ReplacementOptions:
    """How faithful is the replacement model: saved layers, one at every block of the model (one run of
    `mxd-lens train --blocks all`), spliced at once on held-out text and on a text they never saw. Per
    text: KL and ΔCE with every block spliced; the compounding curve (the first n blocks spliced, n = 1 ...
    all; a plot of KL against n); each block alone (KL, FVU, L0, always-on, silent, effective units); and
    the sanity row, every layer spliced with its error term, where the model must be exact."""

    layers: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """layer folders, or folders holding them (a run's final/): one per block, at every block"""
    text: str | None = None
    """held-out text: the 'eval' side of this text's document split (default: the text the layers were
    trained on, with their split)"""
    ood_text: str | None = None
    """a text the layers never saw, every document of it held out (e.g. the BBC News probing set)"""
    eval_tokens: int = 8_192
    """held-out tokens per text (the compounding curve costs one forward per block for each)"""
    context_size: int = StreamConfig.context_size
    """tokens per row, BOS included"""
    rows_per_forward: int = 8
    """rows per evaluation forward"""
    label: str | None = None
    """the method's name in tables and plots (default: the layers' architecture key)"""
    compounding: bool = True
    """measure the compounding curve (n forwards of the whole model per batch)"""

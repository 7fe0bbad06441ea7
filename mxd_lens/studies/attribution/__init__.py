"""The attribution study's options: logit differences attributed through each architecture's spliced layers
over a set of prompts (``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Factual and syntactic prompts for the attribution study, "prompt|target|minus" (the logit difference
# target - minus at the last position; each a single token of SmolLM2's vocabulary, leading space kept).
DEFAULT_PROMPTS = (
    "The capital of France is| Paris| London",
    "The Eiffel Tower is located in the city of| Paris| Rome",
    "The keys to the cabinet| are| is",
    "When Mary and John went to the store, John gave a drink to| Mary| John",
    "Monday, Tuesday,| Wednesday| Friday",
    "She walked to the door and opened| it| them",
)


@dataclass
class AttributionOptions:
    """Attribution of a few predictions to the units of each architecture's layers, spliced at the same
    blocks with the same K: how much the top units carry, and how large the error term is."""

    layers: list[str]
    """layer folders, or folders holding them (the frontier's runs/*/final)"""
    k: int = 32
    """use the layers with this K"""
    blocks: list[int] | None = None
    """the blocks to splice at (default: every block with a layer of every architecture at this K)"""
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """'prompt|target|minus' (minus optional): the logit (difference) at the last position"""
    top: int = 10
    """units counted as the top ones"""
    error_term: bool = True
    """splice with the error term (the model is then exactly the clean one)"""


@dataclass
class AttributeOptions:
    """Which experts (MxD) or latents (transcoders) carry a prediction: attribution of a logit (difference)
    on one prompt to the units of saved layers spliced into the model, in the model linearised at the
    prompt (mxd_lens.attribution). Prints the top units, the other sources and the completeness check;
    writes --out/{units.csv, parts.csv, graph.png, report.html}."""

    layers: list[str] = field(default_factory=list)
    """saved layer folders to splice (one per block), or folders holding them"""
    prompt: str = "The capital of France is"
    """the prompt (BOS prepended as the model does)"""
    target: str = " Paris"
    """the token whose logit at the last position is attributed (one token)"""
    minus: str | None = None
    """attribute the logit difference target - minus"""
    error_term: bool = True
    """splice with the error term (the model is then exactly the clean one)"""
    top: int = 10
    """units to list"""
    context_tokens: int = 16_384
    """tokens of the bundled English text searched for the top units' contexts in the report (0: none)"""


def check_attribute(options: AttributeOptions) -> None:
    """What `mxd-lens attribute` refuses before the model is loaded."""
    if not options.layers:
        raise ValueError("give --layers (saved layer folders to splice)")

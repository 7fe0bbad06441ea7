"""The graphs study's options: attribution graphs through a replacement model over a suite of prompts
(``run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The suite: the attribution study's prompts, indirect-object prompts and induction prompts (10-20 tokens
# each on SmolLM2); each graph's targets are the most probable next tokens at the last position.
DEFAULT_GRAPH_PROMPTS = (
    "The capital of France is",
    "The Eiffel Tower is located in the city of",
    "The keys to the cabinet",
    "When Mary and John went to the store, John gave a drink to",
    "Monday, Tuesday,",
    "She walked to the door and opened",
    "After Alice and Bob finished their lunch, Bob handed the bill to",
    "Then Sarah and Tom argued about the film, and later Tom said sorry to",
    "The vase is blue and the lamp is red. Later, the vase is",
    "zor quib dalet tarn vex. zor quib dalet",
    "Anna Pavlova met Ivan Petrov in Moscow. Later that year, Anna",
)


@dataclass
class GraphsOptions:
    """Attribution graphs through saved layers (one per block; every block's for a replacement model),
    circuit-tracer's way: units, error nodes, embeddings and the top logits as nodes, direct effects as
    edges, pruned by influence. Per prompt: the replacement and completeness scores, the nodes that carry
    80% of the influence, the completeness check (each node's input = its in-edges + bias), the time and
    memory it took; a self-contained HTML page per graph (a node's top contexts on hover) and
    circuit-tracer's graph files (its viewer opens them)."""

    layers: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """layer folders, or folders holding them (a run's final/): at most one per block"""
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_GRAPH_PROMPTS))
    """the prompts (BOS prepended as the model does)"""
    node_threshold: float = 0.8
    """pruning: keep the nodes that carry this fraction of the influence on the logits"""
    edge_threshold: float = 0.98
    """pruning: keep the edges that carry this fraction of the influence among the kept nodes"""
    max_logits: int = 10
    """at most this many logit targets"""
    logit_probability: float = 0.95
    """the fewest most probable next tokens whose probabilities reach this"""
    context_tokens: int = 8_192
    """tokens of the bundled English text searched for each kept unit's top contexts (0: none)"""
    label: str | None = None
    """the method's name in tables (default: the layers' architecture key)"""
    chunk: int = 128
    """targets per batched backward (memory against speed)"""

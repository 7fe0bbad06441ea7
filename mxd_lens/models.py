"""Loading a hooked TransformerLens model by name (for users with the hub).

Issue #4 extends this with local Hugging Face folders, GGUF files and the embedded offline default.
"""

from __future__ import annotations

from typing import Any


def load_model(name: str, device: str = "cpu", **kwargs: Any) -> Any:
    """A ``HookedTransformer`` for a TransformerLens model name (weights from the hub)."""
    import warnings

    from transformer_lens import HookedTransformer

    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
    try:
        return HookedTransformer.from_pretrained(name, device=device, **kwargs)
    except Exception as err:  # TL raises ValueError / OSError / hub errors for unknown or unreachable names
        raise ValueError(f"could not load model {name!r}: {err}") from err

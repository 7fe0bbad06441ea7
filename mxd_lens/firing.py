"""When did each unit last fire, and which units are dead: one definition for training and evaluation.

A unit (an MxD expert or a transcoder latent) *fires* on a token when its code there is non-zero (> 0
for the ReLU'd codes; signed codes, MxD's ``gate="topk"``, fire when negative too). The
tracker counts tokens; ``last_fired[n]`` is the token count at the end of the last batch in which unit
n fired, 0 if it has not fired since counting began. A unit is **dead** when it has not fired in the
last ``window`` tokens: ``last_fired <= tokens - window``. Before one window has passed nothing is dead;
with ``window`` = every token seen (what ``evaluate`` uses), dead means "never fired on these tokens".
"""

from __future__ import annotations

import torch


class FiringTracker:
    def __init__(self, n_units: int, device: str | torch.device = "cpu"):
        self.last_fired = torch.zeros(n_units, dtype=torch.long, device=device)
        self.tokens = 0

    def update(self, values: torch.Tensor, indices: torch.Tensor, n_tokens: int | None = None) -> None:
        """Record one batch of codes (values, indices [..., K]) covering ``n_tokens`` tokens (default:
        the leading size of the codes)."""
        self.tokens += int(values.reshape(-1, values.shape[-1]).shape[0] if n_tokens is None else n_tokens)
        fired = indices[values != 0]
        self.last_fired[fired.to(self.last_fired.device)] = self.tokens

    def dead_mask(self, window: int | None = None) -> torch.Tensor:
        """[n_units] bool: True for units that did not fire in the last ``window`` tokens (default:
        all tokens seen)."""
        window = self.tokens if window is None else window
        if window <= 0:
            raise ValueError(f"window={window} must be positive")
        if self.tokens < window:
            return torch.zeros_like(self.last_fired, dtype=torch.bool)
        return self.last_fired <= self.tokens - window

    def dead_fraction(self, window: int | None = None) -> float:
        return float(self.dead_mask(window).float().mean())

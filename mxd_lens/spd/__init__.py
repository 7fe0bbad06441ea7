"""Stochastic Parameter Decomposition (SPD) of TransformerLens models' weights (see docs/spd.md).

from mxd_lens.spd import SPDConfig, SPDTrainer
trainer = SPDTrainer(model, ["blocks.0.attn.W_Q", "blocks.0.attn.W_K"], batches, SPDConfig(C=32), "runs/spd")
metrics = trainer.fit()
ci = trainer.decomposition.causal_importance(model, tokens)   # {name: (g, g_upper)}

Studies build on submodules: ``mxd_lens.spd.induction`` (the toy induction task and model),
``mxd_lens.spd.report`` (CI per position class, masked accuracy, figures), ``mxd_lens.spd.ablation``
(``ResidualModel``, concept scoring, ``ablate``, ``ablation_effect``).
"""

from mxd_lens.spd.ci import CI_TYPES, lower_leaky_hard_sigmoid, upper_leaky_hard_sigmoid
from mxd_lens.spd.components import Components, Decomposition
from mxd_lens.spd.losses import (
    MaskedRun,
    importance_minimality_loss,
    kl_divergence,
    masked_logits,
    reconstruction_losses,
    stochastic_masks,
    subset_routing,
)
from mxd_lens.spd.sites import Site, decomposable_weights
from mxd_lens.spd.train import SPDConfig, SPDTrainer, ci_l0, evaluate

__all__ = [
    "CI_TYPES",
    "Components",
    "Decomposition",
    "MaskedRun",
    "SPDConfig",
    "SPDTrainer",
    "Site",
    "ci_l0",
    "decomposable_weights",
    "evaluate",
    "importance_minimality_loss",
    "kl_divergence",
    "lower_leaky_hard_sigmoid",
    "masked_logits",
    "reconstruction_losses",
    "stochastic_masks",
    "subset_routing",
    "upper_leaky_hard_sigmoid",
]

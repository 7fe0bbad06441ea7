"""Train an SPD decomposition of a frozen TransformerLens model.

A step: one clean forward (target logits and every module's input, no grad), the CI functions on those
inputs, the reconstruction terms with nonzero coefficients as one fused forward of the decomposed
model, faithfulness and minimality, backward, AdamW (no weight decay). p of the minimality loss goes
linearly from ``p_start`` (step 0) to ``p_end`` (last step); the learning rate warms up linearly, then
stays constant or follows a cosine to 0.

Checkpoints (``out_dir/checkpoints/step_NNNNNNNNN/state.pt``) hold the decomposition, the optimizer,
the mask generator's state, the step and the metric history; each is written to a temporary folder and
renamed, and ``latest`` names the newest whole one, so ``fit(resume=True)`` after a kill ends with
exactly the parameters of an unbroken run (with ``batches`` a function of the step; an iterator is
fast-forwarded by drawing the batches already used).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from tqdm.auto import tqdm

from mxd_lens.checkpoints import latest_checkpoint, save_checkpoint_dir, write_text_atomic
from mxd_lens.spd.ci import CI_TYPES
from mxd_lens.spd.components import Decomposition
from mxd_lens.spd.losses import (
    MASK_TYPES,
    POSITIONS,
    RECONSTRUCTIONS,
    importance_minimality_loss,
    kl_divergence,
    reconstruction_losses,
)
from mxd_lens.training import TrainingDiverged

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

COEFFICIENTS = ("faithfulness", *RECONSTRUCTIONS, "minimality")
# Settings that may change between a checkpoint and its resumption without changing what is trained.
_FREE = ("steps", "log_every", "checkpoint_every", "keep_checkpoints")


@dataclass
class SPDConfig:
    """SPD hyper-parameters; the loss coefficients are named after the terms in ``losses.py``."""

    C: int = 32
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    ci: Literal["sequence", "token"] = "sequence"
    ci_hidden: int = 16
    ci_attn_dim: int | None = None  # None: ci_hidden
    mask_type: Literal["continuous", "binomial"] = "continuous"
    delta: bool = True
    faithfulness: float = 1e3
    stochastic_recon: float = 1.0
    layerwise_recon: float = 0.0
    subset_recon: float = 1.0
    ci_masked_recon: float = 0.0
    minimality: float = 1e-2
    p_start: float = 2.0
    p_end: float = 1.0
    positions: Literal["all", "last"] = "all"
    fuse_runs: bool = True  # all reconstruction forwards as one (more memory, far less overhead)
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 100  # steps; 0: only at the end
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.C, bool) or not isinstance(self.C, int) or self.C <= 0:
            raise ValueError(f"C={self.C!r}: the number of components per module must be a positive int")
        for name in ("steps", "batch_size", "ci_hidden", "log_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not 0 < self.lr < math.inf or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError(
                f"need a finite lr > 0, warmup_steps >= 0, checkpoint_every >= 0; got {self.lr}, "
                f"{self.warmup_steps}, {self.checkpoint_every}"
            )
        for name, value, allowed in (
            ("lr_schedule", self.lr_schedule, ("constant", "cosine")),
            ("ci", self.ci, tuple(CI_TYPES)),
            ("mask_type", self.mask_type, MASK_TYPES),
            ("positions", self.positions, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {allowed}")
        negative = {name: getattr(self, name) for name in COEFFICIENTS if not getattr(self, name) >= 0}
        if negative:
            raise ValueError(f"loss coefficients must be >= 0 (and not NaN); got {negative}")
        if self.faithfulness == 0 and not any(getattr(self, name) for name in RECONSTRUCTIONS):
            raise ValueError(
                "these loss coefficients leave nothing to train: faithfulness and every reconstruction "
                f"coefficient ({', '.join(RECONSTRUCTIONS)}) are 0; set stochastic_recon=1 for instance"
            )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def p_at(self, step: int) -> float:
        return self.p_start + (self.p_end - self.p_start) * step / max(1, self.steps - 1)

    def decomposition_kwargs(self) -> dict[str, Any]:
        return dict(
            C=self.C,
            ci=self.ci,
            ci_hidden=self.ci_hidden,
            seed=self.seed,
            ci_attn_dim=self.ci_attn_dim,
            delta=self.delta,
        )


Batches = Callable[[int], torch.Tensor] | Iterable[torch.Tensor]


class SPDTrainer:
    """Decomposes ``modules`` of ``model`` on ``batches`` (step -> tokens [batch_size, seq], or an
    iterable of such), writing checkpoints and ``metrics.json`` under ``out_dir``. With a
    ``mxd_lens.spd.ablation.ResidualModel`` (the model run from a layer) a batch is the cached residual
    stream [batch_size, seq, d_model] at that layer's input instead."""

    def __init__(
        self,
        model: HookedTransformer,
        modules: list[str],
        batches: Batches,
        config: SPDConfig,
        out_dir: str | Path,
        progress: bool = True,
    ):
        self.model, self.config, self.progress = model, config, progress
        self.out_dir = Path(out_dir)
        self.batches = batches
        self.decomposition = Decomposition(model, modules, **config.decomposition_kwargs())
        self.device = next(self.decomposition.parameters()).device
        self.optimizer = torch.optim.AdamW(
            self.decomposition.parameters(), lr=config.lr_at(0), weight_decay=0.0
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.step = 0
        self.history: list[dict[str, float]] = []

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, resume: bool = True) -> dict[str, float]:
        """Train to ``config.steps`` (from the latest checkpoint with ``resume``); the last metrics."""
        if resume:
            self.load_checkpoint()
        cfg = self.config
        stream = self._stream()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="SPD", unit="step", disable=not self.progress)
        frozen = [(p, p.requires_grad) for p in self.model.parameters()]
        self.model.requires_grad_(False)
        metrics: dict[str, float] = {}
        try:
            while self.step < cfg.steps:
                tokens = next(stream, None)
                if tokens is None:
                    raise ValueError(f"batches ran out after {self.step} of {cfg.steps} steps")
                metrics = self.train_step(tokens)
                self.step += 1
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    self._log(metrics, bar)
                if self.step == cfg.steps or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                    self._check_finite()
                    self.save_checkpoint()
        finally:
            bar.close()
            for param, flag in frozen:
                param.requires_grad_(flag)
        if not metrics and self.history:  # resumed a finished run
            metrics = {k: v for k, v in self.history[-1].items() if k != "step"}
        return metrics

    def train_step(self, tokens: torch.Tensor) -> dict[str, float]:
        cfg, decomp = self.config, self.decomposition
        tokens = self._check_batch(tokens)
        target, inputs = decomp.run_clean(self.model, tokens)
        ci = decomp.ci_from_inputs(inputs)
        terms: dict[str, torch.Tensor] = {}
        if cfg.faithfulness:
            terms["faithfulness"] = decomp.faithfulness_loss()
        which = [name for name in RECONSTRUCTIONS if getattr(cfg, name)]
        if which:
            terms.update(
                reconstruction_losses(
                    decomp,
                    tokens,
                    target,
                    ci,
                    which,
                    cfg.mask_type,
                    self.generator,
                    cfg.positions,
                    cfg.fuse_runs and tokens.ndim == 2,  # fusing repeats [b, p] tokens along the batch
                )
            )
        p = cfg.p_at(self.step)
        if cfg.minimality:
            terms["minimality"] = importance_minimality_loss(ci, p)
        loss = sum(getattr(cfg, name) * value for name, value in terms.items())
        if not torch.isfinite(loss):
            values = {name: float(value.detach()) for name, value in terms.items()}
            raise TrainingDiverged(
                f"SPD loss is {float(loss.detach())} at step {self.step} (terms {values}); nothing of this step was "
                f"saved, the last good checkpoint is {self.latest_checkpoint() or 'none (none written yet)'}; "
                "try a lower lr"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        self.optimizer.step()
        with torch.no_grad():
            metrics = {"loss": float(loss), **{name: float(value) for name, value in terms.items()}}
            metrics.update(p=p, lr=cfg.lr_at(self.step))
            l0 = {name: float(ci_l0(g)) for name, (g, _) in ci.items()}
            metrics["ci_l0"] = sum(l0.values()) / len(l0)
            metrics.update({f"ci_l0/{name}": value for name, value in l0.items()})
        return metrics

    def evaluate(self, tokens: torch.Tensor, threshold: float = 0.1) -> dict[str, Any]:
        """See ``evaluate``; stochastic masks from a generator seeded with ``config.seed``."""
        return evaluate(
            self.decomposition,
            tokens.to(self.device),
            threshold=threshold,
            positions=self.config.positions,
            mask_type=self.config.mask_type,
            generator=torch.Generator(device=self.device).manual_seed(self.config.seed),
        )

    def _check_finite(self) -> None:
        """A finite loss can still come with an update that leaves NaN/inf weights: never save those."""
        bad = [name for name, p in self.decomposition.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise TrainingDiverged(
                f"parameters {bad[:3]}{' ...' if len(bad) > 3 else ''} are not finite after step {self.step}; "
                f"not saved, the last good checkpoint is {self.latest_checkpoint() or 'none'}; try a lower lr"
            )

    def _stream(self) -> Iterator[torch.Tensor]:
        if callable(self.batches):
            return (self.batches(step) for step in range(self.step, self.config.steps))
        stream = iter(self.batches)
        for _ in range(self.step):  # resumed: skip the batches the checkpoint has seen
            next(stream)
        return stream

    def _check_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        shape = tuple(tokens.shape)
        # A float [batch, positions, d_model] batch is a residual stream, for a model that starts at a
        # layer (mxd_lens.spd.ablation.ResidualModel); anything else must be integer tokens.
        residual = tokens.is_floating_point() and len(shape) == 3
        tokens_ok = len(shape) == 2 and not tokens.is_floating_point()
        if not (residual or tokens_ok) or shape[0] != self.config.batch_size:
            raise ValueError(
                f"batch at step {self.step} is a {tokens.dtype} tensor of shape {shape}; expected integer "
                f"tokens of shape (batch_size={self.config.batch_size}, positions), or a float residual "
                "stream (batch_size, positions, d_model) for a model run from a layer"
            )
        return tokens.to(self.device)

    def _log(self, metrics: dict[str, float], bar: Any) -> None:
        self.history.append({"step": self.step, **metrics})
        short = {
            "loss": "loss",
            "stochastic_recon": "stoch",
            "subset_recon": "subset",
            "layerwise_recon": "layer",
            "ci_masked_recon": "ci_kl",
            "faithfulness": "faith",
            "ci_l0": "L0",
        }
        bar.set_postfix_str(
            " ".join(f"{label} {metrics[key]:.3g}" for key, label in short.items() if key in metrics),
            refresh=False,
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out_dir / "metrics.json", json.dumps(self.history, indent=1))

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir, marker="state.pt")

    def save_checkpoint(self) -> Path:
        """Write the whole training state; on any failure the previous checkpoint stays ``latest``."""

        def fill(folder: Path) -> None:
            torch.save(
                {
                    "decomposition": self.decomposition.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "generator": self.generator.get_state(),
                    "step": self.step,
                    "history": self.history,
                },
                folder / "state.pt",
            )
            summary = {
                "step": self.step,
                "config": asdict(self.config),
                "decomposition": self.decomposition.config(),
            }
            (folder / "trainer_state.json").write_text(json.dumps(summary, indent=1))

        return save_checkpoint_dir(self.checkpoint_dir, self.step, fill, self.config.keep_checkpoints)

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        """Restore a checkpoint (default: ``latest``; none written yet: keep the fresh state)."""
        path = Path(path) if path is not None else self.latest_checkpoint()
        if path is None:
            return
        summary = json.loads((path / "trainer_state.json").read_text())
        saved, asked = summary["config"], asdict(self.config)
        diff = {
            f.name: (saved.get(f.name), asked[f.name])
            for f in fields(SPDConfig)
            if f.name not in _FREE and saved.get(f.name) != asked[f.name]
        }
        if diff or summary["decomposition"]["modules"] != self.decomposition.names:
            raise ValueError(
                f"{path} was trained with other settings (checkpoint, asked): {diff or ''} "
                f"modules {summary['decomposition']['modules']} vs {self.decomposition.names}"
            )
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=True)
        self.decomposition.load_state_dict(state["decomposition"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"].cpu())
        self.step, self.history = state["step"], state["history"]


def ci_l0(g: torch.Tensor, threshold: float = 0.1) -> torch.Tensor:
    """Components with g > threshold, averaged over positions (and batch)."""
    return (g > threshold).sum(-1).float().mean()


@torch.no_grad()
def evaluate(
    decomposition: Decomposition,
    tokens: torch.Tensor,
    threshold: float = 0.1,
    positions: str = "all",
    mask_type: str = "continuous",
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """CI-L0 per module, alive components per module (g > threshold at some batch item and position),
    faithfulness, and KL(target ‖ masked) with stochastic masks, masks = g, and all modules at full
    mask (= the target when ΔW is on; a check)."""
    target, inputs = decomposition.run_clean(decomposition.model, tokens)
    ci = decomposition.ci_from_inputs(inputs)
    kls = reconstruction_losses(
        decomposition,
        tokens,
        target,
        ci,
        ["stochastic_recon", "ci_masked_recon"],
        mask_type,
        generator,
        positions,
        fuse=tokens.ndim == 2,  # a residual-stream batch [b, p, d_model] runs each term separately
    )
    with decomposition.patched():
        full = decomposition.model(tokens)
    return {
        "ci_l0": {name: float(ci_l0(g, threshold)) for name, (g, _) in ci.items()},
        "alive": {name: int((g.flatten(0, 1) > threshold).any(0).sum()) for name, (g, _) in ci.items()},
        "faithfulness": float(decomposition.faithfulness_loss()),
        "kl_stochastic": float(kls["stochastic_recon"]),
        "kl_ci_masked": float(kls["ci_masked_recon"]),
        "kl_unmasked": float(kl_divergence(target, full, positions)),
    }

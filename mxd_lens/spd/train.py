"""Train an SPD decomposition of a frozen TransformerLens model.

A step: one clean forward (target logits and every module's input, no grad), the CI functions on those
inputs, the reconstruction terms with nonzero coefficients as one fused forward of the decomposed
model, faithfulness and minimality, backward, AdamW (no weight decay). p of the minimality loss goes
linearly from ``p_start`` (step 0) to ``p_end``, reached after ``p_anneal_fraction`` of the steps and
kept after (``p_start == p_end``: the reference's constant p); the learning rate warms up linearly,
then stays constant or follows a cosine to 0.

Normalisation: the KL is averaged over batch and ``positions`` ("all", as the reference, or "last");
the minimality is averaged over positions (``minimality_reduce="mean"``) or summed over a sequence's
positions (``"sum"``). With a last-position KL and the mean, the minimality's pressure per position is
1/T of the KL's at the last position; "sum" makes it equal, as "all" with "mean" does.

Faithfulness warmup (the reference's): before step 0, ``faithfulness_warmup_steps`` AdamW steps on the
faithfulness loss alone, on the components only (lr ``faithfulness_warmup_lr``, weight decay
``faithfulness_warmup_weight_decay``); deterministic, so a run killed before its first checkpoint
repeats it exactly. Its start and end loss go to ``out_dir/faithfulness_warmup.json``.

Checkpoints (``out_dir/checkpoints/step_NNNNNNNNN/state.pt``) hold the decomposition, the optimizer,
the mask generator's state, the step and the metric history; each is written to a temporary folder and
renamed, and ``latest`` names the newest whole one, so ``fit(resume=True)`` after a kill ends with
exactly the parameters of an unbroken run (with ``batches`` a function of the step; an iterator is
fast-forwarded by drawing the batches already used).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from mxd_lens.config import scheduled_lr
from mxd_lens.fileio import atomic_write_text
from mxd_lens.loop import TrainingLoop
from mxd_lens.spd.ci import CI_TYPES
from mxd_lens.spd.components import Decomposition
from mxd_lens.spd.losses import (
    MASK_TYPES,
    MINIMALITY_REDUCE,
    POSITIONS,
    RECONSTRUCTIONS,
    importance_minimality_loss,
    kl_divergence,
    reconstruction_losses,
)

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

log = logging.getLogger(__name__)

COEFFICIENTS = ("faithfulness", *RECONSTRUCTIONS, "minimality")
# Settings that may change between a checkpoint and its resumption without changing what is trained.
# The exact speed-ups (ci_chunked, ci_distinct_rows, routed_rows_only) are free too: they change rounding.
_FREE = (
    "steps", "log_every", "checkpoint_every", "keep_checkpoints",
    "ci_chunked", "ci_distinct_rows", "routed_rows_only",
)  # fmt: skip


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
    p_anneal_fraction: float = 1.0  # p reaches p_end after this fraction of the steps, then stays
    positions: Literal["all", "last"] = "all"
    minimality_reduce: Literal["mean", "sum"] = "mean"  # over positions; see the module docstring
    faithfulness_warmup_steps: int = 0
    faithfulness_warmup_lr: float = 1e-2
    faithfulness_warmup_weight_decay: float = 0.1
    fuse_runs: bool = True  # all reconstruction forwards as one (more memory, far less overhead)
    # Exact speed-ups (the same maths, other rounding; docs/spd.md, "Speed"):
    ci_chunked: bool = True  # CI MLP in cache-sized chunks, hidden layer recomputed in backward
    ci_distinct_rows: bool = True  # token CI once per distinct input row (layer 0 reads embeddings)
    routed_rows_only: bool = True  # a module's components only on the batch rows routed through it
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
            ("minimality_reduce", self.minimality_reduce, MINIMALITY_REDUCE),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {allowed}")
        if not 0 < self.p_anneal_fraction <= 1:
            raise ValueError(f"p_anneal_fraction={self.p_anneal_fraction} must be in (0, 1]")
        if self.faithfulness_warmup_steps < 0 or not self.faithfulness_warmup_lr > 0:
            raise ValueError(
                f"need faithfulness_warmup_steps >= 0 and faithfulness_warmup_lr > 0, got "
                f"{self.faithfulness_warmup_steps}, {self.faithfulness_warmup_lr}"
            )
        negative = {name: getattr(self, name) for name in COEFFICIENTS if not getattr(self, name) >= 0}
        if negative:
            raise ValueError(f"loss coefficients must be >= 0 (and not NaN); got {negative}")
        if self.faithfulness == 0 and not any(getattr(self, name) for name in RECONSTRUCTIONS):
            raise ValueError(
                "these loss coefficients leave nothing to train: faithfulness and every reconstruction "
                f"coefficient ({', '.join(RECONSTRUCTIONS)}) are 0; set stochastic_recon=1 for instance"
            )

    def lr_at(self, step: int) -> float:
        return scheduled_lr(step, self.steps, self.lr, self.warmup_steps, self.lr_schedule)

    def p_at(self, step: int) -> float:
        span = max(1.0, self.p_anneal_fraction * (self.steps - 1))
        return self.p_start + (self.p_end - self.p_start) * min(1.0, step / span)

    def decomposition_kwargs(self) -> dict[str, Any]:
        return dict(
            C=self.C,
            ci=self.ci,
            ci_hidden=self.ci_hidden,
            seed=self.seed,
            ci_attn_dim=self.ci_attn_dim,
            delta=self.delta,
            ci_chunked=self.ci_chunked,
            ci_distinct_rows=self.ci_distinct_rows,
            routed_rows_only=self.routed_rows_only,
        )


Batches = Callable[[int], torch.Tensor] | Iterable[torch.Tensor]


class SPDTrainer(TrainingLoop):
    """Decomposes ``modules`` of ``model`` on ``batches`` (step -> tokens [batch_size, seq], or an
    iterable of such), writing checkpoints and ``metrics.json`` under ``out_dir``. With a
    ``mxd_lens.spd.ablation.ResidualModel`` (the model run from a layer) a batch is the cached residual
    stream [batch_size, seq, d_model] at that layer's input instead. The loop (resume, lr, finite
    checks, checkpoints) is ``mxd_lens.loop.TrainingLoop``'s."""

    desc = "SPD"
    checkpoint_marker = "state.pt"
    checkpoint_at_end = True  # the last checkpoint is the result

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
        self.total_steps, self.log_every = config.steps, config.log_every
        self.checkpoint_every, self.keep_checkpoints = config.checkpoint_every, config.keep_checkpoints
        self.batches = batches
        self.decomposition = Decomposition(model, modules, **config.decomposition_kwargs())
        self.device = next(self.decomposition.parameters()).device
        self.optimizer = torch.optim.AdamW(
            self.decomposition.parameters(), lr=config.lr_at(0), weight_decay=0.0
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.step = 0
        self.history: list[dict[str, float]] = []

    def fit(self, resume: bool = True) -> dict[str, float]:
        """Train to ``config.steps`` (from the latest checkpoint with ``resume``); the last metrics.
        The model's own parameters are frozen meanwhile."""
        frozen = [(p, p.requires_grad) for p in self.model.parameters()]
        self.model.requires_grad_(False)
        try:
            return super().fit(resume)
        finally:
            for param, flag in frozen:
                param.requires_grad_(flag)

    def before_steps(self) -> None:
        if self.step == 0 and self.config.faithfulness_warmup_steps:
            self.faithfulness_warmup()

    def faithfulness_warmup(self) -> dict[str, float]:
        """The warmup stage (module docstring); returns and writes its start and end loss."""
        cfg = self.config
        parameters = [
            p for name, p in self.decomposition.named_parameters() if name.startswith("components.")
        ]
        optimizer = torch.optim.AdamW(
            parameters, lr=cfg.faithfulness_warmup_lr, weight_decay=cfg.faithfulness_warmup_weight_decay
        )
        start = float(self.decomposition.faithfulness_loss().detach())
        for _ in range(cfg.faithfulness_warmup_steps):
            optimizer.zero_grad(set_to_none=True)
            loss = self.decomposition.faithfulness_loss()
            self.check_loss(loss, "faithfulness warmup loss")
            loss.backward()
            optimizer.step()
        end = float(self.decomposition.faithfulness_loss().detach())
        record = {
            "steps": cfg.faithfulness_warmup_steps,
            "faithfulness_start": start,
            "faithfulness_end": end,
        }
        log.info("faithfulness warmup: %d steps, %.3g -> %.3g", record["steps"], start, end)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out_dir / "faithfulness_warmup.json", json.dumps(record, indent=1))
        return record

    # -- the loop (mxd_lens.loop.TrainingLoop runs it) --------------------------------------------
    def lr_at(self, step: int) -> float:
        return self.config.lr_at(step)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def named_parameters(self):
        return self.decomposition.named_parameters()

    def batch_stream(self) -> Iterator[torch.Tensor]:
        if callable(self.batches):
            return (self.batches(step) for step in range(self.step, self.config.steps))
        stream = iter(self.batches)
        for _ in range(self.step):  # resumed: skip the batches the checkpoint has seen
            next(stream)
        return stream

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
            terms["minimality"] = importance_minimality_loss(ci, p, reduce=cfg.minimality_reduce)
        loss = sum(getattr(cfg, name) * value for name, value in terms.items())
        self.check_loss(loss, "SPD loss", {name: float(value.detach()) for name, value in terms.items()})
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            metrics = {"loss": float(loss), **{name: float(value) for name, value in terms.items()}}
            metrics.update(p=p, lr=cfg.lr_at(self.step))
            l0 = {name: float(ci_l0(g)) for name, (g, _) in ci.items()}
            metrics["ci_l0"] = sum(l0.values()) / len(l0)
            metrics.update({f"ci_l0/{name}": value for name, value in l0.items()})
        return metrics

    def record(self, metrics: dict[str, float]) -> dict[str, float]:
        super().record(metrics)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out_dir / "metrics.json", json.dumps(self.history, indent=1))
        return metrics

    def summary(self, metrics: dict[str, float]) -> str:
        short = {
            "loss": "loss",
            "stochastic_recon": "stoch",
            "subset_recon": "subset",
            "layerwise_recon": "layer",
            "ci_masked_recon": "ci_kl",
            "faithfulness": "faith",
            "ci_l0": "L0",
        }
        return " ".join(f"{label} {metrics[key]:.3g}" for key, label in short.items() if key in metrics)

    def finish(self, metrics: dict[str, float]) -> dict[str, float]:
        if not metrics and self.history:  # resumed a finished run
            metrics = {k: v for k, v in self.history[-1].items() if k != "step"}
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

    # -- checkpoints (written and found by TrainingLoop) -------------------------------------------
    def resume_free(self) -> tuple[str, ...]:
        return _FREE

    def identity(self) -> dict[str, Any]:
        from mxd_lens.spd.ci import CI_VERSION

        return {
            "config": asdict(self.config),
            "decomposition": self.decomposition.config(),
            "ci_version": CI_VERSION,  # what the CI computes: another version's checkpoint is refused
        }

    def read_identity(self, folder: Path) -> dict[str, Any]:
        saved = super().read_identity(folder)
        # checkpoints from before these options trained as their defaults do
        since = ("p_anneal_fraction", "minimality_reduce", "faithfulness_warmup_steps",
                 "faithfulness_warmup_lr", "faithfulness_warmup_weight_decay")  # fmt: skip
        defaults = asdict(SPDConfig())
        saved["config"] = {**{k: defaults[k] for k in since}, **saved.get("config", {})}
        saved.setdefault("ci_version", 1)  # written before the version was recorded: the first
        return saved

    def write_state(self, folder: Path) -> None:
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
        (folder / "trainer_state.json").write_text(
            json.dumps({"step": self.step, **self.identity()}, indent=1)
        )

    def read_state(self, folder: Path) -> dict[str, Any]:
        return torch.load(folder / "state.pt", map_location=self.device, weights_only=True)

    def apply_state(self, state: dict[str, Any]) -> None:
        if state["generator"].numel() != self.generator.get_state().numel():
            raise ValueError(
                f"the checkpoint's mask generator is from another kind of device than {self.device} (its "
                f"state has {state['generator'].numel()} bytes, this one's {self.generator.get_state().numel()}): "
                "resume on the device type the run started on"
            )
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

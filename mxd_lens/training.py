"""Train many MLP replacements from one activation stream: MxD, transcoders, skip transcoders, several
K and several layers, each learner with its own Adam, all fed by the same batches.

A step: for every learner, ``out = layer(x)`` on the sparse path, the loss against the MLP output,
backward, (unit-norm upkeep of decoder rows: the gradient component parallel to each row removed
before Adam, rows renormalised after), Adam with linear warmup then a constant rate.

Losses: ``"nmse"`` (default) is sum_d (y_hat - y)^2 per token, averaged over tokens and divided by a
constant, the per-token variance of the target on the first batch, so it reads as FVU and, being a
mean of per-token terms, splits exactly over data-parallel ranks. ``"paper"`` is the reference code's
mean_{b,d} (y_hat - y)^2 / ||y_b||. FVU (sum of squared errors over the batch's total variance), the
paper's loss, L0 and the dead fraction are logged for every learner whatever the objective.

Checkpoints hold each learner (SAELens format), its optimizer state and counters, and the stream
position (block, batch); they are written to a temporary folder and renamed, and ``latest`` names the
newest whole one. Resuming restores everything, so a killed run ends bit-identical to an unbroken one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mxd_lens.activations import CachedActivations, ModelActivations, StreamInfo, shuffled_batches
from mxd_lens.checkpoints import CheckpointError, latest_checkpoint, save_checkpoint_dir  # noqa: F401 (CheckpointError re-exported)
from mxd_lens.layers import (
    MLPReplacement,
    MxD,
    MxDConfig,
    SkipTranscoder,
    SkipTranscoderConfig,
    Transcoder,
    TranscoderConfig,
)
from mxd_lens.matching import match_experts

ARCHITECTURES = ("mxd", "transcoder", "skip_transcoder")


class TrainingDiverged(FloatingPointError):
    """A loss or activation became NaN/Inf; the message says where the last good checkpoint is."""


@dataclass
class LearnerSpec:
    """One layer to train. ``width_multiplier`` m sets the transcoder width H = m * d_in; an MxD gets
    the experts that match that transcoder's parameters (``match_experts``)."""

    arch: Literal["mxd", "transcoder", "skip_transcoder"]
    layer: int
    k: int
    width_multiplier: int = 8
    init: Literal["default", "mlp"] = "default"  # "mlp": MxD's E, b_E, D copied from the host MLP
    normalize_decoder: bool | None = None  # None: on for MxD and transcoder, off for the skip transcoder

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch {self.arch!r} unknown; choose one of {ARCHITECTURES}")
        if self.init == "mlp" and self.arch != "mxd":
            raise ValueError(f"init='mlp' copies the host MLP into an MxD; {self.arch} has no such part")

    @property
    def name(self) -> str:
        init = "" if self.init == "default" else f".init-{self.init}"
        return f"L{self.layer}.{self.arch}.k{self.k}.m{self.width_multiplier}{init}"

    @property
    def normalizes_decoder(self) -> bool:
        # The skip transcoder's decoder starts at zero: unit rows are undefined there (NaN in the reference).
        return self.arch != "skip_transcoder" if self.normalize_decoder is None else self.normalize_decoder


@dataclass
class TrainConfig:
    """Paper defaults: Adam, lr 4e-4 (1e-4 for its GPT-2 MxD), 5,000 warmup steps, 4,096 tokens a step."""

    total_tokens: int
    batch_tokens: int = 4096
    lr: float = 4e-4
    warmup_steps: int = 5000
    betas: tuple[float, float] = (0.9, 0.999)
    objective: Literal["nmse", "paper"] = "nmse"
    init_b_dec: Literal["zero", "target_mean"] = "zero"
    seed: int = 0
    dead_window_tokens: int = 1_000_000
    log_every: int = 25
    checkpoint_every: int = 500  # steps; 0: only the final weights
    keep_checkpoints: int = 2
    wandb_project: str | None = None

    def __post_init__(self) -> None:
        if self.batch_tokens <= 0 or self.total_tokens < self.batch_tokens:
            raise ValueError(f"need 0 < batch_tokens={self.batch_tokens} <= total_tokens={self.total_tokens}")
        if self.objective not in ("nmse", "paper"):
            raise ValueError(f"objective {self.objective!r}: choose 'nmse' or 'paper'")
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError(f"lr={self.lr} must be > 0 and warmup_steps={self.warmup_steps} >= 0")
        self.betas = tuple(self.betas)

    @property
    def total_steps(self) -> int:
        return self.total_tokens // self.batch_tokens

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else self.lr


def build_layer(
    spec: LearnerSpec, info: StreamInfo, seed: int, dtype: str = "float32", device: str = "cpu"
) -> MLPReplacement:
    """A fresh layer for ``spec`` on the stream ``info`` describes, initialised from ``seed``."""
    from sae_lens.saes.sae import SAEMetadata

    if spec.layer not in info.layers:
        raise ValueError(f"{spec.name}: the stream holds layers {info.layers}, not {spec.layer}")
    width = spec.width_multiplier * info.d_in
    hook_in, hook_out = info.hook_names[str(spec.layer)]
    common = dict(
        d_in=info.d_in,
        d_out=info.d_out,
        k=spec.k,
        dtype=dtype,
        device=device,
        metadata=SAEMetadata(
            model_name=info.model_name, hook_name=hook_in, hook_name_out=hook_out, hook_layer=spec.layer
        ),
    )
    torch.manual_seed(seed)
    if spec.arch == "mxd":
        n = match_experts(width, info.d_in, info.d_out, info.d_hidden, glu=info.gated)
        cfg = MxDConfig(
            d_sae=n,
            d_hidden=info.d_hidden,
            activation=info.activation,
            hidden_form="glu" if info.gated else "mlp",
            **common,
        )
        return MxD(cfg)
    if spec.arch == "transcoder":
        return Transcoder(TranscoderConfig(d_sae=width, **common))
    return SkipTranscoder(SkipTranscoderConfig(d_sae=width, **common))


@dataclass
class _Learner:
    spec: LearnerSpec
    layer: MLPReplacement
    optimizer: torch.optim.Adam
    last_fired: torch.Tensor  # [d_sae] tokens seen when the unit last fired, -1: never
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Trains ``specs`` on ``source`` and writes checkpoints and final weights under ``out_dir``.

    ``model`` is only needed for ``init="mlp"``. Under ``torchrun`` each rank takes its slice of
    every global batch and gradients are averaged, so N ranks compute the single-process step on the
    same global batch; rank 0 logs and writes.
    """

    def __init__(
        self,
        specs: Sequence[LearnerSpec],
        source: ModelActivations | CachedActivations,
        config: TrainConfig,
        out_dir: str | Path,
        model: Any = None,
        progress: bool = True,
        device: str = "cpu",
        data_info: dict[str, Any] | None = None,
    ):
        names = [spec.name for spec in specs]
        if not specs or len(set(names)) != len(names):
            raise ValueError(f"need one or more learners with distinct names, got {names}")
        self.source, self.config, self.out_dir = source, config, Path(out_dir)
        self.progress, self.device = progress, torch.device(device)
        self.data_info = (
            data_info  # e.g. {"text", "split", "eval_fraction", "split_seed"}: kept with the weights
        )
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if config.batch_tokens % self.world:
            raise ValueError(f"batch_tokens={config.batch_tokens} must divide over {self.world} ranks")
        self.learners: dict[str, _Learner] = {}
        for i, spec in enumerate(specs):
            layer = build_layer(spec, source.info, seed=config.seed * 7919 + i, device=device)
            if spec.init == "mlp":
                if model is None:
                    raise ValueError(f"{spec.name}: init='mlp' needs the model")
                layer.copy_hidden_from_mlp(model, spec.layer)
            # The fused Adam kernel is ~5x faster on CPU for tens of millions of parameters.
            optimizer = torch.optim.Adam(
                layer.parameters(), lr=config.lr_at(0), betas=config.betas, fused=True
            )
            last_fired = torch.full((layer.cfg.d_sae,), -1, dtype=torch.long, device=self.device)
            self.learners[spec.name] = _Learner(spec, layer, optimizer, last_fired)
        self.step = 0
        self.tokens_seen = 0
        self.position = (0, 0)
        self.target_scale: dict[int, float] = {}

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> dict[str, dict[str, float]]:
        """Train to ``total_tokens``; with ``resume`` continue from the latest checkpoint in out_dir."""
        if resume:
            self.load_checkpoint()
        cfg = self.config
        wandb_run = self._wandb() if self.rank == 0 else None
        bar = tqdm(
            total=cfg.total_steps,
            initial=self.step,
            desc="training",
            unit="step",
            disable=not self.progress or self.rank,
        )
        stream = shuffled_batches(self.source, cfg.batch_tokens, cfg.seed, start=self.position)
        last: dict[str, dict[str, float]] = {}
        # Never pull a batch past the last step: at a block boundary that would compute a whole block.
        for (block, batch_index), batch in stream if self.step < cfg.total_steps else ():
            if self.step == 0:
                self._first_batch(batch)
            lo, hi = (
                self.rank * cfg.batch_tokens // self.world,
                (self.rank + 1) * cfg.batch_tokens // self.world,
            )
            for name, learner in self.learners.items():
                x, y = batch[learner.spec.layer]
                last[name] = self._train_step(learner, x[lo:hi].to(self.device), y[lo:hi].to(self.device))
            self.step += 1
            self.tokens_seen += cfg.batch_tokens
            self.position = (block, batch_index + 1)
            for name, metrics in last.items():
                metrics["dead_fraction"] = self._dead_fraction(self.learners[name])
            if self.step % cfg.log_every == 0 or self.step == cfg.total_steps:
                self._log(last, bar, wandb_run)
            bar.update(1)
            if cfg.checkpoint_every and (
                self.step % cfg.checkpoint_every == 0 or self.step == cfg.total_steps
            ):
                self.save_checkpoint()
            if self.step >= cfg.total_steps:
                break
        bar.close()
        if self.step < cfg.total_steps:
            raise ValueError(
                f"the activation stream ran out after {self.step} of {cfg.total_steps} steps "
                f"({self.tokens_seen:,} tokens): give more text or a larger cache, or lower total_tokens"
            )
        if wandb_run is not None:
            wandb_run.finish()
        if not last:  # resumed a finished run: report its last logged metrics
            last = {name: _metrics_only(lr.history[-1]) for name, lr in self.learners.items() if lr.history}
        self.save_final(last)
        return last

    def _first_batch(self, batch: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Loss scale from the whole global batch (same on every rank); optional b_dec = target mean."""
        for layer, (_, y) in batch.items():
            self.target_scale[layer] = float((y - y.mean(0)).pow(2).sum(-1).mean())
        if self.config.init_b_dec == "target_mean":
            with torch.no_grad():
                for learner in self.learners.values():
                    learner.layer.b_dec.copy_(batch[learner.spec.layer][1].mean(0).to(self.device))

    def _train_step(self, learner: _Learner, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        layer, cfg = learner.layer, self.config
        out, values, indices = layer.forward_sparse(x)
        err = out - y
        sq = err.pow(2)
        paper = (sq / y.norm(dim=-1, keepdim=True).clamp_min(1e-12)).mean()
        loss = (
            paper
            if cfg.objective == "paper"
            else sq.sum(-1).mean() / max(self.target_scale[learner.spec.layer], 1e-12)
        )
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"{learner.spec.name}: loss is {loss.item()} at step {self.step}; the last good checkpoint is "
                f"{self.latest_checkpoint() or 'none (no checkpoint written yet)'}; try a lower lr"
            )
        learner.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            for p in layer.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.world)
        if learner.spec.normalizes_decoder:
            _remove_parallel_grad(layer.W_dec)
        for group in learner.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        learner.optimizer.step()
        if learner.spec.normalizes_decoder:
            _normalize_rows(layer.W_dec)
        with torch.no_grad():
            fired = indices[values > 0]
            learner.last_fired[fired] = self.tokens_seen + cfg.batch_tokens
            if self.world > 1:
                dist.all_reduce(learner.last_fired, op=dist.ReduceOp.MAX)
            total_var = (y - y.mean(0)).pow(2).sum()
            return {
                "loss": loss.item(),
                "fvu": float(sq.sum() / total_var.clamp_min(1e-12)),
                "paper_loss": paper.item(),
                "l0": float((values > 0).sum(-1).float().mean()),
            }

    def _dead_fraction(self, learner: _Learner) -> float:
        """Units that have not fired in the last ``dead_window_tokens`` tokens (before a whole window
        has passed: units that never fired)."""
        start = self.tokens_seen - self.config.dead_window_tokens
        return (
            float((learner.last_fired <= start).float().mean())
            if start >= 0
            else float((learner.last_fired < 0).float().mean())
        )

    def _log(self, last: dict[str, dict[str, float]], bar: Any, wandb_run: Any) -> None:
        for name, metrics in last.items():
            self.learners[name].history.append({"step": self.step, "tokens": self.tokens_seen, **metrics})
        if self.rank:
            return
        bar.set_postfix_str(
            " | ".join(
                f"{name}: fvu {m['fvu']:.3f} l0 {m['l0']:.0f} dead {m['dead_fraction']:.2f}"
                for name, m in last.items()
            ),
            refresh=False,
        )
        if wandb_run is not None:
            wandb_run.log(
                {f"{name}/{key}": value for name, m in last.items() for key, value in m.items()},
                step=self.step,
            )

    def _wandb(self) -> Any:
        if not self.config.wandb_project:
            return None
        import wandb

        return wandb.init(project=self.config.wandb_project, config=asdict(self.config))

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir)

    def save_checkpoint(self) -> Path | None:
        """Write the whole training state; on any failure the previous checkpoint stays ``latest``."""
        if self.rank:
            return None

        def fill(folder: Path) -> None:
            for name, learner in self.learners.items():
                learner.layer.save_model(folder / name)
                torch.save(
                    {
                        "optimizer": learner.optimizer.state_dict(),
                        "last_fired": learner.last_fired,
                        "history": learner.history,
                    },
                    folder / name / "train_state.pt",
                )
            state = {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "position": list(self.position),
                "target_scale": {str(k): v for k, v in self.target_scale.items()},
                "config": asdict(self.config),
                "learners": {name: asdict(learner.spec) for name, learner in self.learners.items()},
            }
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))

        return save_checkpoint_dir(self.checkpoint_dir, self.step, fill, self.config.keep_checkpoints)

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        path = Path(path) if path is not None else self.latest_checkpoint()
        if path is None:
            return  # nothing written yet: a fresh start is the resumed run
        state = json.loads((path / "trainer_state.json").read_text())
        ours = {name: asdict(learner.spec) for name, learner in self.learners.items()}
        if state["learners"] != ours:
            raise ValueError(
                f"{path} trained other learners ({sorted(state['learners'])}) than asked ({sorted(ours)})"
            )
        saved, asked = dict(state["config"]), asdict(self.config)
        for free in ("total_tokens", "log_every", "checkpoint_every", "keep_checkpoints", "wandb_project"):
            saved.pop(free), asked.pop(free)
        saved["betas"] = tuple(saved["betas"])
        if saved != asked:
            diff = {k: (saved[k], asked[k]) for k in saved if saved[k] != asked[k]}
            raise ValueError(f"{path} was trained with other settings (checkpoint, asked): {diff}")
        from safetensors.torch import load_file

        for name, learner in self.learners.items():
            weights = load_file(path / name / "sae_weights.safetensors")
            with torch.no_grad():
                for key, param in learner.layer.state_dict().items():
                    param.copy_(weights[key])
            train_state = torch.load(
                path / name / "train_state.pt", weights_only=True, map_location=self.device
            )
            learner.optimizer.load_state_dict(train_state["optimizer"])
            learner.last_fired = train_state["last_fired"]
            learner.history = train_state["history"]
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.position = tuple(state["position"])
        self.target_scale = {int(k): v for k, v in state["target_scale"].items()}

    def save_final(self, metrics: dict[str, dict[str, float]]) -> dict[str, Path]:
        """Each learner in SAELens format under ``out_dir/final/NAME`` with the training config, the
        token count and the last metrics in ``cfg.metadata.training``."""
        if self.rank:
            return {}
        paths = {}
        for name, learner in self.learners.items():
            learner.layer.cfg.metadata.training = {
                "config": asdict(self.config),
                "learner": asdict(learner.spec),
                "tokens": self.tokens_seen,
                "steps": self.step,
                "data": self.data_info,
                "metrics": metrics.get(name, {}),
            }
            paths[name] = self.out_dir / "final" / name
            learner.layer.save_model(paths[name])
        (self.out_dir / "final" / "metrics.json").write_text(
            json.dumps({name: learner.history for name, learner in self.learners.items()}, indent=1)
        )
        return paths


def _metrics_only(record: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in record.items() if key not in ("step", "tokens")}


@torch.no_grad()
def _remove_parallel_grad(W: torch.nn.Parameter) -> None:
    if W.grad is None:
        return
    unit = W / W.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    W.grad.sub_((W.grad * unit).sum(-1, keepdim=True) * unit)


@torch.no_grad()
def _normalize_rows(W: torch.nn.Parameter) -> None:
    norms = W.norm(dim=-1, keepdim=True)
    W.div_(torch.where(norms > 0, norms, torch.ones_like(norms)))

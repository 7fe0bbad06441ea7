"""Train many MLP replacements from one activation stream: MxD, transcoders, skip transcoders, several
K and several layers, each learner with its own Adam, all fed by the same batches.

The loss lives in the layers (``MLPReplacement.training_forward_pass``: reconstruction and AuxK); this
trainer is generic over them. A step, for every learner: the layer's loss terms on the batch, backward,
gradients averaged over data-parallel ranks, the gradient component parallel to each unit-norm decoder
row removed, Adam at the scheduled rate, decoder rows renormalised.

The recipe (defaults, chosen from the measurements in docs/training.md):

- **Activation normalisation** (``normalize``, as SAELens's ``normalize_activations``): inputs, and by
  default targets, are scaled by constants estimated on the first ``norm_tokens`` tokens so that
  E||x||^2 = d_in (E||y||^2 = d_out). Layers train on scaled activations; the scales are folded into
  the saved weights (``fold_activation_scales``), so a saved layer reads the raw MLP input and writes
  the raw MLP output.
- **Epochs over a cache**: ``epochs`` (or ``total_tokens`` beyond one pass) re-reads a cache under a
  fresh global shuffle each epoch; a live stream is read once.
- **AuxK** (``aux_coefficient`` 1/2, ``k_aux`` d_out / 2): units that have not fired in the last
  ``dead_window_tokens`` learn to reconstruct the residual error (see ``mxd_lens.firing`` for "dead").
- **Learning rate**: linear warmup over ``warmup_steps`` (default ``warmup_fraction`` of the run),
  then constant, or with ``lr_schedule`` "linear"/"cosine" a decay over the last ``decay_fraction`` of
  the run to ``lr_floor`` x lr.

Checkpoints hold each learner (SAELens format, scales folded, so a checkpoint's layer is usable as it
is), its exact training weights, optimizer state and counters, and the stream offset; they are written
to a temporary folder and renamed, and ``latest`` names the newest whole one. Resuming restores
everything, so a killed run ends bit-identical to an unbroken one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Literal

import torch
import torch.distributed as dist

from mxd_lens.activations import (
    CachedActivations,
    ModelActivations,
    open_stream,
    shuffled_batches,
    upgrade_stream_record,
)
from mxd_lens.config import TrainConfig, TrainRun
from mxd_lens.fileio import atomic_write_text
from mxd_lens.firing import FiringTracker
from mxd_lens.layers import MLPReplacement
from mxd_lens.layers.learners import LearnerSpec, build_learners, check_archs, learner_specs
from mxd_lens.loop import TrainingLoop, _wrapped
from mxd_lens.records import TrainingRecord

# Settings that may change between a checkpoint and its resumption without changing what is trained.
_FREE = ("total_tokens", "epochs", "log_every", "checkpoint_every", "keep_checkpoints", "wandb_project")


log = logging.getLogger(__name__)
# The most memory the normalisation sample may hold: every block's (input, output) over the first --norm-tokens
# tokens, kept until the first step to be trained on. One SmolLM2 block at the default 65,536 tokens is 0.3 GB
# (unchanged under the cap); all 30 would be 9 GB, so there the sample is cut to the cap (~14,500 tokens).
NORM_SAMPLE_BYTES = 2**31


@dataclass
class _Learner:
    spec: LearnerSpec  # what was asked: the learner's name, its checkpoint identity and saved record
    layer: MLPReplacement  # trains on scaled activations; ``Trainer.trained_layers`` gives raw-scale copies
    block: int
    raw_scale: Literal["all", "copied"] | None  # what of the layer reads raw activations until the
    # scales are known: all of it (a layer built by the caller), the parts copied from the host MLP
    normalize_decoder: bool
    optimizer: torch.optim.Adam
    firing: FiringTracker
    history: list[dict[str, float]] = field(default_factory=list)
    clipped: int = 0  # steps whose gradient norm was over TrainConfig.grad_clip


def train(run: TrainRun) -> dict[str, dict[str, float]]:
    """Run ``run`` (``mxd-lens train``): open its activations, train every learner, write the final
    layers to ``run.out``/final and the run itself to ``run.out``/run.json. Under ``torchrun`` each rank
    calls this; the process group is set up here if the launcher asked for one. Returns each learner's
    last metrics."""
    import os

    check_archs(run.learners.arch)
    started = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if run.device.startswith("cuda") else "gloo")
    try:
        source, model = open_stream(run.stream, run.cache, run.blocks, run.shuffle)
        specs = learner_specs(run.learners, source.blocks)
        trainer = Trainer(specs, source, run.train, run.out, model=model, progress=not run.no_progress,
                          device=run.device, data_info=source.text_info)  # fmt: skip
        trainer.run_record = asdict(run)
        trainer.time_limit_s = None if run.max_minutes is None else run.max_minutes * 60
        return trainer.fit(resume=run.resume)
    finally:
        if started:
            dist.destroy_process_group()


class Trainer(TrainingLoop):
    """Trains ``specs`` on ``source`` and writes checkpoints and final weights under ``out_dir``.

    Each entry of ``specs`` is a ``LearnerSpec`` (the trainer builds the layer) or a layer built by
    the caller (e.g. ``MxD.from_mlp(model, 6, n_experts=1024, k=32)``, or a chosen N), trained in
    place; ``trained_layers()`` gives every learner at raw scale. Without ``out_dir`` nothing is
    written (no checkpoints, no final folder, no resume). ``model`` is only needed for ``init="mlp"``. Under ``torchrun`` each rank takes its slice of
    every global batch and gradients are averaged, so N ranks compute the single-process step on the
    same global batch; rank 0 logs and writes. ``progress=False`` prints the metrics as text lines
    every ``log_every`` steps instead of a progress bar.
    """

    def __init__(
        self,
        specs: Sequence[LearnerSpec | MLPReplacement],
        source: ModelActivations | CachedActivations,
        config: TrainConfig,
        out_dir: str | Path | None = None,
        model: Any = None,
        progress: bool = True,
        device: str = "cpu",
        data_info: dict[str, Any] | None = None,
    ):
        self.source, self.config = source, config
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress, self.device = progress, torch.device(device)
        self.log_every, self.checkpoint_every = config.log_every, config.checkpoint_every
        self.keep_checkpoints = config.keep_checkpoints
        self.data_info = (
            data_info  # e.g. {"text", "split", "eval_fraction", "split_seed"}: kept with the weights
        )
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if config.batch_tokens % self.world:
            raise ValueError(f"batch_tokens={config.batch_tokens} must divide over {self.world} ranks")
        self.epoch_tokens = getattr(source, "epoch_tokens", None)
        self.total_tokens, self.total_steps, self.dead_window = config.budget(
            self.epoch_tokens, say=not self.rank
        )
        self.k_aux = config.k_aux if config.k_aux is not None else max(1, source.info.d_out // 2)
        # Specs become layers here, once; from now on the trainer works on the layers.
        admitted, _ = build_learners(specs, source.info, config.seed, model, device)
        self.learners: dict[str, _Learner] = {}
        for spec, layer in admitted:
            if config.aux_coefficient > 0 and self.k_aux > layer.cfg.d_sae - layer.cfg.k:
                raise ValueError(
                    f"{spec.name}: k_aux={self.k_aux} exceeds the {layer.cfg.d_sae - layer.cfg.k} units "
                    f"outside the TopK (d_sae={layer.cfg.d_sae}, k={layer.cfg.k}); lower k_aux"
                )
            # The fused Adam kernel is ~5x faster on CPU for tens of millions of parameters.
            # lr_scale: the learner's own rate relative to the run's, applied by the loop at every step
            scale = 1.0 if spec.lr is None else spec.lr / config.lr
            optimizer = torch.optim.Adam(
                [{"params": list(layer.parameters()), "lr_scale": scale}],
                lr=config.lr_at(0, self.total_steps) * scale,
                betas=config.betas,
                fused=True,
            )
            self.learners[spec.name] = _Learner(
                spec,
                layer,
                block=spec.block,
                raw_scale={"given": "all", "mlp": "copied"}.get(spec.init),
                normalize_decoder=spec.normalizes_decoder,
                optimizer=optimizer,
                firing=FiringTracker(layer.cfg.d_sae, device),
            )
        self.step = 0
        self.tokens_seen = 0
        self.scales: dict[int, tuple[float, float]] = {}  # block -> (input scale, output scale)
        self.loss_scale: dict[int, float] = {}  # block -> per-token variance of the (scaled) target
        self._wandb_run: Any = None
        self.run_record: dict[str, Any] | None = None  # the TrainRun, written to out_dir/run.json (train())
        self._resume_state = TrainerState(self)

    def lr_at(self, step: int) -> float:
        return self.config.lr_at(step, self.total_steps)

    def load_checkpoint(self, path: str | Path | None = None) -> Path | None:
        """The loop's (``TrainingLoop.load_checkpoint``); and where the folder holds no checkpoint yet (a
        first part that ended before its first one), a resumed ``mxd-lens train`` is held against the run
        its run.json records instead, so that other settings are refused as a checkpoint's would be."""
        folder = super().load_checkpoint(path)
        if folder is None and path is None:
            self._check_recorded_run()
        return folder

    def _check_recorded_run(self) -> None:
        """Raise ``ResumeMismatch`` naming each setting (of the recipe, but those free to change on a
        resume, and of the learners) in which ``run_record`` differs from the run ``out_dir/run.json``
        records; fields one of them lacks (added since) are not differences."""
        from mxd_lens.fileio import read_json
        from mxd_lens.loop import ResumeMismatch, differences

        recorded_file = None if self.out_dir is None else self.out_dir / "run.json"
        if self.run_record is None or recorded_file is None or not recorded_file.is_file():
            return
        recorded, asked = read_json(recorded_file), json.loads(json.dumps(self.run_record))
        if not isinstance(recorded, dict):
            raise ValueError(f"{recorded_file} holds a JSON {type(recorded).__name__}, not a run's record")
        diff = {}
        for part, free in (("train", _FREE), ("learners", ())):
            there, here = recorded.get(part), asked.get(part)
            if isinstance(there, dict) and isinstance(here, dict):
                shared = there.keys() & here.keys()
                found = differences({k: there[k] for k in shared}, {k: here[k] for k in shared}, free)
                diff.update({(k if part == "train" else f"{part}.{k}"): v for k, v in found.items()})
        if not diff:
            return
        final = self.out_dir / "final"
        if final.is_dir() and any(final.iterdir()):  # finished without checkpoints (checkpoint_every 0)
            how = "it finished without checkpoints: to train with these, give another output folder"
        else:
            how = (
                "it has no checkpoint yet, so nothing trained is lost: ask for the recorded settings to "
                "resume it, or leave out --resume to start it again with these"
            )
        raise ResumeMismatch(
            f"{recorded_file} records a run with other settings (recorded, asked): {diff}; {how}"
        )

    def before_steps(self) -> None:
        """The run's whole configuration, once the folder is ours (locked, and a fresh run's found empty);
        the metrics log cut back to the step the run goes on from (a resumed run logs those steps again)."""
        if self.out_dir is None or self.rank:
            return
        if self.run_record is not None:
            atomic_write_text(self.out_dir / "run.json", json.dumps(self.run_record, indent=1) + "\n")
        log_file = self.out_dir / METRICS_LOG
        if log_file.is_file():
            kept = [
                line
                for line in log_file.read_text().splitlines(keepends=True)
                if _logged_at(line) <= self.step
            ]
            atomic_write_text(log_file, "".join(kept))
        if len(self.learners) > _ONE_LINE_EACH:
            blocks = len({learner.block for learner in self.learners.values()})
            log.info(
                "%d learners at %d blocks: every %d steps, per kind: FVU median/worst, L0 median, dead worst",
                *(len(self.learners), blocks, self.log_every),
            )
            log.info("every learner's metrics: %s", log_file)
            labels = {label: kind for kind, label in _kinds(list(self.learners)).items()}
            legend = "summary labels: " + "; ".join(f"{label} = {kind}" for label, kind in labels.items())
            for line in _wrapped(legend, sep="; "):
                log.info("%s", line)

    def agree(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def fit(self, resume: bool = False) -> dict[str, dict[str, float]]:
        """Train to the token budget; with ``resume`` continue from the latest intact checkpoint in
        out_dir. The run folder is locked while training: a second trainer on it gets ``RunLocked``.
        Returns each learner's last metrics."""
        return super().fit(resume)

    # -- the loop (mxd_lens.loop.TrainingLoop runs it) --------------------------------------------
    def batch_stream(self):
        stream = shuffled_batches(
            self.source, self.config.batch_tokens, self.config.seed, start=self.tokens_seen
        )
        return stream if self.scales else self._estimate_scales(stream)

    def train_step(self, batch: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, float]]:
        """One step of every learner on ``batch`` (block -> (x, y), the global batch; this rank takes
        its slice)."""
        lo = self.rank * self.config.batch_tokens // self.world
        hi = (self.rank + 1) * self.config.batch_tokens // self.world
        last = {}
        for name, learner in self.learners.items():
            x, y = batch[learner.block]
            s_in, s_out = self.scales[learner.block]
            x, y = x[lo:hi].to(self.device), y[lo:hi].to(self.device)
            last[name] = self._train_step(learner, x * s_in, y * s_out)
        self.tokens_seen += self.config.batch_tokens
        for name, metrics in last.items():
            metrics["dead_fraction"] = self.learners[name].firing.dead_fraction(self.dead_window)
            metrics["lr"] = self.lr_at(self.step)
        return last

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [learner.optimizer for learner in self.learners.values()]

    def named_parameters(self):
        for name, learner in self.learners.items():
            for key, param in learner.layer.named_parameters():
                yield f"{name}.{key}", param

    def ran_out_hint(self) -> str:
        return (
            f"{self.tokens_seen:,} tokens; give more text, or cache it (`mxd-lens cache`) and train for "
            "several epochs"
        )

    def record(self, metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for name, values in metrics.items():
            self.learners[name].history.append({"step": self.step, "tokens": self.tokens_seen, **values})
        if self.rank == 0 and self.out_dir is not None:  # one JSON line per log step, every learner
            line = {
                "step": self.step,
                "tokens": self.tokens_seen,
                "lr": self.lr_at(self.step - 1),
                "learners": metrics,
            }
            with open(self.out_dir / METRICS_LOG, "a") as f:
                f.write(json.dumps(line) + "\n")
        if self.rank == 0 and self.config.wandb_project:
            if self._wandb_run is None:
                import wandb

                self._wandb_run = wandb.init(project=self.config.wandb_project, config=asdict(self.config))
            self._wandb_run.log(
                {f"{name}/{key}": value for name, m in metrics.items() for key, value in m.items()},
                step=self.step,
            )
        return metrics

    def summary(self, last: dict[str, dict[str, float]]) -> str:
        if len(last) > _ONE_LINE_EACH:
            return summary_by_arch(last)
        return " | ".join(
            f"{name}: fvu {m['fvu']:.3f} l0 {m['l0']:.0f} dead {m['dead_fraction']:.2f}"
            + (f" auxk {m['auxk']:.3f}" if "auxk" in m else "")
            for name, m in last.items()
        )

    def finish(self, last: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if not last:  # resumed a finished run: report its last logged metrics
            last = {name: _metrics_only(lr.history[-1]) for name, lr in self.learners.items() if lr.history}
        if self.out_dir is not None:
            self.save_final(last)
        return last

    def _estimate_scales(self, stream):
        """Scales (and the loss's target variance) from the first ``norm_tokens`` tokens of the global
        stream, the same on every rank; then train on those batches and go on."""
        cfg = self.config
        head, wanted = [], min(cfg.norm_tokens, self.total_tokens)
        for batch in stream:
            head.append(batch)
            if len(head) == 1:  # the sample is held until the first step: cap its memory over all blocks
                size = sum(t.nbytes for pair in batch.values() for t in pair)
                most = max(1, NORM_SAMPLE_BYTES // max(size, 1)) * cfg.batch_tokens
                if wanted > most:
                    log.info(
                        "normalisation scales from the first %s tokens, not --norm-tokens %s: the sample of %d "
                        "blocks' activations would hold %.1f GB until the first step (the cap is %.1f GB)",
                        f"{most:,}", f"{cfg.norm_tokens:,}", len(batch), wanted / cfg.batch_tokens * size / 1e9,
                        NORM_SAMPLE_BYTES / 1e9,
                    )  # fmt: skip
                    wanted = most
            if len(head) * cfg.batch_tokens >= wanted:
                break
        if not head:
            return iter(())
        for block in head[0]:
            x = torch.cat([b[block][0] for b in head]).double()
            y = torch.cat([b[block][1] for b in head]).double()
            s_in = s_out = 1.0
            if cfg.normalize != "none":
                s_in = float((x.shape[-1] / x.pow(2).sum(-1).mean()).sqrt())
            if cfg.normalize == "input_output":
                s_out = float((y.shape[-1] / y.pow(2).sum(-1).mean()).sqrt())
            if not all(math.isfinite(s) and s > 0 for s in (s_in, s_out)):
                raise FloatingPointError(
                    f"block {block}: activation scales {s_in}, {s_out} are not usable; the stream's "
                    "activations there are zero or not finite"
                )
            self.scales[block] = (s_in, s_out)
            self.loss_scale[block] = float(((y - y.mean(0)) * s_out).pow(2).sum(-1).mean())
        with torch.no_grad():
            for learner in self.learners.values():
                s_in, s_out = self.scales[learner.block]
                if learner.raw_scale == "all":  # built at raw scale: the same map on scaled activations
                    learner.layer.fold_activation_scales(1 / s_in, 1 / s_out)
                elif learner.raw_scale == "copied":
                    learner.layer.scale_copied_mlp(s_in, s_out)
        if cfg.init_b_dec == "target_mean":
            with torch.no_grad():
                for learner in self.learners.values():
                    L = learner.block
                    mean = torch.cat([b[L][1] for b in head]).double().mean(0) * self.scales[L][1]
                    learner.layer.b_dec.copy_(mean.to(learner.layer.b_dec))
        return _chain(head, stream)

    def _train_step(self, learner: _Learner, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        layer, cfg = learner.layer, self.config
        dead = learner.firing.dead_mask(self.dead_window) if cfg.aux_coefficient > 0 else None
        out = layer.training_forward_pass(
            x,
            y,
            loss_scale=self.loss_scale[learner.block],
            objective=cfg.objective,
            dead_mask=dead,
            k_aux=self.k_aux,
            aux_coefficient=cfg.aux_coefficient,
        )
        self.check_loss(out.loss, f"{learner.spec.name}: loss")
        learner.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if self.world > 1:
            for p in layer.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.world)
        if learner.normalize_decoder:
            _remove_parallel_grad(layer.W_dec)
        metrics = dict(out.metrics)
        # The norm before clipping (measured with clipping off too), and how many steps were clipped.
        norm = float(
            torch.nn.utils.clip_grad_norm_(layer.parameters(), cfg.grad_clip or math.inf, foreach=True)
        )
        learner.clipped += cfg.grad_clip is not None and norm > cfg.grad_clip
        metrics.update(grad_norm=norm, clipped_steps=learner.clipped)
        learner.optimizer.step()
        if learner.normalize_decoder:
            _normalize_rows(layer.W_dec)
        with torch.no_grad():
            metrics.update(layer.after_step(out.values.detach(), out.indices))  # e.g. MxD's usage controller
            learner.firing.update(out.values, out.indices, n_tokens=self.config.batch_tokens)
            if self.world > 1:
                dist.all_reduce(learner.firing.last_fired, op=dist.ReduceOp.MAX)
        return metrics

    # -- the layers at raw scale -------------------------------------------------------------------
    def trained_layers(self) -> dict[str, MLPReplacement]:
        """Copies of every learner with the activation scales folded in: they read the raw MLP input
        and write the raw MLP output, as saved, with the training record (config, tokens, scales,
        data, last metrics) in ``cfg.metadata.training``. The learners themselves train on scaled
        activations."""
        layers = {}
        for name, learner in self.learners.items():
            layer = copy.deepcopy(learner.layer)
            s_in, s_out = self.scales.get(learner.block, (1.0, 1.0))
            layer.fold_activation_scales(s_in, s_out)
            history = learner.history[-1] if learner.history else {}
            layer.cfg.metadata.mxd_lens_version = _version()
            # the positions it trained on, as SAELens records them: a splice replaces only those
            layer.cfg.metadata.seqpos_slice = [1, None] if self.source.info.drop_first_position else [None]
            layer.cfg.metadata.training = TrainingRecord(
                model=getattr(self.source, "model_source", None),
                config=asdict(self.config),
                learner=asdict(learner.spec),
                tokens=self.tokens_seen,
                steps=self.step,
                epochs=self.tokens_seen / self.epoch_tokens if self.epoch_tokens else None,
                normalization={"input_scale": s_in, "output_scale": s_out, "folded": True},
                data=self.data_info,
                metrics=_metrics_only(history),
            ).to_dict()
            layers[name] = layer
        return layers

    def _folded(self) -> dict[str, MLPReplacement]:
        """``trained_layers`` once per step: the last checkpoint and the final layers share one fold."""
        if getattr(self, "_folded_at", None) is None or self._folded_at[0] != self.step:
            self._folded_at = (self.step, self.trained_layers())
        return self._folded_at[1]

    # -- checkpoints: what the loop asks (TrainerState) -------------------------------------------
    @property
    def resume_state(self) -> TrainerState:
        return self._resume_state

    def save_final(self, metrics: dict[str, dict[str, float]]) -> dict[str, Path]:
        """Each learner in SAELens format under ``out_dir/final/NAME`` (``trained_layers``: scales
        folded in, the training record and ``metrics`` in ``cfg.metadata.training``)."""
        if self.rank:
            return {}
        paths = {}
        for name, layer in self._folded().items():
            if name in metrics:
                layer.cfg.metadata.training["metrics"] = metrics[name]
            paths[name] = self.out_dir / "final" / name
            layer.save_model(paths[name])
            for stale in paths[name].glob(".*.tmp"):  # left by a run killed while writing (we hold the lock)
                stale.unlink(missing_ok=True)
        atomic_write_text(
            self.out_dir / "final" / "metrics.json",
            json.dumps({name: learner.history for name, learner in self.learners.items()}, indent=1),
        )
        return paths


class TrainerState:
    """A ``Trainer``'s checkpoints as the loop asks about them (``mxd_lens.loop.ResumeState``): what a
    checkpoint must share with the run (its learners, recipe and data), and how the learners' weights,
    optimizers, firing counters and the stream offset are written, read back and applied."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def resume_free(self) -> tuple[str, ...]:
        return _FREE

    def identity(self) -> dict[str, Any]:
        return {
            "learners": {name: asdict(learner.spec) for name, learner in self.trainer.learners.items()},
            "config": asdict(self.trainer.config),
            "data": self.data_identity(),
        }

    def read_identity(self, folder: Path) -> dict[str, Any]:
        saved = json.loads((folder / "trainer_state.json").read_text())
        # Old-data readers: checkpoints written before the renames resume.
        for spec in (saved.get("learners") or {}).values():  # written before LearnerSpec.layer became block
            if "layer" in spec and "block" not in spec:
                spec["block"] = spec.pop("layer")
            spec.setdefault("options", {})  # written before LearnerSpec.options
            spec.setdefault("lr", None)  # and LearnerSpec.lr
        data = saved.get("data")
        if isinstance(data, dict):
            if isinstance(data.get("stream"), dict):  # StreamInfo.layers, rows_per_block: old names
                data["stream"] = upgrade_stream_record(data["stream"])
            if data.get("kind") == "cache":  # a cache's shard count and shuffle, before "block" meant a block
                if "blocks" in data and "shards" not in data:
                    data["shards"] = data.pop("blocks")
                if data.get("shuffle") == "block":
                    data["shuffle"] = "shard"
        return saved

    def write_state(self, folder: Path) -> None:
        folded = self.trainer._folded()
        for name, learner in self.trainer.learners.items():
            folded[name].save_model(folder / name)
            torch.save(
                {
                    "weights": learner.layer.state_dict(),
                    "optimizer": learner.optimizer.state_dict(),
                    "last_fired": learner.firing.last_fired,
                    "history": learner.history,
                    "clipped": learner.clipped,
                },
                folder / name / "train_state.pt",
            )
        state = {
            "step": self.trainer.step,
            "tokens_seen": self.trainer.tokens_seen,
            "scales": {str(k): list(v) for k, v in self.trainer.scales.items()},
            "loss_scale": {str(k): v for k, v in self.trainer.loss_scale.items()},
            **self.identity(),
        }
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=2))

    def comparable(self, part: str, value: Any) -> Any:
        """The text by its content (digests, split), not by how its path was spelled: a resume from
        another directory, or of a run recorded before texts were named by package resource, matches."""
        if part == "data" and isinstance(value, Mapping) and isinstance(value.get("text"), Mapping):
            text = value["text"]
            if "digests" in text:
                return {**value, "text": {k: v for k, v in text.items() if k not in ("text", "path")}}
        return value

    def data_identity(self) -> dict[str, Any]:
        """What the stream is: the cache's settings and size, or the live stream's model, blocks and
        text; a resume on other data is refused by comparing these."""
        source = self.trainer.source
        identity: dict[str, Any] = {"stream": asdict(source.info), "text": self.trainer.data_info}
        if isinstance(source, CachedActivations):
            records = source.records or {}
            sums = [records.get(source.shard_name(i), {}).get("blake2b_256") for i in range(source.n_shards)]
            identity.update(
                kind="cache",
                # the shards' recorded checksums: two caches of other content differ here even when
                # their settings agree (None for a cache written before checksums)
                content=hashlib.blake2b("".join(sums).encode(), digest_size=16).hexdigest()
                if all(sums)
                else None,
                dtype=source.dtype,
                cache_text=source.text_info,
                shards=source.n_shards,
                shuffle=source.shuffle,
                buffer_tokens=source.buffer_tokens,
                chunk_tokens=source.chunk_tokens,
            )
        else:
            identity.update(kind="live", cache_text=getattr(source, "text_info", None))
        return json.loads(json.dumps(identity))  # as a checkpoint stores it (tuples -> lists)

    def read_state(self, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        state = json.loads((folder / "trainer_state.json").read_text())
        learners = {}
        for name, learner in self.trainer.learners.items():
            train_state = torch.load(
                folder / name / "train_state.pt", weights_only=True, map_location=self.trainer.device
            )
            expected = {k: v.shape for k, v in learner.layer.state_dict().items()}
            got = {k: v.shape for k, v in train_state["weights"].items()}
            if expected != got:
                raise ValueError(f"{folder / name}: weights of other shapes than {name} has")
            learners[name] = train_state
        return state, learners

    def apply_state(self, read: tuple[dict[str, Any], dict[str, Any]]) -> None:
        state, learners = read
        for name, learner in self.trainer.learners.items():
            train_state = learners[name]
            with torch.no_grad():
                for key, param in learner.layer.state_dict().items():
                    param.copy_(train_state["weights"][key])
            learner.optimizer.load_state_dict(train_state["optimizer"])
            learner.firing.last_fired = train_state["last_fired"]
            learner.firing.tokens = state["tokens_seen"]
            learner.history = train_state["history"]
            learner.clipped = train_state.get("clipped", 0)  # absent in checkpoints before grad_clip
        self.trainer.step, self.trainer.tokens_seen = state["step"], state["tokens_seen"]
        self.trainer.scales = {int(k): tuple(v) for k, v in state["scales"].items()}
        self.trainer.loss_scale = {int(k): v for k, v in state["loss_scale"].items()}


METRICS_LOG = "metrics.jsonl"  # in the run folder: one line per log step, every learner's metrics
_ONE_LINE_EACH = 4  # up to this many learners the progress line names each; beyond, one summary per arch


def summary_by_arch(metrics: Mapping[str, Mapping[str, float]]) -> str:
    """One short line for any number of learners (``{name: metrics}``): per kind of learner (its blocks
    together), FVU median and worst, L0 median, the largest dead fraction."""
    kinds = _kinds(list(metrics))
    groups: dict[str, list[Mapping[str, float]]] = {}
    for name, m in metrics.items():
        groups.setdefault(kinds[_kind(name)], []).append(m)
    return " | ".join(
        f"{label} fvu {_num(median([m['fvu'] for m in ms]))}/{_num(max(m['fvu'] for m in ms))} "
        f"l0 {median([m['l0'] for m in ms]):.0f} dead {_num(max(m.get('dead_fraction', 0.0) for m in ms))}"
        for label, ms in groups.items()
    )


def _kind(name: str) -> str:
    """A learner's name without its block: ``L15.mxd-gate=topk.k32.m8`` -> ``mxd-gate=topk.k32.m8``."""
    block, _, rest = name.partition(".")
    return rest if block[:1] == "L" and block[1:].isdigit() else name


def _kinds(names: Sequence[str]) -> dict[str, str]:
    """Each kind of learner's short label: its architecture key (``mxd``, ``skip_transcoder``), numbered
    where kinds share one (``mxd1``, ``mxd2``: other options, K or width)."""
    kinds = list(dict.fromkeys(_kind(name) for name in names))
    keys = {kind: kind.split(".")[0].split("-")[0] for kind in kinds}
    labels = {}
    for kind in kinds:
        same = [other for other in kinds if keys[other] == keys[kind]]
        labels[kind] = keys[kind] if len(same) == 1 else f"{keys[kind]}{same.index(kind) + 1}"
    return labels


def _logged_at(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill: dropped
        return 1 << 62


def _num(x: float) -> str:
    """A fraction in few characters: .082, 1.31."""
    text = f"{x:.3f}" if x < 10 else f"{x:.1f}"
    return text[1:] if text.startswith("0.") else text


def _version() -> str:
    from mxd_lens import __version__

    return __version__


def _chain(head, stream):
    yield from head
    yield from stream


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

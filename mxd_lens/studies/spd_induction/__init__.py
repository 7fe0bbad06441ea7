"""The options of SPD of the toy induction model (``run.py``; docs/spd.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_MINIMALITY = 1e-2  # runs at another minimality coefficient get a -minM suffix


@dataclass
class SPDInductionOptions:
    """SPD of the toy induction model's 8 attention projections (Q, K, V, O x 2 layers), four variants and
    the reference recipe's (ref-): ACTION time (s/step in a scratch folder), train (resumes from its
    checkpoints), report (one variant), summary (every variant found). Writes OUT/VARIANT/{checkpoints/,
    metrics.json, run_config.json, train_log.jsonl, report.json, ci_by_position.png} (with --trend-every
    also trend.jsonl, trend.png) and OUT/summary.json, OUT/comparison.md, OUT/modules.md. Any
    --minimality other than 1e-2 writes OUT/VARIANT-minM/."""

    variant: Literal[
        "token-subset", "token-stoch", "sequence-subset", "sequence-stoch",
        "ref-token-subset", "ref-token-stoch", "ref-sequence-subset", "ref-sequence-stoch",
    ] = "sequence-subset"  # fmt: skip
    """CI function x reconstruction terms (ref-: the reference recipe, see the module docstring)"""
    model: str | None = None
    """model.pt (default: model-long if trained further, else model, under the results root)"""
    steps: int = 6000
    """total SPD steps (sets the p schedule)"""
    batch_size: int = 16
    """sequences per step"""
    minimality: float = DEFAULT_MINIMALITY
    """minimality coefficient"""
    C: int | None = None
    """components per module (default: the recipe's, 32 or 100)"""
    ci_hidden: int | None = None
    """CI hidden width (default: the recipe's, 16 or 128)"""
    device: str = "cpu"
    """where to train (e.g. cuda); a run resumes on the kind of device it started on (the mask
    generator's state is per device type; another is refused)"""
    trend_every: int = 0
    """train in chunks of this many steps and after each record CI-L0 per module and position on a
    128-sequence batch in OUT/NAME/trend.jsonl (+ trend.png); 0: no trend"""
    until: int = 0
    """train: stop this sitting at this step (0: at --steps); the schedules still span --steps, so
    sittings of any length make one run"""
    keep_in: str | None = None
    """train: a folder, e.g. in the repository (docs/results/spd/NAME), that keeps the run's resumable
    state: after every --trend-every chunk and at the end of a sitting the latest checkpoint, the model,
    run_config.json, metrics.json, trend.jsonl and train_log.jsonl are copied there (replacing the last
    copy; a few MB for the toy). A run whose folder has no checkpoint resumes from it (a fresh clone):
    commit the folder and the run outlives the machine. Locked while a run keeps there (a second is
    refused); a kept state of another run, or a damaged one, is refused before anything is copied"""
    pgd_steps: int = 20
    """report: steps of the adversarial (PGD) mask search whose KL and accuracy are reported next to the
    stochastic masks' (mxd_lens.spd.adversarial; 0: none)"""
    pruning_draws: int = 0
    """report: for each module whose CI-L0 at its expected position exceeds the paper's count, what
    switching the extra components off there would cost the training objective, over this many paired
    mask draws on 64 sequences (mxd_lens.spd.pruning; ~1 s per draw and module; 0: not measured)"""
    action: Literal["time", "train", "report", "summary"] = field(
        default="train", metadata={"positional": True}
    )
    """time: s/step in a scratch folder; train (resumes); report; summary over every variant"""

    @property
    def name(self) -> str:
        from mxd_lens.studies.spd_induction.run import run_name

        return run_name(self.variant, self.minimality, self.C, self.ci_hidden)

    def config(self, steps: int | None = None) -> Any:
        """The SPDConfig of this run (``steps``: another total, e.g. for timing)."""
        from mxd_lens.studies.spd_induction.run import make_config

        steps = self.steps if steps is None else steps
        return make_config(self.variant, steps, self.batch_size, self.minimality, self.C, self.ci_hidden)


@dataclass
class InductionModelOptions:
    """Train the toy induction-head model that spd-induction decomposes (docs/spd.md, "The toy induction
    study"), resuming from OUT's latest checkpoint: OUT/model.pt, history.json, checkpoints/, curves.png
    and final_stats.json (held-out accuracy, the expected circuit's attention). The fields are the keyword
    arguments of mxd_lens.spd.induction.train_induction_model, with its defaults (a test checks)."""

    steps: int = 20_000
    """most training steps"""
    positional: str = "after_projection"
    """after_projection: the reference's model (position code added to q and k after W_Q/W_K, no
    biases); shortformer: TransformerLens's (code added to the input of W_Q/W_K)"""
    batch_size: int = 1024
    """sequences per step"""
    lr: float = 1e-3
    """AdamW learning rate"""
    seed: int = 0
    """init and data seed"""
    plateau: bool = True
    """raise the lr x3 once after a 1500-step plateau (Plateau()); false: keep it fixed"""
    target_accuracy: float | None = 0.995
    """stop when held-out accuracy reaches this (may change when resuming; None: never, e.g. with
    stop_window to train to the loss plateau)"""
    stop_window: int = 0
    """also stop when the held-out loss has not fallen by more than stop_tolerance (relative) over
    this many steps (0: never; may change when resuming)"""
    stop_tolerance: float = 0.01
    """relative fall of the held-out loss that counts as progress for stop_window"""
    eval_every: int = 100
    """steps between held-out evaluations"""
    eval_size: int = 4096
    """held-out sequences"""
    checkpoint_every: int = 500
    """steps between checkpoints (0: none)"""
    keep_checkpoints: int = 2
    """checkpoints kept"""

    def train(self, out_dir: Any, progress: bool = True) -> tuple[Any, dict[str, Any]]:
        """``train_induction_model`` with these settings: (model, history)."""
        from dataclasses import asdict

        from mxd_lens.spd.induction import DEFAULT_PLATEAU, train_induction_model

        settings = asdict(self)
        settings["plateau"] = DEFAULT_PLATEAU if self.plateau else None
        return train_induction_model(out_dir, progress=progress, **settings)

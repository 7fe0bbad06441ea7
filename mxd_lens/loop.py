"""The training loop every trainer in the library runs: the layer trainer (``mxd_lens.training``),
the SPD trainer (``mxd_lens.spd.train``) and the induction toy-model trainer (``mxd_lens.spd.induction``).

A trainer subclasses :class:`TrainingLoop` and says what a step is (``train_step``), what its batches
are (``batches``), what its state is (``write_state`` / ``read_state`` / ``apply_state``) and what must
match for a resume (``identity``). The loop owns everything else, once: the run-folder lock, resuming
from the newest intact checkpoint (a damaged one falls back to an older one with a warning; one trained
with other settings or data is refused with the difference named), the learning rate of every step,
the finite checks (a non-finite loss before any update is applied, non-finite weights before any
checkpoint is written), the log/checkpoint cadence, the history and the progress bar (or log lines).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from mxd_lens.checkpoints import (
    CheckpointError,
    RunLock,
    checkpoint_candidates,
    latest_checkpoint,
    save_checkpoint_dir,
)

log = logging.getLogger(__name__)


class TrainingDiverged(FloatingPointError):
    """A loss or the weights went non-finite; the message names the last good checkpoint."""


class RunExists(ValueError):
    """``fit`` without ``resume`` on a folder that already holds a run: refused, nothing overwritten."""


class RunPaused(Exception):
    """A part of a run ended at its time limit (``time_limit_s``, ``--max-minutes``) with a checkpoint;
    ``fit(resume=True)`` continues it. The message says where it stands."""


class ResumeMismatch(ValueError):
    """A checkpoint was trained with other settings, learners or data than the resuming run asks."""


def differences(
    saved: Mapping[str, Any], asked: Mapping[str, Any], free: Iterable[str] = ()
) -> dict[str, tuple]:
    """``{key: (saved, asked)}`` for every key whose values differ, except the ``free`` ones."""
    free = set(free)
    keys = sorted((set(saved) | set(asked)) - free, key=str)
    return {k: (saved.get(k), asked.get(k)) for k in keys if saved.get(k) != asked.get(k)}


class ResumeState(Protocol):
    """What the loop asks about a run's checkpoints (``TrainingLoop.resume_state``): the identity a
    checkpoint must share with the run to be resumed, and how the whole training state is written,
    read back (checked, before any of it is applied) and applied."""

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed (JSON values)."""

    def read_identity(self, folder: Path) -> dict[str, Any]:
        """A checkpoint's identity; raise if it is damaged."""

    def comparable(self, part: str, value: Any) -> Any:
        """What of an identity ``part`` a resume must match (e.g. a text's digests, not its path)."""

    def resume_free(self) -> tuple[str, ...]:
        """Keys of the identity's "config" that may change between a checkpoint and its resumption."""

    def write_state(self, folder: Path) -> None:
        """Write the whole training state (with ``identity()``) into the fresh folder ``folder``."""

    def read_state(self, folder: Path) -> Any:
        """Read (and check) everything a resume needs; raise if damaged."""

    def apply_state(self, state: Any) -> None:
        """Make the run continue from ``state`` (what ``read_state`` returned)."""


class TrainingLoop:
    """The shared loop; see the module docstring. Subclasses set, in ``__init__``:

    ``out_dir`` (None: nothing written, no resume), ``total_steps``, ``progress``, ``log_every``,
    ``checkpoint_every`` (0: no periodic checkpoints), ``keep_checkpoints``, and may set ``rank``
    (only rank 0 writes and logs), ``desc`` (the bar's label) and ``checkpoint_marker`` (a file every
    whole checkpoint holds). ``step`` counts finished steps.
    """

    out_dir: Path | None = None
    total_steps: int = 0
    progress: bool = True
    log_every: int = 10
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    rank: int = 0
    step: int = 0
    desc: str = "training"
    checkpoint_marker: str | None = None
    checkpoint_at_end: bool = False  # also with checkpoint_every=0 (when the checkpoint is the output)
    lock_label: str = "trainer"
    time_limit_s: float | None = None  # end this call of fit with a checkpoint after this long (RunPaused)

    # -- what a trainer says ---------------------------------------------------------------------
    @property
    def resume_state(self) -> ResumeState:
        """The object the loop asks about checkpoints (``ResumeState``). By default the trainer itself,
        with the methods below; ``mxd_lens.training.Trainer`` keeps them in an object of their own."""
        return self

    def batch_stream(self) -> Iterator[Any]:
        """The batches from step ``self.step`` on (a resumed run skips what the checkpoint has seen)."""
        raise NotImplementedError

    def train_step(self, batch: Any) -> dict[str, Any]:
        """One step at rate ``self.lr_at(self.step)``; check losses with :meth:`check_loss` before
        ``backward`` so a diverged step applies nothing. Returns its metrics."""
        raise NotImplementedError

    def lr_at(self, step: int) -> float:
        raise NotImplementedError

    def optimizers(self) -> list[torch.optim.Optimizer]:
        raise NotImplementedError

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every trained tensor, checked finite before each checkpoint."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed (JSON values)."""
        raise NotImplementedError

    def write_state(self, folder: Path) -> None:
        """Write the whole training state (with ``identity()``) into the fresh folder ``folder``."""
        raise NotImplementedError

    def read_identity(self, folder: Path) -> dict[str, Any]:
        """A checkpoint's identity (by default from its ``trainer_state.json``); raise if damaged."""
        return json.loads((folder / "trainer_state.json").read_text())

    def read_state(self, folder: Path) -> Any:
        """Read (and check) everything a resume needs before any of it is applied; raise if damaged."""
        raise NotImplementedError

    def apply_state(self, state: Any) -> None:
        raise NotImplementedError

    def record(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Called every ``log_every`` steps and at the end: keep ``metrics`` in the history; returns
        what the bar / log line shows."""
        self.history.append({"step": self.step, **metrics})
        return metrics

    def summary(self, shown: dict[str, Any]) -> str:
        return " ".join(f"{k} {v:.3g}" for k, v in shown.items() if isinstance(v, float))

    def before_steps(self) -> None:
        """Called once per ``fit``, after any resume and before the first step of this call (e.g. a
        warmup stage that a fresh run does at ``step == 0``)."""

    def agree(self, flag: bool) -> bool:
        """``flag`` as every process of the run sees it (data-parallel trainers: true if it is on any
        rank), so that all ranks stop at the same step."""
        return flag

    def should_stop(self) -> bool:
        """An early end before ``total_steps`` (e.g. a target accuracy reached)."""
        return False

    def finish(self, metrics: dict[str, Any]) -> Any:
        """After the last step (also when a finished run is resumed): write final outputs; the
        return value is ``fit``'s."""
        return metrics

    def resume_free(self) -> tuple[str, ...]:
        """Identity keys that may change between a checkpoint and its resumption."""
        return ()

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> Any:
        """Train to the step budget; with ``resume``, continue from the newest intact checkpoint in
        ``out_dir``. The run folder is locked meanwhile: a second trainer on it gets ``RunLocked``."""
        if resume and self.out_dir is None:
            raise ValueError("resume needs the out_dir the run checkpointed to")
        lock = RunLock(self.out_dir, self.lock_label) if self.rank == 0 and self.out_dir is not None else None
        if lock is not None:
            lock.acquire()
        try:
            if not resume and self.out_dir is not None:
                self._refuse_existing_run()
            if resume:
                self.load_checkpoint()
            self.before_steps()
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _refuse_existing_run(self) -> None:
        """A fresh run must not overwrite a folder holding one (its checkpoints or final layers)."""
        if self.step > 0:  # a checkpoint was loaded (load_checkpoint) before fit: this continues it
            return
        found = next(iter(checkpoint_candidates(self.checkpoint_dir)), None)
        final = self.out_dir / "final"
        if found is None and not (final.is_dir() and any(final.iterdir())):
            return
        where = f"checkpoint {found.name}" if found is not None else "final layers, no checkpoint"
        raise RunExists(
            f"{self.out_dir} holds a run ({where}): pass --resume (resume=True) to continue it, or give "
            "another output folder; nothing was overwritten"
        )

    def _run(self) -> Any:
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc=self.desc,
            unit="step",
            disable=not self.progress or bool(self.rank),
        )
        metrics: dict[str, Any] = {}
        started, paused = time.monotonic(), None
        try:
            if self.step < self.total_steps and not self.should_stop():
                for batch in self.batch_stream():
                    lr = self.lr_at(self.step)
                    for optimizer in self.optimizers():
                        for group in optimizer.param_groups:
                            group["lr"] = lr * group.get("lr_scale", 1.0)  # a learner's own rate
                    metrics = self.train_step(batch)
                    self.step += 1
                    bar.update(1)
                    last = self.step >= self.total_steps or self.should_stop()
                    if self.step % self.log_every == 0 or last:
                        self._show(self.record(metrics), bar)
                        last = last or self.should_stop()  # a record may end the run (a target reached)
                    every = self.checkpoint_every
                    out_of_time = (
                        not last
                        and self.time_limit_s is not None
                        and self.agree(time.monotonic() - started >= self.time_limit_s)
                    )
                    if self.out_dir is not None and (
                        (every and self.step % every == 0)
                        or (last and (every or self.checkpoint_at_end))
                        or out_of_time
                    ):
                        saved = self.save_checkpoint()
                        if out_of_time:
                            paused = saved
                    if out_of_time:
                        paused = paused or "not written: this trainer has no out_dir"
                    if last or out_of_time:
                        break
        finally:
            bar.close()
        if paused is not None:
            minutes = (time.monotonic() - started) / 60
            raise RunPaused(
                f"this part ended after {minutes:.1f} min at step {self.step:,} of {self.total_steps:,} "
                f"(checkpoint {paused}); run the same command with --resume to continue"
            )
        if self.step < self.total_steps and not self.should_stop():
            saved = (
                self.save_checkpoint()
                if self.out_dir is not None and (self.checkpoint_every or self.checkpoint_at_end)
                else None
            )
            raise ValueError(
                f"the batches ran out after {self.step} of {self.total_steps} steps "
                f"({'checkpoint ' + str(saved) if saved else 'no checkpoint'}): {self.ran_out_hint()}"
            )
        return self.finish(metrics)

    def ran_out_hint(self) -> str:
        return "give more batches"

    def _show(self, shown: dict[str, Any], bar: Any) -> None:
        if self.rank:
            return
        text = self.summary(shown)
        if self.progress and len(text) <= 80:
            bar.set_postfix_str(text, refresh=False)
        elif self.progress:  # too long for the bar's line: lines of their own above the bar
            for line in _wrapped(f"step {self.step}/{self.total_steps} | {text}"):
                bar.write(line, file=bar.fp)  # where the bar is (stderr), not into the command's output
        else:
            log.info(
                "step %d/%d lr %.2e | %s",
                self.step,
                self.total_steps,
                self.lr_at(self.step - 1),
                text,
            )

    # -- finite checks ---------------------------------------------------------------------------
    def last_good(self) -> str:
        found = self.latest_checkpoint() if self.out_dir is not None else None
        return str(found) if found else "none (no checkpoint written yet)"

    def check_loss(
        self, loss: torch.Tensor, what: str = "loss", terms: Mapping[str, Any] | None = None
    ) -> None:
        """Raise ``TrainingDiverged`` (before any update is applied) if ``loss`` is not finite."""
        if not torch.isfinite(loss):
            detail = f" (terms {dict(terms)})" if terms else ""
            raise TrainingDiverged(
                f"{what} is {loss.item()} at step {self.step}{detail}; the last good checkpoint is "
                f"{self.last_good()} (nothing of this step was applied); try a lower lr"
            )

    def check_weights(self) -> None:
        """A finite loss can still come with an update that leaves NaN/inf weights: never save those."""
        bad = [name for name, p in self.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise TrainingDiverged(
                f"parameters {bad[:3]}{' ...' if len(bad) > 3 else ''} are not finite after step {self.step}; "
                f"not saved, the last good checkpoint is {self.last_good()}; try a lower lr"
            )

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        if self.out_dir is None:
            raise ValueError("this trainer has no out_dir, so no checkpoints")
        return self.out_dir / "checkpoints"

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir, marker=self.checkpoint_marker)

    def save_checkpoint(self) -> Path | None:
        """Write the whole training state; on any failure the previous checkpoint stays ``latest``.
        Only rank 0 writes; the weights must be finite."""
        if self.rank:
            return None
        self.check_weights()
        return save_checkpoint_dir(
            self.checkpoint_dir, self.step, self.resume_state.write_state, self.keep_checkpoints
        )

    def load_checkpoint(self, path: str | Path | None = None) -> Path | None:
        """Restore the training state from ``path``, or from the newest intact checkpoint: a ``latest``
        that names a missing or damaged folder falls back to the next older one (with a warning); if
        checkpoints exist but none can be read, ``CheckpointError`` lists them; one trained with other
        settings raises ``ResumeMismatch``. Returns the folder used (None: nothing written yet, so a
        fresh start is the resumed run)."""
        candidates = [Path(path)] if path is not None else checkpoint_candidates(self.checkpoint_dir)
        problems = []
        pointer = self.checkpoint_dir / "latest"
        if (
            path is None
            and pointer.is_file()
            and not (self.checkpoint_dir / pointer.read_text().strip()).is_dir()
        ):
            problems.append(
                f"{self.checkpoint_dir / pointer.read_text().strip()}: missing, though `latest` names it"
            )
        for folder in candidates:
            try:
                saved = self.resume_state.read_identity(folder)
            except Exception as err:  # damaged or incomplete: say so and try the next older one
                problems.append(f"{folder}: {type(err).__name__}: {err}")
                continue
            self.check_identity(folder, saved)  # another run's checkpoint: refused, not skipped
            try:
                state = self.resume_state.read_state(folder)
            except Exception as err:
                problems.append(f"{folder}: {type(err).__name__}: {err}")
                continue
            if problems:
                warnings.warn(
                    "skipped unreadable checkpoint(s) " + "; ".join(problems) + f"; resuming from {folder}",
                    stacklevel=2,
                )
            self.resume_state.apply_state(state)
            return folder
        if problems:
            raise CheckpointError(
                "no checkpoint could be read: " + "; ".join(problems) + ". Delete the damaged folders to "
                f"start again from step 0, or train into another folder than {self.out_dir}"
            )
        return None

    def comparable(self, part: str, value: Any) -> Any:
        """What of an identity ``part`` a resume must match (default: all of it); a trainer can leave
        out what only names a thing, e.g. how a text's path was spelled when its digests are recorded."""
        return value

    def check_identity(self, folder: Path, saved: Mapping[str, Any]) -> None:
        """Raise ``ResumeMismatch`` naming each difference between a checkpoint's identity and ours."""
        rs = self.resume_state
        asked = json.loads(json.dumps(rs.identity()))  # as a checkpoint stores it (tuples -> lists)
        for part in asked:
            if saved.get(part) is None:
                continue  # written before this part was recorded
            there, here = rs.comparable(part, saved[part]), rs.comparable(part, asked[part])
            if isinstance(there, Mapping) and isinstance(here, Mapping):
                diff = differences(there, here, rs.resume_free() if part == "config" else ())
            else:
                diff = {} if there == here else {part: (there, here)}
            if diff:
                said = _MISMATCH.get(part, f"was trained with other {part}")
                raise ResumeMismatch(
                    f"{folder} {said} (checkpoint, asked): {diff}; ask for the same, or train into a new folder"
                )


def _wrapped(text: str, width: int = 160, sep: str = " | ") -> list[str]:
    """``text`` cut at ``sep`` into lines of at most about ``width`` characters (continuations indented)."""
    lines, line = [], ""
    for part in text.split(sep):
        if line and len(line) + len(sep) + len(part) > width:
            lines.append(line)
            line = "  " + part
        else:
            line = f"{line}{sep}{part}" if line else part
    return [*lines, line]


_MISMATCH = {
    "config": "was trained with other settings",
    "learners": "trained other learners",
    "data": "was trained on other data than this run streams",
    "ci_version": "was written by another version of the SPD CI functions (mxd_lens.spd.ci.CI_VERSION)",
}

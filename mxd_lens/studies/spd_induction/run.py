"""SPD of the toy induction model's 8 attention projections (Q, K, V, O x 2 layers): CI function
{token, sequence} x {stochastic + subset reconstruction, stochastic only}, under two recipes
(mxd-lens spd-induction is the command line).

- **first recipe** (variants token-subset, token-stoch, sequence-subset, sequence-stoch): C = 32, CI
  hidden 16, AdamW lr 1e-3 constant, faithfulness 1e5 with the delta component, stochastic recon 1,
  subset recon 1 (or 0), minimality 1e-2 with p linear 2 -> 0.3, continuous masks, KL at the last
  position only (the model is trained only there), minimality averaged over all positions.
- **reference recipe** (the same four with a ``ref-`` prefix), goodfire-ai/spd's
  ``ih_config.yaml``: C = 100, CI hidden 128, lr 1e-3 constant, faithfulness 100 after a 200-step
  faithfulness warmup (lr 1e-2, weight decay 0.1), stochastic, layerwise and CI-masked recon 1 each
  (plus subset recon 1 in the -subset variants), minimality 1e-2 at constant p = 0.1, KL and
  minimality both averaged over all positions.

Settings are fixed per variant, recorded in OUT/VARIANT/run_config.json and refused on resume if
changed. Training batches: fresh InductionTask sequences, step s drawn from a generator seeded with
10_000 + s; the evaluation batch (512 sequences) from seed 7_777_777. A minimality, C or CI width
other than the recipe's writes OUT/VARIANT-minM-cC-hH/ (only the parts that differ).

``train_variant`` writes OUT/VARIANT/{checkpoints/, metrics.json, run_config.json, train_log.jsonl};
``report_variant`` OUT/VARIANT/{report.json, ci_by_position.png}; ``summarize_variants``
OUT/summary.json, OUT/comparison.md, OUT/modules.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mxd_lens.fileio import atomic_write_bytes, atomic_write_text
from mxd_lens.spd.induction import InductionTask, load_induction_model
from mxd_lens.spd.report import comparison_table, module_table, plot_ci_by_position, study_report
from mxd_lens.spd.sites import decomposable_weights
from mxd_lens.spd.train import SPDConfig, SPDTrainer
from mxd_lens.studies import StudyResult
from mxd_lens.studies.spd_induction import DEFAULT_MINIMALITY, SPDInductionOptions

log = logging.getLogger(__name__)

_BASE_VARIANTS = {
    "token-subset": dict(ci="token", subset_recon=1.0),
    "token-stoch": dict(ci="token", subset_recon=0.0),
    "sequence-subset": dict(ci="sequence", subset_recon=1.0),
    "sequence-stoch": dict(ci="sequence", subset_recon=0.0),
}
VARIANTS = {**_BASE_VARIANTS, **{f"ref-{name}": settings for name, settings in _BASE_VARIANTS.items()}}
_BASE_TITLES = {
    "token-subset": "token CI (vector MLP), stochastic + subset reconstruction",
    "token-stoch": "token CI (vector MLP), stochastic reconstruction only",
    "sequence-subset": "sequence CI (causal attention), stochastic + subset reconstruction",
    "sequence-stoch": "sequence CI (causal attention), stochastic reconstruction only",
}
TITLES = {
    **_BASE_TITLES,
    **{f"ref-{name}": f"reference recipe, {title}" for name, title in _BASE_TITLES.items()},
}
# What each recipe sets (the variant adds ci and subset_recon).
RECIPES: dict[str, dict[str, Any]] = {
    "first": dict(C=32, ci_hidden=16, faithfulness=1e5, layerwise_recon=0.0, ci_masked_recon=0.0,
                  p_start=2.0, p_end=0.3, positions="last"),
    "reference": dict(C=100, ci_hidden=128, faithfulness=100.0, faithfulness_warmup_steps=200,
                      faithfulness_warmup_lr=1e-2, faithfulness_warmup_weight_decay=0.1,
                      layerwise_recon=1.0, ci_masked_recon=1.0, p_start=0.1, p_end=0.1, positions="all"),
}  # fmt: skip


def recipe_of(variant: str) -> str:
    return "reference" if variant.startswith("ref-") else "first"


DATA_SEED = 10_000
EVAL_SEED = 7_777_777
EVAL_SIZE = 512


def choose_model(root: Path) -> Path:
    """model-long/model.pt when that run has finished past step 800 (the first model's end; its
    final_stats.json is written after model.pt), else model/model.pt."""
    long = root / "model-long"
    try:
        steps = json.loads((long / "final_stats.json").read_text())["steps"]
    except (OSError, ValueError, KeyError):
        steps = 0
    if (long / "model.pt").is_file() and steps > 800:
        return long / "model.pt"
    return root / "model" / "model.pt"


def run_name(variant: str, minimality: float, C: int | None = None, ci_hidden: int | None = None) -> str:
    recipe = RECIPES[recipe_of(variant)]
    parts = [variant]
    if minimality != DEFAULT_MINIMALITY:
        parts.append(f"min{minimality:g}")
    if C is not None and C != recipe["C"]:
        parts.append(f"c{C}")
    if ci_hidden is not None and ci_hidden != recipe["ci_hidden"]:
        parts.append(f"h{ci_hidden}")
    return "-".join(parts)


def make_config(
    variant: str,
    steps: int,
    batch_size: int,
    minimality: float = DEFAULT_MINIMALITY,
    C: int | None = None,
    ci_hidden: int | None = None,
) -> SPDConfig:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: choose one of {list(VARIANTS)}")
    recipe = dict(RECIPES[recipe_of(variant)])
    recipe.update({k: v for k, v in (("C", C), ("ci_hidden", ci_hidden)) if v is not None})
    return SPDConfig(
        steps=steps,
        batch_size=batch_size,
        lr=1e-3,
        lr_schedule="constant",
        mask_type="continuous",
        delta=True,
        stochastic_recon=1.0,
        minimality=minimality,
        seed=0,
        log_every=10,
        checkpoint_every=250,
        keep_checkpoints=2,
        **recipe,
        **VARIANTS[variant],
    )


def batches_for(task: InductionTask, batch_size: int):
    def batches(step: int) -> torch.Tensor:
        return task.sample_batch(batch_size, torch.Generator().manual_seed(DATA_SEED + step)).tokens

    return batches


def build_trainer(
    out: Path, model_path: Path, config: SPDConfig, progress: bool = False, device: str = "cpu"
):
    """The induction model at ``model_path`` (on ``device``) and an SPD trainer of its attention
    projections (whose components and CI functions live where the model does)."""
    model = load_induction_model(model_path).to(device)
    modules = [name for name in decomposable_weights(model) if ".attn." in name]
    trainer = SPDTrainer(
        model, modules, batches_for(InductionTask(), config.batch_size), config, out, progress
    )
    return model, trainer


def train_variant(study: SPDInductionOptions, root: str | Path, progress: bool = True) -> dict[str, Any]:
    """Train (or resume) ``study`` under ROOT/NAME, to ``study.until`` (when given) or ``study.steps``;
    appends this sitting's wall/CPU time to train_log.jsonl and returns that record. With
    ``study.keep_in`` the run resumes from the state kept there when it is newer than its own
    checkpoints (a fresh clone has none), and keeps its state there after every chunk (:func:`keep_state`).
    ``keep`` is locked meanwhile (a second run keeping into it is refused, :func:`lock_kept`), and a kept
    state is checked before anything is copied (:func:`restore_kept`): a refusal leaves ROOT/NAME as it was."""
    root = Path(root)
    keep = Path(study.keep_in) if study.keep_in else None
    lock = lock_kept(keep) if keep is not None else None
    try:
        return _train_variant(study, root, keep, progress)
    finally:
        if lock is not None:
            lock.release()


def _train_variant(
    study: SPDInductionOptions, root: Path, keep: Path | None, progress: bool
) -> dict[str, Any]:
    out = root / study.name
    kept = read_kept(keep) if keep is not None else None
    restoring = kept is not None and kept.step > _local_step(out)
    run_config = out / "run_config.json"
    own = _read_json(run_config) if run_config.is_file() else None
    saved = (kept.run_config or own) if restoring else own  # what run_config.json will say
    if saved is not None:
        model_path = Path(saved["model"])
        if study.model and Path(study.model) != model_path:
            raise ValueError(f"{out} was trained on {model_path}; refusing {study.model}")
        if not model_path.is_file() and keep is not None and (keep / "model.pt").is_file():
            model_path = keep / "model.pt"  # a fresh clone: the model the run kept beside its state
        recorded = saved.get("model_sha256")
        if recorded and model_path.is_file() and file_sha256(model_path) != recorded:
            raise ValueError(
                f"{model_path} is not the model {out} was trained on (sha256 {file_sha256(model_path)[:12]}, "
                f"recorded {recorded[:12]}): give the run's own model, or train into another folder"
            )
    else:
        model_path = Path(study.model) if study.model else choose_model(root)
    config = study.config()
    if study.until < 0 or study.until > config.steps:
        raise ValueError(
            f"--until {study.until}: give a step in 1..--steps ({config.steps}), or 0 for --steps"
        )
    _, trainer = build_trainer(out, model_path, config, progress, study.device)
    if restoring:
        restore_kept(keep, out, trainer)
    trainer.load_checkpoint()  # refuses a checkpoint of another run before run_config.json is written
    out.mkdir(parents=True, exist_ok=True)
    record_model = {"model": str(model_path)}
    if model_path.is_file():
        record_model["model_sha256"] = file_sha256(model_path)
    atomic_write_text(
        run_config,
        json.dumps({"variant": study.variant, **record_model, "config": asdict(config)}, indent=1),
    )
    stop = study.until or config.steps
    start_step, started, cpu_started = trainer.step, time.perf_counter(), time.process_time()
    log.info("%s: model %s, from step %d to %d of %d", out.name, model_path, start_step, stop, config.steps)

    def kept() -> None:
        if keep is not None:
            keep_state(out, keep, model_path)

    if study.trend_every:
        _train_with_trend(trainer, study, out, stop, after_chunk=kept)
    elif trainer.step < stop:
        trainer.total_steps = stop
        trainer.fit(resume=True)
    record = {
        "from_step": start_step,
        "to_step": trainer.step,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "ended": time.ctime(),
    }
    with (out / "train_log.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    kept()
    return record


# What keep_state copies beside the checkpoint (those that exist). Not metrics.json: the checkpoint holds
# the same history, and the trainer writes metrics.json from it again.
KEPT_FILES = ("run_config.json", "trend.jsonl", "trend.png", "train_log.jsonl", "faithfulness_warmup.json")


def file_sha256(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def keep_state(out: Path, keep: Path, model_path: Path) -> Path | None:
    """Copy run ``out``'s latest checkpoint into ``keep``/checkpoint (replacing the last copy: a new
    folder renamed into place, so a crash leaves the old copy or the new one, never a mix), its
    ``KEPT_FILES`` and, once, the model it decomposes (``keep``/model.pt). Returns the checkpoint copied
    (None: the run has none yet). Other files in ``keep`` are left alone."""
    import shutil

    from mxd_lens.checkpoints import latest_checkpoint

    latest = latest_checkpoint(out / "checkpoints", "state.pt")
    if latest is None:
        return None
    keep.mkdir(parents=True, exist_ok=True)
    fresh, old = keep / ".checkpoint.new", keep / ".checkpoint.old"
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(latest, fresh)
    target = keep / "checkpoint"
    if target.exists():
        os.replace(target, old)
    os.replace(fresh, target)
    shutil.rmtree(old, ignore_errors=True)
    for name in KEPT_FILES:
        if (out / name).is_file():
            atomic_write_bytes(keep / name, (out / name).read_bytes())
    model_copy = keep / "model.pt"
    if model_path.is_file() and model_path.resolve() != model_copy.resolve():
        if not model_copy.is_file() or file_sha256(model_copy) != file_sha256(model_path):
            atomic_write_bytes(model_copy, model_path.read_bytes())
    return latest


def lock_kept(keep: Path) -> Any:
    """Lock ``keep`` (``keep``/.lock, a :class:`mxd_lens.checkpoints.RunLock`) for a run keeping its state
    there; a second one gets ``RunLocked`` naming ``keep`` and the holder's pid."""
    from mxd_lens.checkpoints import RunLock, RunLocked

    lock = RunLock(keep, "run keeping its state there")
    try:
        return lock.acquire()
    except RunLocked:
        holder = (keep / ".lock").read_text().strip() if (keep / ".lock").is_file() else ""
        raise RunLocked(
            f"--keep-in {keep} is in use by another run keeping its state there (pid {holder or 'unknown'}): "
            "wait for it to finish, or give another --keep-in"
        ) from None


@dataclass
class Kept:
    """The state kept in a folder (:func:`keep_state`): its checkpoint folder, step, identity
    (trainer_state.json) and run_config.json (None: not kept)."""

    folder: Path
    step: int
    identity: dict[str, Any]
    run_config: dict[str, Any] | None


class KeptStateDamaged(ValueError):
    """A file of a ``--keep-in`` folder cannot be read; the message names it and what is wrong."""


def _damaged(path: Path, what: str) -> KeptStateDamaged:
    return KeptStateDamaged(
        f"kept state {path} {what}: restore it from where you keep run state, or give another --keep-in"
    )


def _read_json(path: Path, kept: bool = False, lines: bool = False) -> Any:
    """``path`` parsed (each line with ``lines``); a damaged file raises ValueError naming it, the line
    and what is wrong (``KeptStateDamaged`` for a kept file)."""
    error = _damaged if kept else (lambda p, what: ValueError(f"{p} {what}"))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(path, f"is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise error(path, f"cannot be read ({err.strerror or err})") from None
    try:
        if lines:
            parsed = []
            for number, line in enumerate(text.splitlines(), 1):
                parsed.append(json.loads(line))
                if not isinstance(parsed[-1], dict):
                    raise error(path, f"line {number} is not a JSON object")
            return parsed
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        where = f"line {number}" if lines else f"line {err.lineno}"
        raise error(path, f"is not valid JSON ({where}: {err.msg})") from None
    if not isinstance(parsed, dict):
        raise error(path, "is not a JSON object")
    return parsed


def read_kept(keep: Path) -> Kept | None:
    """The state kept in ``keep`` (None: nothing kept yet). A damaged checkpoint (a file missing, or
    trainer_state.json unreadable) raises ``KeptStateDamaged`` naming the file in ``keep``."""
    folder = keep / "checkpoint"
    if not folder.exists():
        if keep.exists() and any(p.name != ".lock" for p in keep.iterdir()):
            log.info("%s holds no kept checkpoint yet", keep)
        return None
    for name in ("trainer_state.json", "state.pt"):
        if not (folder / name).is_file():
            raise _damaged(folder / name, "is missing (the kept checkpoint is incomplete)")
    identity = _read_json(folder / "trainer_state.json", kept=True)
    step = identity.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _damaged(folder / "trainer_state.json", f"has no step count (step: {step!r})")
    run_config = keep / "run_config.json"
    saved = _read_json(run_config, kept=True) if run_config.is_file() else None
    if saved is not None and not isinstance(saved.get("model"), str):
        raise _damaged(run_config, 'names no model (no "model" string)')
    return Kept(folder, step, identity, saved)


def _check_kept_files(keep: Path, kept: Kept) -> None:
    """Every kept file a resume reads, read now (``KeptStateDamaged`` naming the first damaged one)."""
    state = kept.folder / "state.pt"
    with open(state, "rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs"):
        raise _damaged(state, "is a Git LFS pointer, not the state (git lfs pull)")
    try:
        saved = torch.load(state, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, not a torch file, ...
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise _damaged(state, f"cannot be read ({type(err).__name__}: {reason})") from None
    if not isinstance(saved, dict) or saved.get("step") != kept.step:
        found = saved.get("step") if isinstance(saved, dict) else type(saved).__name__
        raise _damaged(state, f"holds step {found}, but trainer_state.json beside it says {kept.step}")
    for name in ("trend.jsonl", "train_log.jsonl"):
        if (keep / name).is_file():
            _read_json(keep / name, kept=True, lines=True)
    if (keep / "faithfulness_warmup.json").is_file():
        _read_json(keep / "faithfulness_warmup.json", kept=True)


def _local_step(out: Path) -> int:
    """The step of ``out``'s newest checkpoint (-1: none)."""
    from mxd_lens.checkpoints import latest_checkpoint

    local = latest_checkpoint(out / "checkpoints", "state.pt")
    if local is None:
        return -1
    step = _read_json(local / "trainer_state.json").get("step")
    if not isinstance(step, int):
        raise ValueError(f"{local / 'trainer_state.json'} has no step count (step: {step!r})")
    return step


def _check_kept_is_this_run(keep: Path, kept: Kept, out: Path, trainer: SPDTrainer | None) -> None:
    """Refuse (before anything is copied) a kept state of another run than the one asked (``trainer``'s
    identity: config, decomposition, CI_VERSION) or than ``out`` holds (its newest checkpoint's identity,
    its run_config.json's model)."""
    from mxd_lens.checkpoints import latest_checkpoint
    from mxd_lens.loop import ResumeMismatch, differences
    from mxd_lens.spd.train import _FREE

    nothing = f"nothing was copied into {out}"
    if trainer is not None:
        try:
            trainer.check_identity(kept.folder, trainer.read_identity(kept.folder))
        except ResumeMismatch as err:
            raise ResumeMismatch(f"--keep-in {keep}: {err}; {nothing}") from None
    local = latest_checkpoint(out / "checkpoints", "state.pt")
    if local is not None:
        ours = _read_json(local / "trainer_state.json")
        diff = {}
        for part in ("config", "decomposition"):
            a, b = ours.get(part), kept.identity.get(part)
            if isinstance(a, dict) and isinstance(b, dict):
                both = (set(a) & set(b)) - set(_FREE)  # keys one of them lacks: written before they existed
                diff.update(differences({k: a[k] for k in both}, {k: b[k] for k in both}))
        if ours.get("ci_version", 1) != kept.identity.get("ci_version", 1):
            diff["ci_version"] = (ours.get("ci_version", 1), kept.identity.get("ci_version", 1))
        if diff:
            raise ResumeMismatch(
                f"--keep-in {keep} keeps another run than {out} holds ({local.name} vs the kept step "
                f"{kept.step}; {out.name}, kept: {diff}): give the run's own --keep-in, or train into "
                f"another folder; {nothing}"
            )
    own = out / "run_config.json"
    if kept.run_config is not None and own.is_file():
        a, b = _read_json(own).get("model_sha256"), kept.run_config.get("model_sha256")
        if a and b and a != b:
            raise ResumeMismatch(
                f"--keep-in {keep} keeps a run of another model (sha256 {b[:12]}) than {out} holds "
                f"({a[:12]}): give the run's own --keep-in, or train into another folder; {nothing}"
            )


def restore_kept(keep: Path, out: Path, trainer: SPDTrainer | None = None) -> Path | None:
    """Install the state kept in ``keep`` (see :func:`keep_state`) as run ``out``'s newest checkpoint when
    ``out`` has none or only older ones, with the kept files (they replace ``out``'s). Returns the
    checkpoint folder made (None: nothing kept, or ``out`` is as new).

    Everything is checked before anything is copied, and a refusal leaves ``out`` as it was: every kept
    file must be readable (``KeptStateDamaged`` names the file in ``keep`` and what is wrong), and the
    kept state must be of the run asked (``trainer``'s identity, when given) and of the run ``out``
    holds (``ResumeMismatch``)."""
    import shutil

    kept = read_kept(keep)
    if kept is None:
        return None
    local_step = _local_step(out)
    if local_step >= kept.step:
        return None
    _check_kept_files(keep, kept)
    _check_kept_is_this_run(keep, kept, out, trainer)
    checkpoints = out / "checkpoints"
    folder = checkpoints / f"step_{kept.step:09d}"
    checkpoints.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(kept.folder, folder)
    atomic_write_text(checkpoints / "latest", folder.name)
    for name in KEPT_FILES:
        if (keep / name).is_file():
            atomic_write_bytes(out / name, (keep / name).read_bytes())
    log.info("%s: resuming from the state kept in %s (step %d; this folder's newest: %d)",
             out, keep, kept.step, max(local_step, 0))  # fmt: skip
    return folder


TREND_SEED, TREND_SIZE = 5_555_555, 128


def _train_with_trend(
    trainer: SPDTrainer,
    study: SPDInductionOptions,
    out: Path,
    stop: int | None = None,
    after_chunk: Any = None,
) -> None:
    """Train to each multiple of ``trend_every`` up to ``stop`` (default ``config.steps``; the schedules
    still span ``config.steps``; every chunk ends on a checkpoint, so this is the same run as one
    ``fit``), appending a ``trend_point`` after each, then calling ``after_chunk()``."""
    from mxd_lens.spd.report import plot_trend, trend_point

    path = out / "trend.jsonl"
    points = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    points = [p for p in points if p["step"] <= trainer.step]  # a killed chunk's later points go
    batch = InductionTask().sample_batch(TREND_SIZE, torch.Generator().manual_seed(TREND_SEED))
    total = trainer.config.steps if stop is None else stop
    while True:
        if not points or points[-1]["step"] < trainer.step:
            points.append({"step": trainer.step, **trend_point(trainer.decomposition, batch)})
            atomic_write_text(path, "".join(json.dumps(p) + "\n" for p in points))
            plot_trend(points, out / "trend.png", title=f"{study.name}: {TITLES[study.variant]}")
            if after_chunk is not None:
                after_chunk()
        if trainer.step >= total:
            return
        trainer.total_steps = min(total, (trainer.step // study.trend_every + 1) * study.trend_every)
        trainer.fit(resume=True)


def time_variant(study: SPDInductionOptions, root: str | Path, steps: int) -> float:
    """Seconds per step over ``steps`` steps after 5 warm-up steps, in a scratch folder (nothing kept)."""
    import tempfile

    config = study.config(steps + 5)
    config.checkpoint_every = 0
    with tempfile.TemporaryDirectory() as tmp:
        _, trainer = build_trainer(
            Path(tmp), Path(study.model) if study.model else choose_model(Path(root)), config,
            device=study.device,
        )  # fmt: skip
        batches = trainer.batches
        for step in range(5):
            trainer.train_step(batches(step))
        started = time.perf_counter()
        for step in range(5, config.steps):
            trainer.train_step(batches(step))
        return (time.perf_counter() - started) / steps


def report_variant(study: SPDInductionOptions, root: str | Path) -> dict[str, Any]:
    """ROOT/NAME/report.json (``study_report`` on the evaluation batch, plus the training record) and
    ci_by_position.png; returns the report. With ``study.keep_in`` the state kept there is reported when
    it is newer than ROOT/NAME's own (a fresh clone has none)."""
    out = Path(root) / study.name
    keep = Path(study.keep_in) if study.keep_in else None
    if keep is not None:  # a fresh clone: report the state kept in the repository
        restore_kept(keep, out)
    if not (out / "run_config.json").is_file():
        raise ValueError(
            f"{out} holds no run (no run_config.json): train it first, or give --keep-in its kept state"
        )
    saved = json.loads((out / "run_config.json").read_text())
    config = SPDConfig(**saved["config"])
    model_path = Path(saved["model"])
    if not model_path.is_file() and keep is not None and (keep / "model.pt").is_file():
        model_path = keep / "model.pt"
    _, trainer = build_trainer(out, model_path, config)
    trainer.load_checkpoint()
    if trainer.step == 0:
        raise ValueError(f"{out} has no checkpoint yet")
    batch = InductionTask().sample_batch(EVAL_SIZE, torch.Generator().manual_seed(EVAL_SEED))
    started = time.perf_counter()
    report = study_report(trainer.decomposition, batch, threshold=0.1, positions=config.positions, seed=1)
    train_log = out / "train_log.jsonl"
    runs = [json.loads(line) for line in train_log.read_text().splitlines()] if train_log.is_file() else []
    report["training"] = {
        "variant": study.name,
        "model": saved["model"],
        "steps": trainer.step,
        "batch_size": config.batch_size,
        "wall_s": sum(r["wall_s"] for r in runs),
        "cpu_s": sum(r["cpu_s"] for r in runs) if all("cpu_s" in r for r in runs) else None,
        "runs": runs,
        "final_metrics": trainer.history[-1] if trainer.history else {},
        "config": saved["config"],
    }
    if study.pgd_steps:
        from mxd_lens.spd.adversarial import adversarial_metrics

        report["adversarial"] = adversarial_metrics(
            trainer.decomposition, batch.tokens, batch.labels, n_steps=study.pgd_steps,
            positions=config.positions, seed=1,
        )  # fmt: skip
    if study.pruning_draws:
        report["pruning"] = pruning_report(trainer, config, batch, report, study.pruning_draws)
    report["report_s"] = time.perf_counter() - started
    atomic_write_text(out / "report.json", json.dumps(report, indent=1))
    plot_ci_by_position(
        report,
        out / "ci_by_position.png",
        title=f"{study.name}: {TITLES[study.variant]}, minimality {config.minimality:g} (step {trainer.step})",
    )
    return report


PRUNING_SEQUENCES = 64


def pruning_report(
    trainer: SPDTrainer, config: SPDConfig, batch: Any, report: dict[str, Any], draws: int
) -> list[dict[str, Any]]:
    """:func:`mxd_lens.spd.pruning.pruning_cost` for each module of the expected circuit that keeps more
    than its one component at its expected position (CI-L0 > 1.5 in ``report``), at that position class
    on the batch's first 64 sequences, keeping k = n - 1, n // 2 and 1 of the components active at each
    position (n: their mean number there, rounded)."""
    from mxd_lens.spd.pruning import contributions, pruning_cost
    from mxd_lens.spd.report import EXPECTED_CIRCUIT, POSITION_CLASSES, position_classes

    tokens, s1 = batch.tokens[:PRUNING_SEQUENCES], batch.s1[:PRUNING_SEQUENCES]
    classes = position_classes(s1, tokens.shape[1])
    results = []
    for name, (where, count) in EXPECTED_CIRCUIT.items():
        k = POSITION_CLASSES.index(where)
        if count != 1 or name not in report["modules"] or report["modules"][name]["l0"][k] <= 1.5:
            continue
        rows = classes == k
        n = round(contributions(trainer.decomposition, tokens, name, rows)["n_active"])  # CI-L0 there
        keep = sorted({max(n - 1, 1), max(n // 2, 1), 1}, reverse=True)
        result = pruning_cost(
            trainer.decomposition, tokens, config, trainer.step, name, rows, keep, draws=draws
        )
        results.append({**result, "where": where})
    return results


def summarize_variants(root: str | Path) -> str:
    """ROOT/summary.json, comparison.md and modules.md over every variant with a report; returns the
    comparison table."""
    root = Path(root)
    reports = {}
    extra = sorted(p.parent.name for p in root.glob("*/report.json") if p.parent.name not in VARIANTS)
    for variant in [*VARIANTS, *extra]:
        path = root / variant / "report.json"
        if path.is_file():
            reports[variant] = json.loads(path.read_text())
    if not reports:
        raise ValueError(f"no report.json under {root}/<variant>/; run `report` first")
    summary = {}
    for variant, rep in reports.items():
        summary[variant] = {
            "training": {k: rep["training"][k] for k in ("model", "steps", "batch_size", "wall_s", "cpu_s")},
            "faithfulness": rep["losses"]["faithfulness"],
            "kl_stochastic": rep["losses"]["kl_stochastic"],
            "kl_ci_masked": rep["losses"]["kl_ci_masked"],
            "accuracy_clean": rep["accuracy_clean"],
            "accuracy_ci_masked": rep["accuracy_ci_masked"],
            "accuracy_ci_masked_no_delta": rep["accuracy_ci_masked_no_delta"],
            "accuracy_ci_binary": rep["accuracy_ci_binary"],
            "per_module_accuracy_ci_masked": {
                rep["modules"][n]["short"]: v["accuracy"] for n, v in rep["per_module_ci_masked"].items()
            },
            "modules": {
                m["short"]: {
                    "n_alive": m["n_alive"],
                    "l0": dict(zip(rep["position_classes"], m["l0"], strict=True)),
                }
                for m in rep["modules"].values()
            },
            "expected": {rep["modules"][n]["short"]: e for n, e in rep["expected"].items()},
        }
    table = comparison_table(reports)
    atomic_write_text(root / "summary.json", json.dumps(summary, indent=1))
    atomic_write_text(root / "comparison.md", table + "\n")
    sections = [f"### {variant}\n\n{module_table(rep)}\n" for variant, rep in reports.items()]
    atomic_write_text(root / "modules.md", "\n".join(sections))
    return table


def run(model: Any, options: SPDInductionOptions, out: Path) -> StudyResult:
    """The verb ``mxd-lens spd-induction ACTION``: time, train (resumes), report one variant, or
    summarise every variant found under ``out``."""
    if options.action == "time":
        rate = time_variant(options, out, options.steps)
        text = json.dumps({"variant": options.variant, "batch_size": options.batch_size, "s_per_step": rate})
    elif options.action == "train":
        text = json.dumps(train_variant(options, out, progress=False))
    elif options.action == "report":
        from mxd_lens.spd.report import adversarial_table

        report = report_variant(options, out)
        hidden = ("modules", "training", "adversarial")
        text = json.dumps({k: v for k, v in report.items() if k not in hidden}, indent=1)
        if "adversarial" in report:
            text += "\n\n" + adversarial_table(report)
        text += f"\nwrote {out}/{options.name}/report.json and ci_by_position.png"
    else:
        text = summarize_variants(out) + f"\nwrote {out}/summary.json, comparison.md, modules.md"
    return StudyResult(name="spd-induction", text=text)


def train_model(model: Any, options: Any, out: Path) -> StudyResult:
    """The verb ``mxd-lens spd-induction-model``: train the toy induction-head model that SPD decomposes
    (``options``: a ``mxd_lens.studies.spd_induction.InductionModelOptions``), resuming from OUT's latest checkpoint;
    OUT/model.pt, history.json, checkpoints/, curves.png and final_stats.json: the held-out accuracy and
    the attention of the expected circuit (layer-1 head at the final S onto M, layer-0 head at M onto the
    planted S) on a fresh batch, neither the training stream nor the early-stopping batch."""
    from mxd_lens.spd.induction import (
        EVAL_SEED_OFFSET,
        accuracy,
        attention_to_memorised_token,
        plot_training_curves,
    )

    toy, history = options.train(out)
    batch = InductionTask().sample_batch(
        4096, torch.Generator().manual_seed(options.seed + 2 * EVAL_SEED_OFFSET)
    )
    stats = {
        "steps": history["records"][-1]["step"] if history["records"] else 0,
        "accuracy": accuracy(toy, batch.tokens, batch.labels),
        **attention_to_memorised_token(toy, batch.tokens, batch.s1),
        "events": history["events"],
    }
    atomic_write_text(out / "final_stats.json", json.dumps(stats, indent=1))
    return StudyResult(
        name="final_stats",
        figures={"curves.png": plot_training_curves(history)},
        text=json.dumps(stats, indent=1) + f"\nwrote {out}/model.pt, history.json, final_stats.json",
    )

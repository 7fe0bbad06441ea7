"""The frontier study's options: parameter-matched MxD, TopK transcoder and skip transcoder at several
(block, K, seed) points, from one cached activation stream, spliced on held-out text (``run.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from mxd_lens.config import StreamConfig, TrainConfig


def budget_words(training: int, held: int, epochs: float | None, cache_tokens: int) -> str:
    """``training`` tokens in the words of the options, --epochs x --cache-tokens (or --tokens, when
    ``epochs`` is None), and the epochs over the cache that makes: fewer than --epochs where the cache
    holds more (``held``: whole shards) than --cache-tokens."""
    asked = "--tokens" if epochs is None else f"{epochs:g} x {cache_tokens:,} cache tokens"
    return (
        f"{training:,} training tokens ({asked}; {training / held:.2f} epochs over the {held:,} tokens the "
        "cache holds in whole shards)"
    )


@dataclass
class StudyTrainConfig(TrainConfig):
    """``mxd-lens train``'s recipe (``TrainConfig``) as the frontier and the demo read ``epochs``."""

    epochs: float | None = None
    """training tokens = epochs x --cache-tokens as asked (the cache holds whole shards, a little more,
    so the epochs over it the output reports are a little fewer); give this or --tokens"""


@dataclass
class FrontierConfig:
    """What to compare. The cache holds ``train_tokens`` (``--cache-tokens``) of the 'train' side of
    ``text``'s document split, rounded up to whole shards; held-out tokens come from its 'eval' side (never
    the same documents) or from ``eval_text``. Training tokens (tokens seen, repeats included; the rows'
    ``train_tokens``) = ``train.epochs`` x ``train_tokens``, or ``train.total_tokens``; the rows' ``epochs``
    are the passes over the cache that makes, a little fewer than ``train.epochs`` (whole shards)."""

    text: str | None = None  # training text: a file, folder or dataset (default: the bundled English text)
    blocks: list[int] = field(default_factory=list)
    """transformer blocks whose MLP to replace, each at every K in ks"""
    ks: list[int] = field(default_factory=lambda: [16, 32, 64])  # active units per token
    grid: list[str] = field(default_factory=list)  # more points: "BLOCK:K,K[@SEED,SEED]", e.g. 25:32 15:32@1
    eval_text: str | None = None  # held-out text (default: the 'eval' side of text's split)
    ood_text: str | None = None
    """a second, out-of-domain evaluation text (every document; e.g. news when training on books): each
    row gains its metrics as ood_delta_ce, ood_kl, ood_fvu, ..."""
    ood_eval_tokens: int | None = None  # tokens of ood_text (default: eval_tokens)
    cache: str | None = None  # activation cache folder, shareable between studies (default: OUT/cache)
    width_multiplier: int | None = None
    """transcoder width m x d_model; MxD gets the experts that match its parameters (default: 8, more on
    hosts whose MLP is too wide for a width-8 match: matching.default_width_multiplier)"""
    archs: list[str] | None = None
    """keys of mxd_lens.ARCHITECTURES, with options if wanted (mxd:gate=topk); unset: the paper's MxD (mxd),
    the recommended one (config.RECOMMENDED_MXD), the TopK and the skip transcoder"""
    init: str = "default"
    """'mlp': every learner whose architecture takes the host MLP's weights (MxD: E, b_E, D) starts from
    them, as `mxd-lens train --init mlp`; the others start as always. 'default': the architectures' own"""
    arch_lr: list[str] = field(default_factory=list)
    """a learning rate per architecture, "ARCH=LR" (e.g. mxd=0.001 transcoder=0.002); others use lr"""
    train_tokens: int = field(default=1_000_000, metadata={"alias": ["--cache-tokens"]})
    """tokens of text's train side to cache (rounded up to whole shards of rows_per_shard x context_size
    tokens); training tokens = epochs x this, or --tokens"""
    eval_tokens: int = 25_600  # held-out tokens for CE, KL, FVU, L0, dead units
    context_size: int = StreamConfig.context_size  # tokens per row (BOS included where the model uses one)
    rows_per_shard: int = StreamConfig.rows_per_shard  # token rows per cache shard
    eval_rows_per_forward: int = 8  # token rows per evaluation forward
    eval_fraction: float = StreamConfig.eval_fraction  # documents of text held out as its 'eval' side
    split_seed: int = StreamConfig.split_seed  # seed of that document split
    cache_dtype: str = "float32"  # float32, float16 or bfloat16 storage of the cache
    train: StudyTrainConfig = field(default_factory=lambda: StudyTrainConfig(epochs=1.0))
    """how every group is trained (``mxd-lens train``'s recipe, but --epochs counts --cache-tokens);
    ``seed`` seeds the layers of points with no @SEED. Checkpoints / logs every 1/20 and 1/50 of the
    steps unless they are given"""

    def __post_init__(self) -> None:
        # what needs no torch first, so that a mistyped option is refused at once
        from mxd_lens.config import RECOMMENDED_MXD
        from mxd_lens.saved_layers import BUILT_IN

        if self.archs is None:  # the paper's comparison; others (batchtopk_transcoder, ...) when asked for
            self.archs = ["mxd", RECOMMENDED_MXD, "transcoder", "skip_transcoder"]
        if self.init not in ("default", "mlp"):
            raise ValueError(f"init={self.init!r}: choose 'default' or 'mlp'")
        if not self.learners():
            raise ValueError("give at least one block and one K (blocks and ks, or grid)")
        built_in = {entry.key for entry in BUILT_IN.values()}
        others = [arch for arch in self.archs if arch.partition(":")[0].strip() not in built_in]
        if others:  # a plug-in's key, or a mistyped one: the registry (torch) says which
            from mxd_lens.layers import get_architecture, parse_arch

            for arch in others:  # a clear error for an unknown key (its options: LearnerSpec)
                get_architecture(parse_arch(arch)[0])
        self.lr_of(self.archs[0])  # a clear error for a malformed arch_lr
        if self.text is None:
            from mxd_lens import data

            self.text = str(data.default_text())

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
    def seed(self) -> int:
        """The seed of points with no @SEED (``train.seed``)."""
        return self.train.seed

    @property
    def steps(self) -> int:
        tokens = self.train.total_tokens or int(self.train.epochs * self.train_tokens)
        return tokens // self.train.batch_tokens

    def train_config(self, seed: int) -> TrainConfig:
        """The trainer's settings for a group of ``seed``: ``train`` with the study's token budget, and
        checkpoints / log lines every 1/20 and 1/50 of the steps where ``train`` left them at the recipe's
        defaults."""
        recipe = TrainConfig(epochs=1.0)
        steps = self.steps
        return dataclasses.replace(
            self.train,
            total_tokens=steps * self.train.batch_tokens,
            epochs=None,
            seed=seed,
            checkpoint_every=max(50, steps // 20)
            if self.train.checkpoint_every == recipe.checkpoint_every
            else self.train.checkpoint_every,
            log_every=max(1, steps // 50)
            if self.train.log_every == recipe.log_every
            else self.train.log_every,
        )


@dataclass
class FrontierOptions(FrontierConfig):
    """The sparsity–accuracy frontier on a real model: parameter-matched MxD, TopK transcoder and skip
    transcoder at several (block, K, seed), from one cached activation stream, spliced on held-out text.
    Writes OUT/frontier.json (config, command, results), OUT/frontier.csv and OUT/frontier.png; the cache
    and the trained weights (runs/*/final) stay under OUT for later studies (probing, steering). Rerun the
    same command to resume: training from its last checkpoint, evaluation from the last text it finished."""

    cache_only: bool = False
    """write (or check) the activation cache, then stop"""
    progress: bool = True
    """progress bars; off: text log lines (for logs of background runs)"""

    def config(self) -> FrontierConfig:
        """The study's settings without the verb's own (what frontier.json records and resumes by)."""
        names = [f.name for f in fields(FrontierConfig)]
        return FrontierConfig(**{name: getattr(self, name) for name in names})


@dataclass
class ReportOptions:
    """Redraw a frontier study's plots and write OUT/summary.md from OUT/frontier.json (nothing is
    trained): the mean over seeds per (block, K, arch) with each method's ΔCE and KL over the TopK
    transcoder's, and, where the rows have them, the units' usage and the out-of-domain metrics, plotted
    against K and against the L0 each layer measured."""

    override: list[str] = field(default_factory=list)
    """other studies' folders whose rows replace OUT's at the same (block, K, arch, seed)"""

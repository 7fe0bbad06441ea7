"""The probing study: every task of a suite, every layer (and, as baselines, the dense MLP input/output
and the MLP's neurons), every k, under one or more feature-selection protocols
(:func:`mxd_lens.analysis.probing.run_probing`), written as

- ``probing.csv`` / ``probing.json``: one row per task, source, protocol and k, a layer's rows with its
  architecture key (``arch``: ``mxd:gate=topk``) and ``K`` (the record has the options, the command, the
  model, the layers' training tokens and the task sets);
- ``summary.csv``: mean test accuracy and its standard error over tasks per source and k (SAEBench's
  protocol), with ``arch`` and ``K``; ``summary_<protocol>.csv`` for the paper's k = 1 protocols;
- ``paired.csv``: MxD minus each layer of another architecture at equal K (``arch``, ``other_arch``),
  paired over tasks; ``probing.png``.

Labels (``MxD (gate=topk) K=32``) are applied when a table is printed or plotted, never written.

Pooled activations are kept under OUT/pooled, so a rerun (or the steering study) reads them back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.probe import MergeOptions, ProbeOptions


def run(model: Any, options: ProbeOptions, out: Path, task_sets: Sequence[Any] | None = None,
        progress: bool = True) -> StudyResult:  # fmt: skip
    """Probe ``options.layers`` on the suite (``task_sets`` replaces it, e.g. your own
    ``jsonl_task_set``); pooled activations are cached under ``out/pooled``."""
    from mxd_lens import hooks
    from mxd_lens.analysis import tasks
    from mxd_lens.analysis.probing import run_probing
    from mxd_lens.layers.io import load_layers
    from mxd_lens.layers.registry import layer_arch
    from mxd_lens.records import TrainingRecord
    from mxd_lens.studies.common import recorded_options

    task_sets = suite(options, task_sets)
    layers = load_layers(options.layers, foreign=True)
    data = options.data or tasks.bundled_data()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table, _ = run_probing(
        model, task_sets, layers, ks=options.ks, data_root=data, cache=out / "pooled",
        context_size=options.context_size, batch_size=options.batch_size, seed=options.seed, progress=progress,
        protocols=options.protocols, neurons=options.neurons,
    )  # fmt: skip
    table["arch"] = table.source.map({name: layer_arch(layer) for name, layer in layers.items()})
    ks = {name: hooks.replacement(layer).k for name, layer in layers.items()}  # None: no K (JumpReLU)
    table["K"] = table.source.map(ks)
    record = {
        "study": recorded_options(options),
        "model": model.cfg.model_name,
        "layers": {name: TrainingRecord.of(layer).tokens for name, layer in layers.items()},
        "task_sets": [{"name": s.name, "classes": s.classes, "per_class": s.per_class, "binary": s.binary,
                       "family": s.family} for s in task_sets],
    }  # fmt: skip
    return probing_result(table, record)


def suite(options: ProbeOptions, task_sets: Sequence[Any] | None = None) -> list[Any]:
    """The task sets the study probes (``task_sets``, else ``options.suite`` on ``options.data``), refused
    when they hold fewer than 2 tasks: the report compares layers over tasks (means, standard errors,
    paired differences), which one task cannot give. Reads no text, loads no model."""
    from mxd_lens.analysis import tasks

    if task_sets is None:
        data = options.data or tasks.bundled_data()
        if options.per_class is not None:
            check_per_class(options.per_class, tasks.OFFLINE_SETS if options.suite == "offline" else [])
        task_sets = (
            tasks.offline_suite(options.per_class, data)
            if options.suite == "offline"
            else list(tasks.SAEBENCH)
        )
    names = [task for s in task_sets for task in s.tasks]
    if len(names) < 2:
        where = f"--data {options.data}" if options.data else "the task sets given"
        raise ValueError(
            f"{where} holds {len(names)} probing task(s) ({', '.join(names) or 'none'}); probing compares "
            "layers over at least 2 tasks: give --data a folder holding more of the offline suite's files "
            "(a set of N classes gives N tasks, a binary set 1; leave --data out for the bundled sets, "
            "docs/data.md), or --suite saebench"
        )
    return list(task_sets)


def check_per_class(per_class: int, task_sets: Sequence[Any]) -> None:
    """Refuse ``--per-class`` values too few for the probes' split (:func:`mxd_lens.analysis.tasks.splits`:
    each class cut 60/20/20 into train/validation/test, at least 2 in each part), naming the least that
    works for every set of the suite (binary sets take 5/4 as many), before any text is read."""
    from mxd_lens.analysis.tasks import splits

    def splits_ok(n: int) -> bool:
        try:
            splits(["a"] * n + ["b"] * n)
        except ValueError:
            return False
        return n >= 5  # TaskSet's own floor

    def works(p: int) -> bool:
        return all(splits_ok(p * 5 // 4 if s.binary else p) for s in task_sets) and splits_ok(p)

    if works(per_class):
        return
    least = next(p for p in range(max(per_class, 1), 10_000) if all(works(q) for q in range(p, p + 50)))
    raise ValueError(
        f"--per-class {per_class} is too few: each class's examples are split 60/20/20 into train, "
        f"validation and test with at least 2 in each, which takes --per-class {least} or more (tens to "
        "hundreds for a useful accuracy)"
    )


def check(options: ProbeOptions) -> None:
    """What the verb checks before loading the model: the suite (:func:`suite`)."""
    suite(options)


def merge(model: Any, options: MergeOptions, out: Path) -> StudyResult:
    """One report from several probing studies of the same suite (e.g. layers at K = 32 probed in one
    session, K = 16 and 64 in another). Rows two studies share (the dense ceiling, a layer probed twice)
    must agree exactly, since they are the same probe on the same texts; a difference means other data,
    model or settings and is refused, naming the first rows that differ. The studies must cover the
    same tasks."""
    import pandas as pd

    folders = options.folders
    if len(folders) < 2:
        raise ValueError("give at least two probing folders to merge")
    key = ["task", "source", "k"]
    tables = [read_probing_table(folder) for folder in folders]
    tasks = [set(t.task) for t in tables]
    for folder, found in zip(folders[1:], tasks[1:], strict=True):
        if found != tasks[0]:
            raise ValueError(
                f"{folder} probed other tasks than {folders[0]} (only in one: "
                f"{sorted(found ^ tasks[0])[:5]}): merge studies of the same suite"
            )
    joined = pd.concat(tables, keys=range(len(tables)), names=["study", None]).reset_index("study")
    dup = joined[joined.duplicated(key, keep=False)]
    for _, rows in dup.groupby(key):
        if rows.test_accuracy.nunique() > 1 or rows.features.nunique() > 1:
            first = rows.iloc[0]
            raise ValueError(
                f"{first.source} at k={first.k} on {first.task}: test accuracy "
                f"{rows.test_accuracy.tolist()} in {[str(folders[i]) for i in rows.study]}; the studies "
                "ran on other data, model or settings and cannot be merged"
            )
    table = joined.drop_duplicates(key).drop(columns="study").reset_index(drop=True)
    record: dict[str, Any] = {"merged_from": [str(f) for f in folders]}
    for folder in folders:
        meta = Path(folder) / "probing.json"
        if meta.is_file():
            old = json.loads(meta.read_text())
            record.setdefault("studies", []).append({k: v for k, v in old.items() if k != "rows"})
    return probing_result(table, record)


def probing_result(table: Any, record: dict[str, Any]) -> StudyResult:
    """The probing report from a long table (the layers' rows with their architecture key and K; older
    tables: see :func:`mxd_lens.analysis.probing.layer_sources`): the summaries, the paired differences
    and the plot."""
    import pandas as pd

    from mxd_lens.analysis.probing import (
        DENSE,
        _with_protocol,
        layer_sources,
        paired_comparisons,
        plot_probing,
        summarize,
    )

    layers = layer_sources(table)
    written = table

    def with_arch(frame: Any) -> Any:  # a summary indexed by source, with each layer's arch and K in front
        frame.insert(0, "arch", [layers[s][0] if s in layers else None for s in frame.index])
        frame.insert(1, "K", [layers[s][1] if s in layers else None for s in frame.index])
        return frame

    summary = with_arch(summarize(table))
    tables = {"summary.csv": summary}
    table = _with_protocol(table)
    for protocol in sorted(set(table.protocol) - {"saebench"}):  # the paper's k = 1 protocols, one file each
        other = pd.concat(
            {
                m: summarize(table, protocol, m)[["k=1", "se k=1"]]
                for m in ("test_accuracy", "balanced_accuracy")
            },
            axis=1,
        )
        other.columns = [f"{m} {c}" for m, c in other.columns]
        other = other.drop(index=[s for s in other.index if s.split(".")[0] in DENSE], errors="ignore")
        tables[f"summary_{protocol}.csv"] = with_arch(other)
        summary.attrs[protocol] = other
    pairs = paired_comparisons(table, layers)
    tables["paired.csv"] = pairs
    record = {**record, "rows": json.loads(table.to_json(orient="records"))}
    return StudyResult(
        name="probing",
        table=written,
        record=record,
        tables=tables,
        figures={"probing.png": plot_probing(table, layers)},
        text=format_probing(summary, pairs, layers),
        value={"table": table, "summary": summary, "paired": pairs},
    )


def format_probing(summary: Any, paired: Any, layers: dict[str, tuple[str, int]]) -> str:
    """The summary and the paired differences, as markdown text: each source by its label
    (:func:`mxd_lens.analysis.probing.source_label`), each comparison as 'MxD - Transcoder'."""
    from mxd_lens.analysis.probing import source_label
    from mxd_lens.layers import arch_label

    def shown(frame: Any) -> Any:
        frame = frame.drop(columns=["arch", "K"])
        frame.insert(0, "label", [source_label(s, layers) for s in frame.index])
        return frame.round(3).to_markdown()

    parts = [shown(summary)]
    for protocol, other in summary.attrs.items():
        note = " (feature selected on the test split: flatters weak features)" if protocol == "paper" else ""
        parts.append(f"\nProtocol {protocol}, k = 1{note}:\n" + shown(other))
    if len(paired):
        comparison = [
            f"{arch_label(a)} - {arch_label(b)}" for a, b in zip(paired.arch, paired.other_arch, strict=True)
        ]
        pairs = paired.drop(columns=["arch", "other_arch", "a", "b"])
        pairs.insert(1, "comparison", comparison)
        parts.append(
            "\nPaired differences in test accuracy (same task), mean over tasks:\n"
            + pairs.round(3).to_markdown(index=False)
        )
    return "\n".join(parts)


def read_probing_table(folder: str | Path) -> Any:
    """A study's OUT/probing.csv as written (``k`` as text: 1, 2, 5 or 'all'), a table written before the
    ``arch`` column with it (:func:`mxd_lens.analysis.probing.arch_columns`)."""
    import pandas as pd

    from mxd_lens.analysis.probing import arch_columns

    path = Path(folder) / "probing.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give the folder a probing study wrote (OUT/probing)")
    return arch_columns(pd.read_csv(path, dtype={"k": str}))

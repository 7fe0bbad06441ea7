"""Sparse probing of MxD / transcoder / skip-transcoder codes on the offline task suite (38 one-vs-rest
tasks over 8 datasets, mxd_lens.analysis.tasks.OFFLINE_SETS) or SAEBench's datasets (--suite saebench,
needs the hub).

    python analyses/sparse_probing.py --layers results/frontier-smollm2-l15-long/runs/final \
        --data ../shared/data/probing --out results/probing

``--layers`` takes layer folders or folders of them (as the frontier study writes). Writes OUT/probing.csv
and .json (one row per task, source and k), OUT/summary.csv (mean test accuracy per source and k) and
OUT/probing.png; the pooled activations are cached under OUT/pooled for reruns.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mxd_lens.analysis import probing, tasks
from mxd_lens.layers.io import load_layer
from mxd_lens.models import DEFAULT_MODEL, load_model


def find_layers(paths: list[str]) -> dict[str, object]:
    found = {}
    for path in map(Path, paths):
        folders = (
            [path] if (path / "cfg.json").is_file() else sorted(p.parent for p in path.glob("*/cfg.json"))
        )
        if not folders:
            raise SystemExit(f"{path}: no saved layer (a folder with cfg.json) here or one level down")
        for folder in folders:
            found[folder.name] = load_layer(folder)
    return found


def paired_comparisons(table, labels: dict[str, str]):
    """MxD against each other method at the same K: paired differences per k."""
    import pandas as pd

    by_key = {label: source for source, label in labels.items()}
    frames = []
    for label, source in by_key.items():
        method, K = label.rsplit(" K=", 1)
        if method != "MxD":
            continue
        for other in ("Transcoder", "Skip transcoder"):
            if f"{other} K={K}" in by_key:
                frame = probing.paired_difference(table, source, by_key[f"{other} K={K}"])
                frames.append(frame.assign(K=int(K), comparison=f"MxD - {other}"))
    if not frames:
        return pd.DataFrame()
    cols = ["K", "comparison", "k", "mean_difference", "se", "a_wins", "b_wins", "tasks"]
    return pd.concat(frames)[cols].sort_values(["K", "comparison", "k"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--layers", nargs="+", required=True, help="layer folders, or folders holding them")
    parser.add_argument("--suite", choices=["offline", "saebench"], default="offline")
    parser.add_argument(
        "--data", default="../shared/data/probing", help="folder of the offline suite's files"
    )
    parser.add_argument(
        "--per-class", type=int, default=None, help="examples per class (default: the suite's)"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5], help="probe sizes (default 1 2 5)")
    parser.add_argument(
        "--context-size", type=int, default=128, help="tokens per text, BOS included (default 128)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="texts per forward (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    parser.add_argument("--out", default="results/probing", help="output folder (default results/probing)")
    args = parser.parse_args(argv)

    layers = find_layers(args.layers)
    model = load_model(args.model)
    task_sets = tasks.offline_suite(args.per_class) if args.suite == "offline" else list(tasks.SAEBENCH)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table, _ = probing.run_probing(
        model, task_sets, layers, ks=args.ks, data_root=args.data, cache=out / "pooled",
        context_size=args.context_size, batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    labels = {name: probing.layer_label(layer) for name, layer in layers.items()}
    table["label"] = table.source.map(labels).fillna(table.source)
    table.to_csv(out / "probing.csv", index=False)
    summary = probing.summarize(table)
    summary.insert(0, "label", [labels.get(s, s) for s in summary.index])
    summary.to_csv(out / "summary.csv")
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "model": model.cfg.model_name,
        "layers": {name: str(layer.cfg.metadata.training.get("tokens") if layer.cfg.metadata.training else None)
                   for name, layer in layers.items()},
        "task_sets": [{"name": s.name, "classes": s.classes, "per_class": s.per_class, "binary": s.binary,
                       "family": s.family} for s in task_sets],
        "rows": json.loads(table.to_json(orient="records")),
    }  # fmt: skip
    (out / "probing.json").write_text(json.dumps(record, indent=1))
    probing.plot_probing(table, labels, out / "probing.png")
    print(summary.round(3).to_markdown())
    pairs = paired_comparisons(table, labels)
    if len(pairs):
        pairs.to_csv(out / "paired.csv", index=False)
        print("\nPaired differences in test accuracy (same task), mean over tasks:")
        print(pairs.round(3).to_markdown(index=False))
    print(f"\nwrote {out}/probing.csv, summary.csv, paired.csv, probing.json, probing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Steer with the top feature of several probing tasks, for each layer type, and score each generation
offline: concept strength = a dense probe for the task's class against every other text of the suite
(clean model, MLP input of the layer's block, pooled over the generated tokens), fluency = the clean
model's perplexity of the generated tokens.

    python analyses/steering.py --layers results/frontier-smollm2-l15-long/runs/final --k 32 \
        --data ../shared/data/probing --per-class 100 --probing results/probing/pooled --out results/steering

For each task and layer: the feature ranked first on the task's training split (as in sparse
probing), its largest activation on the task's positive training texts, each read as in probing (BOS + the
first 127 tokens): the unit of alpha, and
generations from "Let's talk about" at alpha = multiple x that unit (add mode, error term on, so
multiple 0 is the clean model). Writes OUT/steering.csv, .json and steering.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from mxd_lens import hooks
from mxd_lens.analysis import probing, steering, tasks
from mxd_lens.analysis.inspect import top_activations
from mxd_lens.layers.io import load_layer
from mxd_lens.models import DEFAULT_MODEL, load_model

DEFAULT_TASKS = ["language_id/fr", "code_language/python", "bbc_news/sports", "fortunes_set2/startrek"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--layers", required=True, help="folder of saved layers (as the frontier study writes)"
    )
    parser.add_argument("--k", type=int, default=32, help="use the layers with this K (default 32)")
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS, help="offline-suite tasks (set/class)")
    parser.add_argument(
        "--data", default="../shared/data/probing", help="folder of the offline suite's files"
    )
    parser.add_argument(
        "--per-class", type=int, default=None, help="examples per class (as in the probing run)"
    )
    parser.add_argument(
        "--probing", default=None, help="a PooledCache folder to reuse (probing's OUT/pooled)"
    )
    parser.add_argument("--multiples", type=float, nargs="+", default=[0, 2, 8, 32, 128])
    parser.add_argument("--samples", type=int, default=10, help="generations per setting (default 10)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generation (default 32)")
    parser.add_argument("--prompt", default=steering.NEUTRAL_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 when the CPU is shared)")
    parser.add_argument("--out", default="results/steering", help="output folder (default results/steering)")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw OUT/steering.png from OUT/steering.csv"
    )
    args = parser.parse_args(argv)
    if args.plot_only:
        import pandas as pd

        steering.plot_sweep(
            pd.read_csv(Path(args.out) / "steering.csv"), str(Path(args.out) / "steering.png")
        )
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    layers = {}
    for folder in sorted(p.parent for p in Path(args.layers).glob("*/cfg.json")):
        layer = load_layer(folder)
        if layer.cfg.k == args.k:
            layers[folder.name] = layer
    if not layers:
        raise SystemExit(f"no layer with K={args.k} under {args.layers}")
    model = load_model(args.model)
    sets = {s.name: s for s in tasks.offline_suite(args.per_class)}
    store = probing.PooledCache(args.probing or Path(args.out) / "pooled")
    blocks = sorted({hooks.layer_index(layer) for layer in layers.values()})
    # pooled MLP inputs of every suite text (cached by sparse probing): the concept probes' negatives
    dense_all = {}
    for name, task_set in sets.items():
        examples = task_set.load(args.data)
        dense_all[name] = (examples, store.get(model, examples, {}, blocks))
    targets = []
    for task in args.tasks:
        set_name, positive = task.split("/", 1)
        if set_name not in sets or positive not in sets[set_name].classes:
            raise SystemExit(
                f"unknown task {task!r}; offline tasks: {[t for s in sets.values() for t in s.tasks]}"
            )
        examples = sets[set_name].load(args.data)
        pooled = store.get(model, examples, layers, blocks)
        parts, y = probing.task_splits(examples, seed=0)[task]
        positives = [examples.texts[i] for i in parts["train"] if y[i]]
        concept = {}
        for block in blocks:
            key = f"mlp_in.L{block}"
            pos = pooled[key].numpy()[y == 1]
            neg = [dense_all[n][1][key].numpy() for n in sets if n != set_name]
            neg.append(pooled[key].numpy()[y == 0])
            concept[block] = steering.concept_probe(pos, np.concatenate(neg))
            print(f"{task}: concept probe (vs all other suite texts) test accuracy {concept[block][1]:.3f}")
        for name, layer in layers.items():
            block = hooks.layer_index(layer)
            chosen = probing.probe_task(pooled[name].numpy(), y, parts, k=1)
            feature = chosen["features"][0]
            rows = (torch.tensor([ids]) for ids in probing.tokenize_texts(model, positives, 128))
            scale = float(
                top_activations(model, layer, rows, [feature], n=1, progress=False).activation.max()
            )
            targets.append(
                {
                    "task": task,
                    "method": probing.layer_label(layer).rsplit(" K=", 1)[0],
                    "name": name,
                    "feature": feature,
                    "probe_k1_accuracy": chosen["test_accuracy"],
                    "concept_probe_accuracy": concept[block][1],
                    "scale": scale,
                    "layer": layer,
                    "scorers": [steering.ProbeScorer(model, concept[block][0], block, name="concept")],
                }
            )
            print(
                f"{task:28s} {name:28s} feature {feature:5d}  k=1 acc {chosen['test_accuracy']:.3f}  max act {scale:.3g}"
            )
    table = steering.sweep(
        model, targets, args.multiples, [steering.PerplexityScorer(model)], prompt=args.prompt,
        n_samples=args.samples, max_new_tokens=args.new_tokens, seed=args.seed,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "steering.csv", index=False)
    record = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "rows": json.loads(table.to_json(orient="records")),
    }
    (out / "steering.json").write_text(json.dumps(record, indent=1))
    steering.plot_sweep(table, str(out / "steering.png"))
    print(table.drop(columns=["example"]).round(3).to_markdown(index=False))
    print(f"\nwrote {out}/steering.csv, steering.json, steering.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The steering study: for each task and each layer at one K, the feature probing ranks first on the
task's training split is steered from a neutral prompt at several multiples of its largest activation,
and each generation is scored offline (concept strength by a dense probe, fluency by the clean model's
perplexity). Writes ``steering.csv`` / ``.json`` (one row per task, layer and multiple), ``steering.png``
and per layer ``contexts/NAME.csv|html``, the top contexts of the features it steered with."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.common import recorded_options
from mxd_lens.studies.steer import SteerOptions

log = logging.getLogger(__name__)


def run(model: Any, options: SteerOptions, out: Path | None, progress: bool = True) -> StudyResult:
    import json

    from mxd_lens import hooks
    from mxd_lens.analysis.inspect import contexts_title, to_html, top_contexts
    from mxd_lens.analysis.probing import PooledCache
    from mxd_lens.analysis.steering import PerplexityScorer, plot_sweep, summary_markdown, sweep
    from mxd_lens.layers.io import load_layers

    # layers at this K, and layers from elsewhere that have none (JumpReLU transcoders)
    layers = {
        name: layer
        for name, layer in load_layers(options.layers, foreign=True).items()
        if hooks.replacement(layer).k in (options.k, None)
    }
    if not layers:
        raise ValueError(f"no layer with K={options.k} (or without a K) under {options.layers}")
    if options.probing is None and out is None:
        raise ValueError("give the pooled-activation cache to reuse (probing) or an output folder for it")
    store = PooledCache(options.probing or Path(out) / "pooled")
    targets = steering_targets(model, options, layers, store)
    table = sweep(
        model, targets, options.multiples, [PerplexityScorer(model)], prompt=options.prompt,
        n_samples=options.samples, max_new_tokens=options.new_tokens, seed=options.seed, progress=progress,
    )  # fmt: skip
    tables, pages = {}, {}
    if options.context_tokens:
        for name, layer in layers.items():
            features = sorted({t["feature"] for t in targets if t["name"] == name})
            contexts = top_contexts(model, layer, features, tokens=options.context_tokens,
                                    context_size=options.context_size, progress=progress)  # fmt: skip
            tables[f"contexts/{name}.csv"] = contexts
            pages[f"contexts/{name}.html"] = to_html(contexts, contexts_title(name, contexts))
    return StudyResult(
        name="steering",
        table=table,
        record={"study": recorded_options(options), "rows": json.loads(table.to_json(orient="records"))},
        tables=tables,
        figures={"steering.png": plot_sweep(table)},
        pages=pages,
        text=summary_markdown(table),
        value=table,
    )


def steering_targets(
    model: Any, study: SteerOptions, layers: Mapping[str, Any], store: Any
) -> list[dict[str, Any]]:
    """For each task and layer, the feature ranked first on the task's training split (as in sparse
    probing), its largest activation on the task's positive training texts (the unit of alpha, each
    text read as in probing: BOS + the first context_size - 1 tokens), and the task's concept probe as a scorer."""
    import numpy as np
    import torch

    from mxd_lens import hooks
    from mxd_lens.analysis import probing, tasks
    from mxd_lens.analysis.inspect import top_activations
    from mxd_lens.analysis.steering import ProbeScorer, concept_probe
    from mxd_lens.layers.registry import layer_arch

    data = study.data or tasks.bundled_data()
    sets = {s.name: s for s in tasks.offline_suite(study.per_class, data)}
    known = [t for s in sets.values() for t in s.tasks]
    unknown = [t for t in study.tasks if t not in known]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; offline tasks: {known}")
    blocks = sorted({hooks.block_of(layer) for layer in layers.values()})
    # pooled MLP inputs of every suite text (cached by sparse probing): the concept probes' negatives
    dense_all = {
        name: store.get(model, s.load(data), {}, blocks, study.context_size) for name, s in sets.items()
    }
    targets = []
    for task in study.tasks:
        set_name = task.split("/", 1)[0]
        examples = sets[set_name].load(data)
        pooled = store.get(model, examples, layers, blocks, study.context_size)
        parts, y = probing.task_splits(examples, seed=0)[task]
        positives = [examples.texts[i] for i in parts["train"] if y[i]]
        concept = {}
        for block in blocks:
            key = f"mlp_in.L{block}"
            negatives = [dense_all[n][key].numpy() for n in sets if n != set_name]
            negatives.append(pooled[key].numpy()[y == 0])
            concept[block] = concept_probe(pooled[key].numpy()[y == 1], np.concatenate(negatives))
            log.info(
                "%s: concept probe (vs all other suite texts) test accuracy %.3f", task, concept[block][1]
            )
        for name, layer in layers.items():
            block = hooks.block_of(layer)
            chosen = probing.probe_task(pooled[name].numpy(), y, parts, k=1)
            feature = chosen["features"][0]
            rows = (
                torch.tensor([ids]) for ids in probing.tokenize_texts(model, positives, study.context_size)
            )
            top = top_activations(model, layer, rows, [feature], n=1, progress=False)
            # the feature's typical activation, signed (signed codes may fire negative)
            scale = float(top.activation.iloc[0])
            targets.append(
                {
                    "task": task,
                    "arch": layer_arch(layer),  # the key with options: mxd:gate=topk
                    "name": name,
                    "feature": feature,
                    "probe_k1_accuracy": chosen["test_accuracy"],
                    "concept_probe_accuracy": concept[block][1],
                    "scale": scale,
                    "layer": layer,
                    "scorers": [ProbeScorer(model, concept[block][0], block, name="concept")],
                }
            )
            log.info("%s %s: feature %d, k=1 accuracy %.3f, max activation %.3g", task, name, feature,
                     chosen["test_accuracy"], scale)  # fmt: skip
    return targets

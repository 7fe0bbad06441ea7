"""The graphs study: attribution graphs through saved layers over a suite of prompts (:mod:`mxd_lens.graph`),
scored and pruned as circuit-tracer does, written as HTML pages and circuit-tracer graph files."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.graphs import GraphsOptions


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(model: Any, options: GraphsOptions, out: Path | None = None, progress: bool = True) -> StudyResult:
    import pandas as pd
    from tqdm.auto import tqdm

    from mxd_lens.graph import build_graph, prune, scores
    from mxd_lens.graph_files import circuit_tracer_graph, page_data, page_html
    from mxd_lens.layers.registry import layer_arch
    from mxd_lens.replacement import load_replacement
    from mxd_lens.studies.common import recorded_options

    if not options.prompts:
        raise ValueError("--prompts: give at least one prompt")
    layers = load_replacement(options.layers, model, every=False)
    label = options.label or "+".join(sorted({layer_arch(layer) for layer in layers.values()}))
    rows, pages, built = [], {}, []
    for i, prompt in enumerate(tqdm(options.prompts, desc="graphs", unit="graph", disable=not progress)):
        start = time.perf_counter()
        graph = build_graph(
            model, layers, prompt, options.max_logits, options.logit_probability, options.chunk
        )
        kept = prune(graph, options.node_threshold, options.edge_threshold)
        s = scores(graph)
        seconds = time.perf_counter() - start  # built, pruned and scored
        rows.append({"method": label, "graph": i, "prompt": prompt, "tokens": graph.n_pos, "blocks": len(layers),
                     "top_logit": graph.logit_strings[0], "top_probability": float(graph.logit_probabilities[0]),
                     **s, "kept_nodes": int(kept.nodes.sum()), "kept_edges": int(kept.edges.sum()),
                     "seconds": seconds, "adjacency_mb": graph.adjacency.numel() * 4 / 2**20,
                     "peak_rss_mb": _peak_rss_mb()})  # fmt: skip
        ct = circuit_tracer_graph(
            graph, kept, slug=f"graph-{i:02d}", scan=label, node_threshold=options.node_threshold
        )
        pages[f"circuit-tracer/graph-{i:02d}.json"] = json.dumps(ct)
        # keep what the pages and the contexts need, not the [N, N] matrices (0.8 GB each at 30 blocks)
        kept_units = graph.features[kept.nodes[: graph.n_features].numpy()][["block", "unit"]]
        built.append((graph.prompt, page_data(graph, kept), kept_units))
        del graph, kept
    contexts = _contexts(model, layers, [units for *_, units in built], options, progress)
    for i, (prompt, data, _) in enumerate(built):
        r = rows[i]
        meta = (f"{label}; {r['features']:,} features, {r['kept_nodes']} nodes and {r['kept_edges']} "
                f"edges kept (node threshold {options.node_threshold}, edge threshold {options.edge_threshold}); "
                f"replacement score {r['replacement']:.3f}, completeness score {r['completeness']:.3f}")  # fmt: skip
        inner = sum(n["kind"] in ("feature", "error") for n in data["nodes"])
        if inner < data["nodes_kept"] or len(data["edges"]) < data["edges_kept"]:
            meta += (f"; drawn: the {inner:,} most influential feature and error nodes of the {data['nodes_kept']:,} "
                     f"kept, and the {len(data['edges']):,} strongest edges among them (of {data['edges_kept']:,} kept)")  # fmt: skip
        pages[f"graph-{i:02d}.html"] = page_html(data, contexts, title=prompt, meta=meta)
    pages["circuit-tracer/graph-metadata.json"] = json.dumps(
        {
            "graphs": [
                json.loads(pages[f"circuit-tracer/graph-{i:02d}.json"])["metadata"] for i in range(len(built))
            ]
        },
        indent=2,
    )
    table = pd.DataFrame(rows)
    text = (
        f"{label}: {len(built)} graphs; replacement score median {table['replacement'].median():.3f}, completeness "
        f"score median {table['completeness'].median():.3f}; the largest completeness error (|Σ in-edges + bias − "
        f"input| / max(|input|, 1)) {table['max_completeness_error'].max():.2e}"
    )
    record = {"options": recorded_options(options), "label": label}
    return StudyResult(name="graphs", table=table, record=record, pages=pages, text=text)


def _contexts(
    model: Any, layers: dict[int, Any], kept_units: list, options: GraphsOptions, progress: bool
) -> dict:
    """(block, unit) -> [(left, token, right), ...]: the top contexts of every unit kept in some graph
    (``kept_units``: a table of block and unit per graph)."""
    from mxd_lens.analysis.inspect import text_batches, top_activations_of_layers

    if options.context_tokens <= 0:
        return {}
    wanted: dict[int, set[int]] = {}
    for table in kept_units:
        for block, unit in zip(table["block"], table["unit"], strict=True):
            wanted.setdefault(int(block), set()).add(int(unit))
    if not wanted:
        return {}
    batches = text_batches(model, None, options.context_tokens, min(128, model.cfg.n_ctx))
    asked = [(layers[block], sorted(units)) for block, units in sorted(wanted.items())]
    tables = top_activations_of_layers(model, asked, batches, n=5, progress=progress)  # one forward per batch
    found = {}
    for (block, _), table in zip(sorted(wanted.items()), tables, strict=True):
        for unit, part in table.groupby("feature"):
            found[(block, int(unit))] = list(zip(part["left"], part["token"], part["right"], strict=True))
    return found

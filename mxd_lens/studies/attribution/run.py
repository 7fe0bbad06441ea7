"""Attribution through spliced layers (:func:`mxd_lens.attribution.attribute`), as two verbs:

- ``attribute``: one prompt, one set of layers: the top units, the other sources, the completeness check,
  and a report (units.csv, parts.csv, graph.png, report.html with each top unit's contexts);
- ``attribution``: each architecture's layers at one K spliced at the same blocks, over a set of prompts: how
  much of the layers' share a few units carry (``attribution_study.csv``, one row per prompt and
  architecture, named in its ``arch`` column by its key with options: ``mxd:gate=topk``), and the first
  prompt's report per architecture (OUT/ARCH/, the key with ``:`` and ``,`` as ``-``).
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.attribution import AttributeOptions, AttributionOptions


def attribute_one(model: Any, options: AttributeOptions, out: Path | None) -> StudyResult:
    import mxd_lens
    from mxd_lens import hooks
    from mxd_lens.analysis.inspect import text_batches, top_activations
    from mxd_lens.attribution import attribute, edges, logit_target, single_token
    from mxd_lens.layers.io import load_layers

    if not options.layers:
        raise ValueError("give --layers (saved layer folders to splice)")
    ids = [single_token(model, text) for text in (options.target, options.minus) if text]
    target = logit_target(*ids)
    layers = list(load_layers(options.layers, foreign=True).values())
    with mxd_lens.splice(model, *layers, error_term=options.error_term):
        result = attribute(model, options.prompt, target)
    blocks = sorted(hooks.block_of(layer) for layer in layers)
    with mxd_lens.splice(model, *layers, error_term=options.error_term):
        graph = {(a, b): edges(model, options.prompt, a, b) for a, b in zip(blocks, blocks[1:], strict=False)}
    contexts = {}
    if options.context_tokens:
        by_block = {hooks.block_of(layer): layer for layer in layers}
        for block, group in result.top(options.top).groupby("block"):
            units = sorted({int(u) for u in group.unit})
            rows = text_batches(model, None, options.context_tokens, 64)
            found = top_activations(model, by_block[int(block)], rows, units, n=3, progress=False)
            for unit, hits in found.groupby("feature"):
                contexts[(int(block), int(unit))] = " | ".join(
                    f"{left}[{token}]{right}"
                    for left, token, right in zip(hits.left, hits.token, hits.right, strict=True)
                )
    report = attribution_report(result, graph, contexts=contexts, top=options.top)
    kinds = result.parts["kind"].where(~result.parts["kind"].str.startswith("bias "), "biases (all)")
    summary = result.parts.groupby(kinds)["attribution"].sum()
    summary["units (all)"] = result.units["attribution"].sum()
    report.text = "\n\n".join(
        [
            result.top(options.top).round(4).to_markdown(index=False),
            summary.round(4).to_frame().to_markdown(),
            f"target {result.target:+.5f}; parts sum {result.total:+.5f}; completeness {result.completeness:.2e} (relative)",
        ]
    )
    return report


def attribution_report(result: Any, edge_tables: dict | None = None, contexts: dict[tuple[int, int], str] | None = None,
                       top: int = 10) -> StudyResult:  # fmt: skip
    """units.csv, parts.csv, graph.png and report.html (one self-contained page: the graph inline, the
    ranked table with each unit's top-activating contexts when ``contexts`` {(block, unit): text} is
    given, the other sources and the completeness check)."""
    from mxd_lens.attribution import plot_graph

    fig = plot_graph(result, edge_tables)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    table = result.top(top).copy()
    if contexts:
        table["contexts"] = [
            contexts.get((int(b), int(u)), "") for b, u in zip(table.block, table.unit, strict=True)
        ]
    kinds = result.parts["kind"].where(~result.parts["kind"].str.startswith("bias "), "biases (all)")
    sources = result.parts.groupby(kinds)["attribution"].sum().to_frame()
    sources.loc["units (all)"] = result.units["attribution"].sum()
    page = (
        "<!doctype html><meta charset='utf-8'><title>attribution</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}</style>"
        f"<h1>Attribution of the target ({result.target:+.5f})</h1>"
        f"<p>Parts sum {result.total:+.5f}; completeness {result.completeness:.2e} (relative).</p>"
        f"<img alt='graph' src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'>"
        f"<h2>Top {len(table)} units</h2>{table.round(5).to_html(index=False, escape=True)}"
        f"<h2>All sources</h2>{sources.round(5).to_html(escape=True)}"
        f"<p>{html.escape('Frozen at the prompt: attention patterns, norm scales, MLP outputs.')}</p>"
    )
    return StudyResult(name="units", table=result.units, tables={"parts.csv": result.parts},
                       figures={"graph.png": fig}, pages={"report.html": page}, value=result)  # fmt: skip


def run(model: Any, options: AttributionOptions, out: Path | None, progress: bool = True) -> StudyResult:
    """For each prompt and each architecture (its key with options: two MxD gates are two), its layers at
    K spliced at the study's blocks together: ``replacement_summary`` of the attribution, one row per
    (prompt, arch); the first prompt's report per architecture goes to OUT/ARCH/."""
    import pandas as pd
    from tqdm.auto import tqdm

    import mxd_lens
    from mxd_lens import hooks
    from mxd_lens.attribution import attribute, parse_prompt, replacement_summary
    from mxd_lens.layers import arch_label
    from mxd_lens.layers.io import load_layers
    from mxd_lens.layers.registry import layer_arch
    from mxd_lens.studies.report import write_result

    by_arch: dict[str, dict[int, Any]] = {}
    names: dict[tuple[str, int], str] = {}
    for name, layer in load_layers(options.layers, foreign=True).items():
        if hooks.replacement(layer).k not in (options.k, None):  # None: a JumpReLU layer from elsewhere
            continue
        arch, block = layer_arch(layer), hooks.block_of(layer)
        if (arch, block) in names:
            raise ValueError(
                f"two {arch} layers with K={options.k} at block {block} ({names[arch, block]} and {name}, "
                "e.g. two seeds): pass the folders of one run per block"
            )
        names[arch, block] = name
        by_arch.setdefault(arch, {})[block] = layer
    if not by_arch:
        raise ValueError(f"no layer with K={options.k} under {options.layers}")
    common = sorted(set.intersection(*(set(blocks) for blocks in by_arch.values())))
    blocks = sorted(options.blocks) if options.blocks else common
    missing = {
        a: sorted(set(blocks) - set(found)) for a, found in by_arch.items() if set(blocks) - set(found)
    }
    if not blocks or missing:
        raise ValueError(
            f"the blocks {blocks} need a layer of every architecture at K={options.k}; missing: "
            f"{missing or 'no common block'}"
        )
    prompts = [parse_prompt(model, spec) for spec in options.prompts]
    rows = []
    bar = tqdm(total=len(prompts) * len(by_arch), desc="attribution", disable=not progress)
    for arch, layers in sorted(by_arch.items()):
        spliced = [layers[b] for b in blocks]
        for i, (prompt, target, label) in enumerate(prompts):
            with mxd_lens.splice(model, *spliced, error_term=options.error_term):
                result = attribute(model, prompt, target)
            rows.append({"prompt": prompt, "logit": label, "arch": arch, "blocks": ",".join(map(str, blocks)),
                         **replacement_summary(result, options.top)})  # fmt: skip
            if out is not None and i == 0:
                folder = arch.replace(":", "-").replace(
                    ",", "-"
                )  # a folder name, as LearnerSpec.name writes it
                write_result(attribution_report(result, top=options.top), Path(out) / folder)
            bar.update(1)
    bar.close()
    table = pd.DataFrame(rows)
    fractions = ["top_abs_share", "error_abs_share", "top_fraction", "error_fraction"]
    stats = table.groupby("arch")[fractions].agg(["mean", "median"]).round(3)
    stats.columns = [f"{column} {stat}" for column, stat in stats.columns]
    stats.index = stats.index.map(arch_label)  # labels in the printed text only
    shown = table.drop(columns=["blocks"]).assign(arch=table.arch.map(arch_label))
    text = "\n\n".join([
        shown.round(4).to_markdown(index=False),
        "over prompts (the signed fractions divide by the spliced total, which can be near zero):\n"
        + stats.T.to_markdown(),
    ])  # fmt: skip
    return StudyResult(
        name="attribution_study",
        table=table,
        record={"study": asdict(options), "rows": json.loads(table.to_json(orient="records"))},
        text=text,
        value=table,
    )

"""An attribution graph (``mxd_lens.graph``) as files people open: a self-contained HTML page (nodes at
(position, block), edges by weight, a node's top-activating contexts on hover or click; no network), and
circuit-tracer's graph-file JSON (``slug.json`` + ``graph-metadata.json``), which its own viewer serves."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mxd_lens.graph import Graph, Pruned


def node_records(graph: Graph, pruned: Pruned) -> list[dict[str, Any]]:
    """The kept nodes: index, kind, block ("E" embeddings, n_blocks + 1 logits), position, unit, label,
    activation, influence (cumulative, as circuit-tracer records it)."""
    records = []
    f = graph.features
    n_f, n_e = graph.n_features, graph.n_errors
    for i in pruned.nodes.nonzero().flatten().tolist():
        influence = float(pruned.cumulative[i])
        if i < n_f:
            block, pos, unit, act = (
                int(f["block"][i]),
                int(f["position"][i]),
                int(f["unit"][i]),
                float(f["activation"][i]),
            )
            records.append({"index": i, "kind": "feature", "block": block, "position": pos, "unit": unit,
                            "label": f"L{block} #{unit}", "activation": act, "influence": influence})  # fmt: skip
        elif i < n_f + n_e:
            block, pos = divmod(i - n_f, graph.n_pos)
            records.append({"index": i, "kind": "error", "block": block, "position": pos, "unit": -1,
                            "label": f"L{block} error", "activation": None, "influence": influence})  # fmt: skip
        elif i < n_f + n_e + graph.n_pos:
            pos = i - n_f - n_e
            records.append({"index": i, "kind": "token", "block": "E", "position": pos, "unit": graph.tokens[pos],
                            "label": f"{graph.strings[pos]!r}", "activation": None, "influence": influence})  # fmt: skip
        else:
            j = i - n_f - n_e - graph.n_pos
            prob = float(graph.logit_probabilities[j])
            records.append({"index": i, "kind": "logit", "block": graph.n_blocks + 1, "position": graph.n_pos - 1,
                            "unit": graph.logit_tokens[j], "label": f"{graph.logit_strings[j]!r} p={prob:.3f}",
                            "activation": prob, "influence": influence})  # fmt: skip
    return records


def edge_records(graph: Graph, pruned: Pruned) -> list[tuple[int, int, float]]:
    """The kept edges (source, target, weight), strongest first."""
    targets, sources = pruned.edges.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources]
    order = weights.abs().argsort(descending=True)
    return [(int(sources[i]), int(targets[i]), float(weights[i])) for i in order]


# -- circuit-tracer's graph files -------------------------------------------------------------------


def _ct_node(graph: Graph, record: Mapping[str, Any]) -> dict[str, Any]:
    kind, pos = record["kind"], record["position"]
    common = {"ctx_idx": pos, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0,
              "clerp": "", "influence": record["influence"], "activation": record["activation"]}  # fmt: skip
    if kind == "feature":
        layer, unit = record["block"], record["unit"]
        cantor = (layer + unit) * (layer + unit + 1) // 2 + unit
        return {**common, "node_id": f"{layer}_{unit}_{pos}", "feature": cantor, "layer": str(layer),
                "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{unit}-0"}  # fmt: skip
    if kind == "error":
        layer = record["block"]
        return {**common, "node_id": f"{layer}_-1_{pos}", "feature": -1, "layer": str(layer),
                "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_-1-{pos}", "activation": None}  # fmt: skip
    if kind == "token":
        vocab = record["unit"]
        return {**common, "node_id": f"E_{vocab}_{pos}", "feature": pos, "layer": "E",
                "feature_type": "embedding", "jsNodeId": f"E_{vocab}-{pos}", "activation": None}  # fmt: skip
    vocab, layer = record["unit"], str(graph.n_blocks + 1)
    j = graph.logit_tokens.index(vocab)
    prob = float(graph.logit_probabilities[j])
    return {**common, "node_id": f"{layer}_{vocab}_{pos}", "feature": vocab, "layer": layer, "feature_type": "logit",
            "token_prob": prob, "is_target_logit": j == 0, "jsNodeId": f"L_{vocab}-{pos}",
            "clerp": f'Output "{graph.logit_strings[j]}" (p={prob:.3f})', "activation": None}  # fmt: skip


def circuit_tracer_graph(
    graph: Graph, pruned: Pruned, slug: str, scan: str, node_threshold: float = 0.8
) -> dict:
    """The graph as circuit-tracer's ``create_graph_files`` writes it (its ``Model``: metadata, qParams, nodes,
    links), from our pruned graph; only nodes with an edge, and embeddings and logits, are kept, as there."""
    records = node_records(graph, pruned)
    by_index = {r["index"]: _ct_node(graph, r) for r in records}
    links = [{"source": by_index[s]["node_id"], "target": by_index[t]["node_id"], "weight": w}
             for s, t, w in edge_records(graph, pruned) if s in by_index and t in by_index]  # fmt: skip
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    nodes = [
        n
        for n in by_index.values()
        if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")
    ]
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [], "prompt_tokens": graph.strings,
                "prompt": graph.prompt, "node_threshold": node_threshold, "schema_version": 1}  # fmt: skip
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}


def write_circuit_tracer(folder: str | Path, model: Mapping[str, Any]) -> Path:
    """``folder/SLUG.json`` and the graph's entry in ``folder/graph-metadata.json`` (circuit-tracer's
    viewer, ``circuit_tracer.frontend.local_server.serve(data_dir=folder)``, lists what that file lists)."""
    from mxd_lens.fileio import atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model['metadata']['slug']}.json"
    atomic_write_text(path, json.dumps(model))
    index = folder / "graph-metadata.json"
    listed = json.loads(index.read_text()) if index.is_file() else {"graphs": []}
    listed["graphs"] = [g for g in listed["graphs"] if g["slug"] != model["metadata"]["slug"]] + [
        dict(model["metadata"])
    ]
    atomic_write_text(index, json.dumps(listed, indent=2))
    return path


# -- the HTML page ----------------------------------------------------------------------------------

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:system-ui,sans-serif;margin:0;display:flex;height:100vh}
#graph{flex:1;overflow:auto}#side{width:360px;border-left:1px solid #ccc;padding:10px;overflow:auto;font-size:13px}
.node{cursor:pointer}.node:hover{stroke:#000;stroke-width:2}
.ctx{font-family:monospace;white-space:pre-wrap;border-bottom:1px solid #eee;padding:2px 0}.ctx b{background:#fd6}
h1{font-size:15px;margin:8px}.meta{margin:0 8px;color:#555;font-size:12px}
</style></head><body>
<div id="graph"><h1>__TITLE__</h1><p class="meta">__META__</p><svg id="svg"></svg></div>
<div id="side"><p>Hover or click a node: its label, activation, influence and top-activating contexts.</p></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const svg = document.getElementById("svg"), side = document.getElementById("side");
const NS = "http://www.w3.org/2000/svg", W = 70, H = 34, X0 = 70, Y0 = 20;
const rows = data.n_blocks + 2;  // logits on top, embeddings at the bottom
const rowOf = n => n.kind === "token" ? rows - 1 : n.kind === "logit" ? 0 : rows - 2 - n.block;
const cell = {}, place = {}, width = new Array(data.n_pos).fill(W), left = [X0];
for (const n of data.nodes) { const key = rowOf(n) + ":" + n.position; (cell[key] = cell[key] || []).push(n); }
for (const key in cell) { const p = +key.split(":")[1]; width[p] = Math.max(width[p], 16 * cell[key].length + 16); }
for (let p = 1; p <= data.n_pos; p++) left.push(left[p - 1] + width[p - 1]);  // a column as wide as its fullest cell
for (const key in cell) {
  const list = cell[key];
  list.forEach((n, i) => { place[n.index] = [left[n.position] + (i + 1) * width[n.position] / (list.length + 1), Y0 + rowOf(n) * H + H / 2]; });
}
svg.setAttribute("width", left[data.n_pos] + 20); svg.setAttribute("height", Y0 + rows * H + 40);
const max = Math.max(1e-12, ...data.edges.map(e => Math.abs(e[2])));
for (let r = 0; r < rows; r++) {
  const t = document.createElementNS(NS, "text"); t.setAttribute("x", 4); t.setAttribute("y", Y0 + r * H + H / 2 + 4);
  t.setAttribute("font-size", 10); t.textContent = r === 0 ? "logits" : r === rows - 1 ? "tokens" : "L" + (rows - 2 - r);
  svg.appendChild(t);
}
data.strings.forEach((s, p) => {
  const t = document.createElementNS(NS, "text"); t.setAttribute("x", left[p] + 4); t.setAttribute("y", Y0 + rows * H + 14);
  t.setAttribute("font-size", 10); t.textContent = s; svg.appendChild(t);
});
for (const [s, t, w] of data.edges) {
  if (!(s in place) || !(t in place)) continue;
  const l = document.createElementNS(NS, "line");
  l.setAttribute("x1", place[s][0]); l.setAttribute("y1", place[s][1]); l.setAttribute("x2", place[t][0]); l.setAttribute("y2", place[t][1]);
  l.setAttribute("stroke", w >= 0 ? "#2b6cb0" : "#c53030"); l.setAttribute("stroke-opacity", 0.15 + 0.6 * Math.abs(w) / max);
  l.setAttribute("stroke-width", 0.5 + 3 * Math.abs(w) / max); svg.appendChild(l);
}
const colour = {feature: "#f6ad55", error: "#a0aec0", token: "#68d391", logit: "#b794f4"};
function show(n) {
  const ctx = data.contexts[n.block + ":" + n.unit] || [];
  let text = "<h3 id='node-title'>" + esc(n.label) + "</h3><p>" + n.kind + " at position " + n.position +
    (n.activation === null ? "" : ", activation " + n.activation.toFixed(3)) + ", cumulative influence " + n.influence.toFixed(3) + "</p>";
  if (n.kind === "feature") text += ctx.length ? "<p>top-activating contexts:</p>" + ctx.map(c => "<div class='ctx'>" + esc(c[0]) + "<b>" + esc(c[1]) + "</b>" + esc(c[2]) + "</div>").join("") : "<p>no contexts recorded</p>";
  side.innerHTML = text;
}
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }
for (const n of data.nodes) {
  const c = document.createElementNS(NS, "circle");
  c.setAttribute("cx", place[n.index][0]); c.setAttribute("cy", place[n.index][1]); c.setAttribute("r", 6);
  c.setAttribute("fill", colour[n.kind]); c.setAttribute("class", "node"); c.setAttribute("data-node", n.index);
  c.setAttribute("data-kind", n.kind);
  const title = document.createElementNS(NS, "title"); title.textContent = n.label; c.appendChild(title);
  c.addEventListener("mouseenter", () => show(n)); c.addEventListener("click", () => show(n));
  svg.appendChild(c);
}
</script></body></html>
"""


MAX_PAGE_EDGES = 20_000  # a browser draws this many SVG lines in about a second; a million, not at all
MAX_PAGE_NODES = 1_000  # feature and error nodes: more make a position's column thousands of pixels wide


def page_data(
    graph: Graph, pruned: Pruned, max_edges: int = MAX_PAGE_EDGES, max_nodes: int = MAX_PAGE_NODES
) -> dict[str, Any]:
    """What a graph's page draws, without the graph's [N, N] matrices: its ``max_nodes`` most influential kept
    feature and error nodes (every token and logit), and the ``max_edges`` strongest kept edges among them;
    ``nodes_kept`` and ``edges_kept`` say how many the pruned graph holds."""
    nodes = node_records(graph, pruned)
    inner = sorted((n for n in nodes if n["kind"] in ("feature", "error")), key=lambda n: n["influence"])
    drawn = {n["index"] for n in inner[:max_nodes]} | {
        n["index"] for n in nodes if n["kind"] in ("token", "logit")
    }
    edges = edge_records(graph, pruned)
    among = [e for e in edges if e[0] in drawn and e[1] in drawn]
    return {"n_blocks": graph.n_blocks, "n_pos": graph.n_pos, "strings": graph.strings,
            "nodes": [n for n in nodes if n["index"] in drawn], "edges": among[:max_edges],
            "nodes_kept": len(inner), "edges_kept": len(edges)}  # fmt: skip


def graph_html(graph: Graph, pruned: Pruned, contexts: Mapping[tuple[int, int], Sequence[tuple[str, str, str]]] | None = None,
               title: str = "", meta: str = "") -> str:  # fmt: skip
    """One self-contained page: ``contexts[(block, unit)]`` = [(left, token, right), ...] for feature nodes."""
    return page_html(page_data(graph, pruned), contexts, title or graph.prompt, meta)


def page_html(data: Mapping[str, Any], contexts: Mapping[tuple[int, int], Sequence[tuple[str, str, str]]] | None = None,
              title: str = "", meta: str = "") -> str:  # fmt: skip
    """:func:`graph_html` from :func:`page_data`'s record."""
    drawn = {
        (n["block"], n["unit"]) for n in data["nodes"] if n["kind"] == "feature"
    }  # this page's units only
    kept = {f"{b}:{u}": [list(c) for c in cs] for (b, u), cs in (contexts or {}).items() if (b, u) in drawn}
    data = {**data, "contexts": kept}
    payload = json.dumps(data).replace("</", "<\\/")
    page = _PAGE.replace("__TITLE__", html.escape(title)).replace("__META__", html.escape(meta))
    return page.replace("__DATA__", payload)
